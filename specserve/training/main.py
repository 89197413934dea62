"""``python -m specserve.training``: train a draft for a target in one command
(``docs/training-drafts.md``): prompts -> the target's responses -> training -> a
checkpoint the engine loads, with its model card -> held-out acceptance in the engine.

Several GPUs: ``torchrun --nproc-per-node N -m specserve.training ...`` (data parallel,
one process per GPU); on CPU the ranks use gloo.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specserve.distributed import destroy_tensor_parallel
from specserve.loader import cache_dir, load_tokenizer, resolve_model
from specserve.training.card import make_record, write_outputs
from specserve.training.data import draft_vocab, generate_responses, select_prompts, self_written_prompts
from specserve.training.evaluate import evaluate_in_engine
from specserve.training.loop import train
from specserve.training.runtime import device_name, join_ranks, log, pick_device
from specserve.training.students import make_student


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specserve.training",
                                description="Train a draft model for a target, in one command.")
    p.add_argument("--target", default=None, help="target model (default: the embedded default model)")
    p.add_argument("--out", required=True, help="folder for the draft checkpoint and its model card")
    p.add_argument("--work-dir", default=None, help="cache of generated responses "
                   "(default: $SPECSERVE_CACHE/draft-training)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="whole pipeline, generation and evaluation included; sets the generation "
                        "budget and the number of steps (unless --steps)")
    # data
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts (default: all)")
    p.add_argument("--num-val-prompts", type=int, default=64)
    p.add_argument("--self-prompts", type=int, default=0,
                   help="more training prompts written by the target itself: sampled from the chat "
                        "template's opening of a user turn (Magpie), deduplicated")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024, help="longer prompts are skipped")
    p.add_argument("--samples", type=int, default=2,
                   help="sampled answers (T = 0.7) per training prompt, beside the greedy one, budget allowing")
    p.add_argument("--generator", choices=("auto", "hf", "engine"), default="auto")
    p.add_argument("--generate-only", action="store_true",
                   help="stop once the prompts and responses are in --work-dir (a later run with the "
                        "same data settings trains on them without generating)")
    p.add_argument("--gen-batch-tokens", type=int, default=None,
                   help="padded tokens per HF generate batch (default: 800k on CUDA, 16k on CPU)")
    p.add_argument("--gen-max-batch", type=int, default=None,
                   help="sequences per HF generate batch (default: 1024 on CUDA, 64 on CPU)")
    p.add_argument("--gen-budget-frac", type=float, default=0.45,
                   help="share of the time budget generation may use")
    # model and training
    p.add_argument("--arch", choices=("layers", "eagle", "eagle3"), default="layers",
                   help="layers: a small model of the target's family; eagle: a head drafting from "
                        "the target's final hidden states (eagle_head.py); eagle3: an EAGLE-3 head over "
                        "three target layers with its own LM head, saved in the published layout "
                        "(eagle3_head.py)")
    p.add_argument("--eagle3-layers", default=None,
                   help="EAGLE-3: the three target layers whose input the head reads, comma-separated "
                        "(default: EAGLE's 2, L/2, L-3)")
    p.add_argument("--eagle-init-layers", default="-1",
                   help="target layers a new EAGLE head's layers start from, comma-separated (default: "
                        "one layer, the last; --init-from a layers-only draft starts the head as that "
                        "draft instead)")
    p.add_argument("--eagle-input-norms", action=argparse.BooleanOptionalAction, default=None,
                   help="EAGLE: RMS-norm the token embedding and the feature before fc (default: on for "
                        "a new head, off for one started from a layers-only draft, which then starts "
                        "as exactly that draft)")
    p.add_argument("--fc-lr-mult", type=float, default=1.0,
                   help="EAGLE: the learning rate of the head's fc (its only path from the features) "
                        "as a multiple of --lr; a head started from a trained draft has those weights "
                        "at zero while its layers are already trained")
    p.add_argument("--passes", type=int, default=4,
                   help="EAGLE: draft steps unrolled in training (training-time test), = the k it is tuned for")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft only among the N tokens most frequent in the training responses "
                        "(draft_vocab.json; a smaller LM head, as FR-Spec), and train so; 0: the whole vocabulary")
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--init-layers", default="first-last",
                   help="target layers to copy: comma-separated indices, 'first-last', 'first' or 'spread'")
    p.add_argument("--init-from", default=None,
                   help="continue from this draft checkpoint (its layers, MLP width and norm) instead "
                        "of copying target layers; its init_from_target_layers are kept")
    p.add_argument("--add-layers", default="",
                   help="with --init-from a layers-only draft: target layers (comma-separated) added to "
                        "it, each at its place in target order, with their output projections (o_proj, "
                        "down_proj) at zero, so the grown draft starts as exactly the checkpoint")
    p.add_argument("--weights", choices=("bfloat16", "int8"), default="bfloat16",
                   help="how the checkpoint stores its matrices: bfloat16, or int8 with one scale per "
                        "row (half the file; the loader dequantises them)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the draft's MLP width (default: 2/3 of the target's, a multiple of 64); a "
                        "narrower MLP keeps the target neurons with the largest weights")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from the budget, else 1000)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="padded tokens per step (default: 16384 on CUDA, 2048 on CPU)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--ce-weight", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=None, help="steps between validations (default: ~10 per run)")
    # evaluation
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts per kind (chat, code)")
    p.add_argument("--eval-max-tokens", type=int, default=128)
    p.add_argument("--eval-baselines", default="ngram,layerskip",
                   help="other drafters evaluated beside the draft ('' for none)")
    p.add_argument("--eval-reserve-s", type=float, default=None,
                   help="seconds of the budget kept for saving and evaluation (default: 60 CUDA, 240 CPU)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.time_budget_min * 60 if args.time_budget_min else None
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    group = join_ranks(args)
    device = group.device if group.size > 1 else pick_device(args.device)
    out = Path(args.out)

    files = resolve_model(args.target)
    tokenizer = load_tokenizer(files)
    work_dir = Path(args.work_dir) if args.work_dir else cache_dir() / "draft-training"
    work_dir.mkdir(parents=True, exist_ok=True)
    log(f"target {files.name} on {device_name(device)}"
        + (f" × {group.size} ranks" if group.size > 1 else "")
        + f"; budget {args.time_budget_min or 'none'} min; out {out}")

    gen_started = time.time()
    extra = self_written_prompts(args, files, tokenizer, device, work_dir, group) if args.self_prompts else []
    prompts = select_prompts(args, tokenizer, extra)
    log(f"prompts: {len(prompts['train'])} train ({len(extra)} self-written), {len(prompts['val'])} val")
    gen_deadline = started + args.time_budget_min * 60 * args.gen_budget_frac if deadline else None
    examples = generate_responses(args, files, tokenizer, prompts, device, gen_deadline, work_dir, group)
    gen_seconds = time.time() - gen_started
    if args.generate_only:
        log(f"generated in {gen_seconds:.0f} s; data in {work_dir}")
        destroy_tensor_parallel()
        return {"generated_examples": len(examples), "seconds": gen_seconds}

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype).to(device).eval()
    vocab = coverage = None
    if args.draft_vocab:  # chosen first: the draft learns to draft among these tokens
        vocab, coverage = draft_vocab([e for e in examples if e.split == "train"], args.draft_vocab)
    student = make_student(args, target, device, torch.tensor(vocab, device=device) if vocab else None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reserve = args.eval_reserve_s if args.eval_reserve_s is not None else (60 if device.type == "cuda" else 240)
    train_deadline = deadline - reserve if deadline else None
    training = train(args, student, target, examples, device, pad, train_deadline, group)
    group.barrier()
    destroy_tensor_parallel()  # rank 0 saves and evaluates alone
    if not group.is_driver:
        return {}

    student.save(files, out)
    record = make_record(args, argv, files, device, student.init_layers, out, prompts, examples, gen_seconds,
                         training, started)
    record.update(student.record())
    del student, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.draft_vocab:
        record["draft_vocab"] = {"size": args.draft_vocab, "coverage": round(coverage, 4)}
    write_outputs(out, record)  # before evaluating: a failing evaluation keeps the draft's card
    if args.eval_prompts:
        try:
            record["evaluation"] = evaluate_in_engine(args, out, device)
        except Exception as exc:  # the checkpoint is saved; say what failed and carry on
            log(f"evaluation in the engine failed: {type(exc).__name__}: {exc}")
            record["evaluation_error"] = f"{type(exc).__name__}: {exc}"
        record["total_seconds"] = round(time.time() - started, 1)
        write_outputs(out, record)
    log(f"done in {record['total_seconds']:.0f} s: {out}/model.safetensors "
        f"({record['file_mb']:.1f} MB), MODEL_CARD.md, training_log.json")
    return record
