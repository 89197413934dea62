"""Train a small draft model for a target by distilling the target into a few of its own
layers, in one command: prompts -> the target's responses -> training -> a layers-only
checkpoint with its model card -> held-out acceptance in the engine.

    python -m specserve.drafts.train_draft --out drafts/smollm2_draft --time-budget-min 8

1. Prompts: ``prompt_sets.build_prompt_set`` (offline: the benchmark workloads and prompts
   generated for the project, split train / val / test by source; test is never trained on),
   plus ``--self-prompts`` user messages the target writes itself (Magpie: sampled from the
   chat template's opening of a user turn), all for training. ``--generate-only`` stops
   once prompts and responses are cached, for a later run to train on.
2. Data: the target answers every training and validation prompt greedily and, while the
   generation budget lasts, ``--samples`` more times sampled at temperature 0.7, with the
   chat template applied. HF ``generate`` (batched, left-padded; bf16 on CUDA) or our engine (``auto``:
   the engine on CPU, where its bf16 path is faster). Responses are cached under
   ``--work-dir``, so a rerun skips what is already generated.
3. Training: the draft is ``--num-layers`` decoder layers initialised from the target's
   layers ``--init-layers`` plus the target's final norm, on top of the target's own
   embeddings and LM head (frozen, shared). Loss on response positions: forward
   KL(p_target || q_draft) with target logits computed on the fly, plus ``--ce-weight`` ×
   cross-entropy to the target's argmax. AdamW, linear warm-up then cosine decay, bf16
   autocast on CUDA (and on CPUs with native bf16). With a time budget the number of steps
   is fixed after a short calibration and printed, so ``--steps`` reproduces the run.
   Validation: KL and the greedy acceptance length at k = 4 replayed exactly on the
   validation responses (draft argmax vs target argmax under teacher forcing, the first
   response token being the prefill's, as in the engine); after
   training, the same on the held-out evaluation prompts' greedy answers.
   ``--arch eagle`` trains an EAGLE-style head instead (``eagle_training.py``): a layer that
   drafts from the target's final hidden states, or a head started as a layers-only draft
   (``--init-from``) that learns to use them, its draft steps unrolled in training.
4. Output (``--out``): ``model.safetensors`` with the draft's layers and norm only (bf16),
   ``draft_vocab.json`` with ``--draft-vocab N`` (the N tokens most frequent in the training
   responses: the draft proposes among those only, and its training losses are over those
   tokens, the target's distribution renormalised over them),
   ``config.json`` (the target's config with the draft's layer count and
   ``"specserve_draft": {"shares_target_embeddings": true, ...}``), ``training_log.json``
   and ``MODEL_CARD.md`` with the figures.
5. Evaluation: the engine with the new draft, n-gram and layer-skip on held-out chat and
   code prompts, greedy, k = 4: mean acceptance length, as ``spec_stats`` counts it.

Several GPUs: ``torchrun --nproc-per-node N -m specserve.drafts.train_draft ...`` (data
parallel, one process per GPU). The ranks write the self-written prompts and the responses
a share each (with the engine generator every response is seeded by what it answers, so
the data do not depend on N, but for rounding where batched numerics differ; HF
``generate`` seeds a batch), then train on N batches a step — one each, the gradients
averaged — so a step sees N × ``--batch-tokens``; rank 0 validates, saves and evaluates.
On CPU the ranks use gloo.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specserve.distributed import SINGLE, TPGroup, destroy_tensor_parallel, init_tensor_parallel

SAMPLE_TEMPERATURE = 0.7


def quiet() -> bool:
    """Whether this process is a data-parallel rank other than 0 (rank 0 speaks for all)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def log(message: str) -> None:
    if not quiet():
        print(f"[train_draft {time.strftime('%H:%M:%S')}] {message}", flush=True)


def join_ranks(args) -> TPGroup:
    """The data-parallel group torchrun started (``WORLD_SIZE`` > 1), else one process.
    Each rank runs on ``cuda:LOCAL_RANK`` (or the CPU, with gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return SINGLE
    if args.device not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"under torchrun each rank uses cuda:LOCAL_RANK: pass --device auto, cuda or cpu, "
                         f"not {args.device!r}")
    return init_tensor_parallel(world, args.device)


def gather(group: TPGroup, part):
    """Every rank's ``part`` (any picklable value), in rank order, on every rank."""
    if group.size == 1:
        return [part]
    parts = [None] * group.size
    torch.distributed.all_gather_object(parts, part)
    return parts


@dataclass
class Example:
    token_ids: list[int]   # prompt (chat template applied) + response
    num_prompt: int        # the response starts here
    kind: str              # chat | code
    split: str             # train | val
    sampled: bool


# ---------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specserve.drafts.train_draft",
                                description=__doc__.splitlines()[0])
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
    p.add_argument("--arch", choices=("layers", "eagle"), default="layers",
                   help="layers: a small model of the target's family; eagle: a head drafting from "
                        "the target's final hidden states (eagle_training.py)")
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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def use_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    from specserve.models.packed_linear import bf16_packing_supported

    return bf16_packing_supported()


# ---------------------------------------------------------------------------- prompts
def select_prompts(args, tokenizer, extra_chat: list[str] = ()) -> dict[str, list[tuple[str, str, list[int]]]]:
    """(kind, source, prompt token ids) for the train and val splits, seeded order;
    training prompts alternate chat and code so any prefix of the list is balanced, and
    ``extra_chat`` (self-written prompts, all train) follows them."""
    from specserve.drafts.prompt_sets import build_prompt_set

    rng = random.Random(args.seed)
    chosen = {}
    everything = build_prompt_set(args.seed)
    for split, limit in (("train", args.num_prompts), ("val", args.num_val_prompts)):
        by_kind: dict[str, list] = {}
        for prompt in everything:
            if prompt.split == split:
                by_kind.setdefault(prompt.kind, []).append(prompt)
        for group in by_kind.values():
            rng.shuffle(group)
        mixed = [p for row in itertools.zip_longest(*by_kind.values()) for p in row if p is not None]
        items = []
        for prompt in mixed:
            ids = encode_prompt(tokenizer, prompt.text)
            if len(ids) + 16 <= args.max_seq_len:
                items.append((prompt.kind, prompt.source, ids))
        chosen[split] = items[:limit] if limit is not None else items
    held_out = {p.text.strip().lower() for p in everything if p.split != "train"}
    for i, text in enumerate(extra_chat):
        ids = encode_prompt(tokenizer, text)
        if text.strip().lower() not in held_out and len(ids) + 16 <= args.max_seq_len:
            chosen["train"].append(("chat", f"self:{i}", ids))
    if args.eval_prompts:  # the engine's held-out prompts, answered greedily: replayed after training
        from specserve.drafts.prompt_sets import held_out_prompts

        encoded = {kind: [encode_prompt(tokenizer, m) for m in held_out_prompts(kind, args.eval_prompts, args.seed)]
                   for kind in ("chat", "code")}
        chosen["test"] = [(kind, "held-out", ids) for kind, all_ids in encoded.items()
                          for ids in all_ids if len(ids) + 16 <= args.max_seq_len]
    return chosen


SELF_PROMPT_TEMPERATURE = 1.0
SELF_PROMPT_MAX_TOKENS = 128


def user_turn_opening(tokenizer) -> list[int]:
    """The chat template's text up to where a user's message begins (its default system
    turn included): what an instruct model continues with a user message of its own."""
    mark = "\x00user-message\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return tokenizer(text[:text.index(mark)], add_special_tokens=False)["input_ids"]


def self_written_prompts(args, files, tokenizer, device, work_dir: Path, group: TPGroup = SINGLE) -> list[str]:
    """``--self-prompts`` user messages written by the target (Magpie: sampled at
    temperature 1 from the opening of a user turn, seeded per message), kept when the turn
    ended, is at least 16 characters and not seen before; cached under ``work_dir``. Ranks
    write every ``group.size``-th message each."""
    from specserve import SamplingParams

    settings = f"{files.name}|{args.self_prompts}|{args.seed}|{SELF_PROMPT_TEMPERATURE}|{SELF_PROMPT_MAX_TOKENS}"
    path = work_dir / f"self-prompts-{hashlib.sha256(settings.encode()).hexdigest()[:12]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--self-prompts needs a target with a chat template (it writes user turns)")
    opening = user_turn_opening(tokenizer)
    llm = generation_engine(args, device, max_model_len=len(opening) + SELF_PROMPT_MAX_TOKENS + 16)
    mine = range(group.rank, args.self_prompts, group.size)
    params = [SamplingParams(temperature=SELF_PROMPT_TEMPERATURE, max_tokens=SELF_PROMPT_MAX_TOKENS,
                             seed=args.seed * 7919 + i) for i in mine]
    outs = llm.generate([opening] * len(params), params, use_tqdm=False)
    llm.engine.shutdown()
    del llm
    mine_written = {i: (out.text.strip(), out.finish_reason == "stop") for i, out in zip(mine, outs)}
    written = {i: pair for part in gather(group, mine_written) for i, pair in part.items()}
    seen, prompts = set(), []
    for i in range(args.self_prompts):
        text, ended = written[i]
        if ended and len(text) >= 16 and text.lower() not in seen:
            seen.add(text.lower())
            prompts.append(text)
    if group.is_driver:
        path.write_text(json.dumps(prompts, indent=0))
    log(f"self-written prompts: {len(prompts)} kept of {args.self_prompts}")
    return prompts


def encode_prompt(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------- generation
class ResponseCache:
    """Generated responses keyed by (prompt ids, mode); saved after every batch. A
    data-parallel rank saves its share beside the cache (``<name>.rank<N>.pt``) until the
    shares are merged; a run that stopped before then finds them there and keeps them."""

    def __init__(self, path: Path, shares: bool = True) -> None:
        self.path = path
        self.data: dict[str, list[int]] = torch.load(path) if path.is_file() else {}
        for share in self.shares() if shares else []:
            self.data.update(torch.load(share))

    def shares(self) -> list[Path]:
        return sorted(self.path.parent.glob(f"{self.path.stem}.rank*.pt"))

    def share(self, rank: int) -> "ResponseCache":
        return ResponseCache(self.path.with_name(f"{self.path.stem}.rank{rank}.pt"), shares=False)

    @staticmethod
    def key(prompt_ids: list[int], mode: str) -> str:
        return hashlib.sha256(f"{mode}:{prompt_ids}".encode()).hexdigest()[:24]

    def save(self) -> None:
        tmp = self.path.with_suffix(".partial")
        torch.save(self.data, tmp)
        tmp.replace(self.path)


def job_seed(args, job) -> int:
    """A sampled response's seed in the engine generator: from what it answers, so the
    data do not depend on what was cached before, on the batching or on the number of
    ranks (HF ``generate`` takes one seed a batch)."""
    return args.seed * 1_000_003 + int(ResponseCache.key(job[2], job[3])[:12], 16)


def generate_responses(args, files, tokenizer, prompts, device, deadline: float | None,
                       work_dir: Path, group: TPGroup = SINGLE) -> list[Example]:
    """Greedy responses for every prompt, then sampled ones while the budget lasts; ranks
    generate every ``group.size``-th missing one each, then share them."""
    settings = f"{files.name}|{args.max_new_tokens}|{args.seed}|{generator_for(args, device)}"
    cache = ResponseCache(work_dir / f"responses-{hashlib.sha256(settings.encode()).hexdigest()[:12]}.pt")
    generator = generator_for(args, device)
    eos = eos_ids(files, tokenizer)
    jobs = [(split, kind, ids, "greedy") for split in ("val", "train", "test")
            for kind, _, ids in prompts.get(split, [])]
    for round_ in range(args.samples):  # "sampled", "sampled2", ...: one round after another
        mode = "sampled" + (str(round_ + 1) if round_ else "")
        jobs += [("train", kind, ids, mode) for kind, _, ids in prompts["train"]]
    todo = [j for j in jobs if ResponseCache.key(j[2], j[3]) not in cache.data]
    log(f"generation: {len(jobs)} responses wanted, {len(jobs) - len(todo)} cached, "
        f"{len(todo)} to generate with {generator} on {device_name(device)}"
        + (f" and {group.size - 1} more like it" if group.size > 1 else ""))
    group.barrier()  # every rank has read the cache (and its leftover shares) before any writes a share
    mine = todo[group.rank::group.size]
    share = cache if group.size == 1 else cache.share(group.rank)
    if mine:
        run = _generate_engine if generator == "engine" else _generate_hf
        run(args, files, tokenizer, mine, device, deadline, share, eos)
    for part in gather(group, share.data) if group.size > 1 else []:
        cache.data.update(part)
    if group.is_driver and cache.shares():  # merged: one file again
        cache.save()
        for leftover in cache.shares():
            leftover.unlink()
    group.barrier()
    examples = []
    for split, kind, ids, mode in jobs:
        response = cache.data.get(ResponseCache.key(ids, mode))
        if response:
            full = (ids + response)[:args.max_seq_len]
            examples.append(Example(full, len(ids), kind, split, mode != "greedy"))
    log(f"generation: {len(examples)} examples, "
        f"{sum(len(e.token_ids) - e.num_prompt for e in examples)} response tokens")
    return examples


def generator_for(args, device: torch.device) -> str:
    if args.generator != "auto":
        return args.generator
    return "hf" if device.type == "cuda" else "engine"


def eos_ids(files, tokenizer) -> list[int]:
    from specserve.loader import eos_token_ids, load_hf_config

    return sorted(eos_token_ids(files, load_hf_config(files), tokenizer))


def _batches_by_length(jobs, budget: int, max_new: int, max_batch: int):
    """Jobs sorted by prompt length, cut into batches of at most ``budget`` padded tokens."""
    order = sorted(jobs, key=lambda j: (j[3] != "greedy", j[3], len(j[2])))
    batch: list = []
    for job in order:
        longest = max([len(job[2])] + [len(j[2]) for j in batch])
        if batch and ((len(batch) + 1) * (longest + max_new) > budget or len(batch) >= max_batch
                      or job[3] != batch[0][3]):
            yield batch
            batch = []
        batch.append(job)
    if batch:
        yield batch


def _cut_response(tokens: list[int], eos: list[int], pad: int | None) -> list[int]:
    out = []
    for token in tokens:
        out.append(token)
        if token in eos:
            break
    while out and pad is not None and out[-1] == pad and pad not in eos:
        out.pop()
    return out


def _generate_hf(args, files, tokenizer, todo, device, deadline, cache, eos) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    cuda = device.type == "cuda"
    budget = args.gen_batch_tokens or (800_000 if cuda else 16_384)
    max_batch = args.gen_max_batch or (1024 if cuda else 64)
    batches = list(_batches_by_length(todo, budget, args.max_new_tokens, max_batch))
    bar = tqdm(total=len(todo), desc="generating", unit="resp", mininterval=5, disable=quiet())
    for index, batch in enumerate(batches):
        if deadline is not None and time.time() > deadline:
            log(f"generation budget spent: {len(todo) - bar.n} responses not generated")
            break
        width = max(len(j[2]) for j in batch)
        input_ids = torch.tensor([[pad] * (width - len(j[2])) + j[2] for j in batch], device=device)
        mask = torch.tensor([[0] * (width - len(j[2])) + [1] * len(j[2]) for j in batch], device=device)
        sampled = batch[0][3] != "greedy"
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=sampled,
                                  temperature=SAMPLE_TEMPERATURE if sampled else 1.0,
                                  top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=pad)
        torch.manual_seed(args.seed * 1_000_003 + index)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        for job, row in zip(batch, out[:, width:].tolist()):
            cache.data[ResponseCache.key(job[2], job[3])] = _cut_response(row, eos, pad)
        cache.save()
        bar.update(len(batch))
    bar.close()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def generation_engine(args, device: torch.device, max_model_len: int):
    """The target in our engine, batched for generating data (wider on a GPU)."""
    from specserve import LLM

    return LLM(args.target, device=str(device), max_num_seqs=256 if device.type == "cuda" else 64,
               max_num_batched_tokens=2048, max_model_len=max_model_len)


def _generate_engine(args, files, tokenizer, todo, device, deadline, cache, eos) -> None:
    from specserve import SamplingParams

    llm = generation_engine(args, device, max_model_len=args.max_seq_len + args.max_new_tokens)
    chunk = 2048 if device.type == "cuda" else 64
    bar = tqdm(total=len(todo), desc="generating", unit="resp", mininterval=5, disable=quiet())
    for start in range(0, len(todo), chunk):
        if deadline is not None and time.time() > deadline:
            log(f"generation budget spent: {len(todo) - start} responses not generated")
            break
        batch = todo[start:start + chunk]
        params = [SamplingParams(temperature=SAMPLE_TEMPERATURE if j[3] != "greedy" else 0.0,
                                 seed=job_seed(args, j), max_tokens=args.max_new_tokens)
                  for j in batch]
        outs = llm.generate([j[2] for j in batch], params, use_tqdm=False)
        for job, out in zip(batch, outs):
            cache.data[ResponseCache.key(job[2], job[3])] = list(out.token_ids)
        cache.save()
        bar.update(len(batch))
    bar.close()
    llm.engine.shutdown()


# ---------------------------------------------------------------------------- the draft
def parse_init_layers(spec: str, num_layers: int, target_layers: int) -> list[int]:
    if spec == "first-last":
        layers = list(range(num_layers - 1)) + [target_layers - 1]
    elif spec == "spread":
        layers = [round(i * (target_layers - 1) / max(1, num_layers - 1)) for i in range(num_layers)]
    elif spec == "first":
        layers = list(range(num_layers))
    else:
        layers = [int(x) for x in spec.split(",")]
    if len(layers) != num_layers or not all(0 <= i < target_layers for i in layers):
        raise SystemExit(f"--init-layers {spec!r}: need {num_layers} indices in [0, {target_layers})")
    return layers


def parse_added_layers(args, from_layers_draft: bool, target_layers: int) -> list[int]:
    if not args.add_layers:
        return []
    if not from_layers_draft or args.arch == "eagle":
        raise SystemExit("--add-layers grows a layers-only draft: name it with --init-from")
    try:
        added = [int(x) % target_layers for x in args.add_layers.split(",")]
    except ValueError:
        raise SystemExit(f"--add-layers {args.add_layers!r}: comma-separated layer indices") from None
    return added


def build_draft(target, init_layers: list[int], device: torch.device, intermediate_size: int | None = None):
    """A ``len(init_layers)``-layer HF model of the target's family: its layers and final
    norm copied from the target (float32 master weights), its embeddings and LM head the
    target's own modules (frozen). A narrower MLP keeps the target's widest neurons."""
    import copy

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(init_layers)
    config.intermediate_size = intermediate_size or config.intermediate_size
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in init_layers]
    draft = type(target)(config)
    for mine, theirs in zip(draft.model.layers, init_layers):
        mine.load_state_dict(_narrowed(target.model.layers[theirs].state_dict(), config.intermediate_size))
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft = draft.float().to(device)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return draft


def load_own_weights(draft, path: Path, layer_at: list[int] | None = None) -> None:
    """The draft's own layers and norm from a checkpoint ``save_draft`` wrote (its int8
    matrices dequantised). ``layer_at[i]``: the draft layer that takes checkpoint layer i (a
    grown draft, ``grow_draft``); the other layers keep their weights."""
    from safetensors.torch import load_file

    from specserve.errors import ModelLoadError
    from specserve.loader import dequantize_int8_state

    try:
        state = dequantize_int8_state(load_file(str(path)), str(path))
    except ModelLoadError as exc:
        raise SystemExit(f"--init-from: {exc}") from None
    own = own_parameters(draft)
    expected = set(own)
    if layer_at is not None:
        def moved(name: str) -> str:
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) < len(layer_at):
                parts[2] = str(layer_at[int(parts[2])])
            return ".".join(parts)
        state = {moved(name): t for name, t in state.items()}
        taken = {str(i) for i in layer_at}
        expected = {n for n in own if not n.startswith("model.layers.") or n.split(".")[2] in taken}
    if set(state) != expected:
        raise SystemExit(f"--init-from {path}: its tensors do not match a {len(draft.model.layers)}-layer draft")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.float())


def grow_draft(target, start_layers: list[int], added: list[int], device: torch.device,
               intermediate_size: int, checkpoint: Path):
    """A draft of target layers ``start_layers`` + ``added`` (in target order; none added:
    the checkpoint as it is): the checkpoint's layers where they were, each added layer copied from the target (MLP
    narrowed as ``build_draft``) with ``o_proj`` and ``down_proj`` at zero. Those layers
    then add nothing to the residual stream: the grown draft computes exactly what the
    checkpoint does, and training starts from there. Returns (draft, its target layers)."""
    if set(added) & set(start_layers) or len(set(added)) != len(added):
        raise SystemExit(f"--add-layers {added}: the checkpoint already has target layers {start_layers}")
    layers = list(start_layers)  # their order kept; each added one before the first higher one
    for i in sorted(added):
        layers.insert(next((at for at, j in enumerate(layers) if j > i), len(layers)), i)
    draft = build_draft(target, layers, device, intermediate_size)
    load_own_weights(draft, checkpoint, [layers.index(i) for i in start_layers])
    with torch.no_grad():
        for i in added:
            layer = draft.model.layers[layers.index(i)]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return draft, layers


def _narrowed(state: dict, width: int) -> dict:
    """A decoder layer's weights with only the ``width`` MLP neurons of largest
    ‖down column‖ · (‖gate row‖ + ‖up row‖)."""
    gate, up, down = (state[f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    if gate.shape[0] == width:
        return state
    importance = down.float().norm(dim=0) * (gate.float().norm(dim=1) + up.float().norm(dim=1))
    keep = importance.topk(width).indices.sort().values
    state = dict(state)
    for name in ("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"):
        if f"mlp.{name}" in state:
            state[f"mlp.{name}"] = state[f"mlp.{name}"][keep]
    state["mlp.down_proj.weight"] = down[:, keep]
    return state


def own_parameters(draft) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in draft.named_parameters()
            if n.startswith(("model.layers.", "model.norm."))}


# ---------------------------------------------------------------------------- training
PAD_TO = 64


def padded_length(length: int) -> int:
    return -(-length // PAD_TO) * PAD_TO


def make_batches(examples: list[Example], budget: int, rng: random.Random) -> list[list[Example]]:
    """Examples of similar length together, at most ``budget`` padded tokens a batch (as
    ``collate`` pads them: so the batches of one padded length have one shape)."""
    order = sorted(examples, key=lambda e: len(e.token_ids))
    batches, batch = [], []
    for example in order:
        if batch and (len(batch) + 1) * padded_length(len(example.token_ids)) > budget:
            batches.append(batch)
            batch = []
        batch.append(example)
    if batch:
        batches.append(batch)
    rng.shuffle(batches)
    return batches


def collate(batch: list[Example], device: torch.device, pad: int):
    """Right-padded ids ``[B, L]`` and the response positions: row and column of each
    position whose next token is a response token. Causal attention never lets a real
    token see the padding after it, so no attention mask is needed. L is a multiple of
    ``PAD_TO``: on a GPU every new shape costs kernel selection, and with exact lengths a
    first epoch is nearly all new shapes (an H200 ran its first ~450 steps at ~420 ms,
    later ones at ~95)."""
    width = padded_length(max(len(e.token_ids) for e in batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    rows, cols = [], []
    for r, e in enumerate(batch):
        ids[r, :len(e.token_ids)] = torch.tensor(e.token_ids)
        span = range(e.num_prompt - 1, len(e.token_ids) - 1)
        rows.extend([r] * len(span))
        cols.extend(span)
    return ids.to(device), torch.tensor(rows, device=device), torch.tensor(cols, device=device)


def logits_at(model, ids, rows, cols, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits at the training rows; with ``vocab`` (a draft vocabulary), those
    tokens' only, in its order."""
    hidden = model.model(input_ids=ids).last_hidden_state
    return head_logits(model.lm_head, hidden[rows, cols], vocab)


def head_logits(lm_head, hidden: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    weight = lm_head.weight if vocab is None else lm_head.weight[vocab]
    return F.linear(hidden, weight).float()


class TargetDistribution:
    """What a draft learns at each training row: the target's distribution p over the
    draft's vocabulary (the whole one, or ``vocab``: p renormalised over those tokens — all
    the draft can propose, as the engine's q is then zero elsewhere) and its argmax, with
    which a draft's logits over the same tokens give per-row forward KL(p || q),
    cross-entropy to the argmax and agreement."""

    def __init__(self, target_logits: torch.Tensor, vocab: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            argmax = target_logits.argmax(dim=-1)
            self.column = argmax  # the argmax's column in the draft's logits; -1: not there
            if vocab is not None:
                column_of = torch.full((target_logits.shape[-1],), -1, dtype=torch.long, device=vocab.device)
                column_of[vocab] = torch.arange(len(vocab), device=vocab.device)
                self.column = column_of[argmax]
                target_logits = target_logits[:, vocab]
            self.log_p = F.log_softmax(target_logits.float(), dim=-1)
            self.p = self.log_p.exp()
            self.p_log_p = (self.p * self.log_p).sum(-1)  # minus p's entropy

    def terms(self, draft_logits: torch.Tensor):
        """Per row: (KL(p || q), cross-entropy to the argmax — 0 where the draft's vocabulary
        lacks it —, whether it is in the vocabulary, whether the draft's argmax is it)."""
        log_q = F.log_softmax(draft_logits, dim=-1)
        kl = self.p_log_p - (self.p * log_q).sum(-1)
        has = self.column >= 0
        ce = -log_q.gather(1, self.column.clamp(min=0)[:, None]).squeeze(1) * has
        return kl, ce, has, (draft_logits.argmax(-1) == self.column) & has

    def loss(self, draft_logits: torch.Tensor, ce_weight: float, valid: torch.Tensor | None = None):
        """(kl + ce_weight × ce, kl, ce, agree) averaged over the rows (``valid`` ones)."""
        kl, ce, has, agree = self.terms(draft_logits)
        if valid is not None:
            has, agree = has & valid, agree & valid
        rows = valid if valid is not None else torch.ones_like(has)
        kl = (kl * rows).sum() / rows.sum().clamp(min=1)
        ce = (ce * has).sum() / has.sum().clamp(min=1)
        return kl + ce_weight * ce, kl, ce, agree


def distill_loss(draft_logits, target_logits, ce_weight: float, vocab: torch.Tensor | None = None):
    loss, kl, ce, _ = TargetDistribution(target_logits, vocab).loss(draft_logits, ce_weight)
    return loss, kl, ce


def lr_at(step: int, steps: int | None, args) -> float:
    """Linear warm-up over ``--warmup-steps``, then cosine decay to ``min_lr_frac`` × lr at
    ``steps`` (not yet known while a time budget is being calibrated: warm-up only)."""
    warmup = max(1, args.warmup_steps)
    if step < warmup or steps is None:
        return args.lr * min(1.0, (step + 1) / warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def chain_acceptance(agree: list[list[bool]], k: int) -> tuple[int, int]:
    """Greedy chain drafting replayed on one response: ``agree[t][i]`` says whether the
    t-th draft of a chain whose first proposal is token i - t predicts response token i as
    the target does (a layers draft under teacher forcing sees exactly the accepted tokens,
    so its one row serves every t; an EAGLE head has one row per unrolled pass). Token 0
    comes from the prefill; each verify step proposes from the next token on, accepts the
    run of agreeing drafts (at most k) and emits one more. Returns (verify steps, accepted
    drafts)."""
    length = len(agree[0])
    steps = accepted = 0
    i = 1
    while i < length:
        run = 0
        while run < k and i + run < length and agree[min(run, len(agree) - 1)][i + run]:
            run += 1
        steps += 1
        accepted += run
        i += run + 1
    return steps, accepted


@torch.no_grad()
def validate(model, batches, device, pad, autocast, score, k: int = 4) -> dict:
    """Mean KL, pass 0's top-1 agreement and the acceptance length of greedy chain drafting
    at ``k`` replayed on each greedy answer (``chain_acceptance``), per kind.
    ``score(ids, rows, cols)`` gives the batch's (mean KL, agreement ``[passes, rows]``)."""
    model.eval()
    kl_sum = n = 0.0
    counts: dict[str, list[int]] = {}
    for batch in batches:
        ids, rows, cols = collate(batch, device, pad)
        with autocast():
            kl, agree = score(ids, rows, cols)
        kl_sum += kl.item() * len(rows)
        n += len(rows)
        agree = agree.tolist()
        start = 0
        for e in batch:
            length = len(e.token_ids) - e.num_prompt
            if not e.sampled:
                steps, accepted = chain_acceptance([a[start:start + length] for a in agree], k)
                c = counts.setdefault(e.kind, [0, 0, 0, 0])
                c[0] += steps
                c[1] += accepted
                c[2] += sum(agree[0][start:start + length])
                c[3] += length
            start += length
    model.train()
    result = {"kl": round(kl_sum / max(n, 1), 4)}
    for kind, (steps, accepted, top1, length) in sorted(counts.items()):
        result[f"sim_accept_len_{kind}"] = round(1 + accepted / max(steps, 1), 3)
        result[f"top1_agreement_{kind}"] = round(top1 / max(length, 1), 4)
    return result


def draft_score(draft, target, vocab: torch.Tensor | None = None):
    """``validate``'s score for a layers-only draft: one agreement row, teacher-forced."""
    def score(ids, rows, cols):
        t_logits = logits_at(target, ids, rows, cols)
        d_logits = logits_at(draft, ids, rows, cols, vocab)
        _, kl, _, agree = TargetDistribution(t_logits, vocab).loss(d_logits, 0.0)
        return kl, agree[None]
    return score


class StepBudget:
    """How many training steps fit before ``deadline``. Steps [40, 100) are timed (the
    first ones pay one-off costs: kernel selection, the allocator growing for new shapes)
    and fix the number; until then the learning rate warms up and holds at its peak. Steps
    [100, 300) are timed again and fix it anew — they have run faster than the first window
    — while a long run's cosine decay has barely begun. Validations (``val_seconds``, one
    entry each, appended by the caller; the first before training) are not step time, and
    about ten a run are set aside. Past the deadline training stops where it is."""

    MARKS = (40, 100, 300)

    def __init__(self, deadline: float, val_seconds: list[float]) -> None:
        self.deadline = deadline
        self.val_seconds = val_seconds
        self.steps: int | None = None
        self.message = ""
        self._timer = self._from = self._vals = None

    def at(self, step: int, now: float) -> int | None:
        """Called before each step: the number of steps (None until step 100)."""
        if step in self.MARKS and (self.steps is None or self.steps > 2 * self.MARKS[-1]):
            if self._timer is not None:
                per_step = (now - self._timer - sum(self.val_seconds[self._vals:])) / (step - self._from)
                left = self.deadline - now - max(0, 11 - len(self.val_seconds)) * self.val_seconds[-1]
                self.steps = step + max(1, int(left / (per_step * 1.03)))  # 3 %: jitter
                self.message = (f"training: {per_step * 1000:.0f} ms per step over steps [{self._from}, {step}) "
                                f"-> {self.steps} steps (pass --steps {self.steps} to reproduce)")
            self._timer, self._from, self._vals = now, step, len(self.val_seconds)
        if now > self.deadline and (self.steps is None or step < self.steps):
            self.steps = step
            self.message = f"training: the budget ran out at step {step}"
        return self.steps


def average_gradients(params: list[torch.nn.Parameter], group: TPGroup) -> None:
    """Data parallelism's one exchange a step: the ranks' gradients averaged, in one
    all-reduce of them all flattened."""
    if group.size == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = group.all_reduce(torch.cat([g.reshape(-1) for g in grads])) / group.size
    for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p).to(p.dtype)


def train(args, target, draft, examples, device, pad, deadline: float | None,
          vocab: torch.Tensor | None = None, group: TPGroup = SINGLE) -> dict:
    """``vocab``: the draft vocabulary it will draft among; losses and validation are then
    over those tokens only (``TargetDistribution``). With several ranks each step takes
    ``group.size`` batches of the one shuffled order, one a rank; rank 0 validates and
    decides when a time budget ends."""
    rng = random.Random(args.seed)
    budget = args.batch_tokens or (16384 if device.type == "cuda" else 2048)
    train_set = [e for e in examples if e.split == "train"]
    val_batches = make_batches([e for e in examples if e.split == "val"], budget, random.Random(0))
    eagle = args.arch == "eagle"
    params = draft.own_parameters() if eagle else own_parameters(draft)
    for p in target.parameters():
        p.requires_grad_(False)
    for p in params.values():  # one starting point (a head's new weights are random)
        group.broadcast(p.data)
    fc = [p for n, p in params.items() if n.startswith("fc.")]  # an EAGLE head's input projection
    decay = [p for n, p in params.items() if p.dim() >= 2 and not n.startswith("fc.")]
    no_decay = [p for n, p in params.items() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay, "lr_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0}]
    if fc:
        groups.append({"params": fc, "weight_decay": args.weight_decay, "lr_mult": args.fc_lr_mult})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    bf16 = use_bf16(device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    history = {"train": [], "val": []}

    if eagle:
        from specserve.drafts.eagle_training import head_score

        score, k = head_score(draft, target, args.passes, vocab), args.passes
    else:
        score, k = draft_score(draft, target, vocab), 4

    def check(batches) -> dict:
        return validate(draft, batches, device, pad, autocast, score, k)

    val_started = time.time()
    initial = check(val_batches) if group.is_driver else {}
    val_seconds = [time.time() - val_started]  # each validation's time: not training time
    history["val"].append({"step": 0, **initial})
    log(f"validation before training: {initial}")

    def next_batch() -> list[Example]:
        """This rank's batch of the step: the rank-th of the next ``group.size``."""
        nonlocal epoch_batches
        taken = []
        for _ in range(group.size):
            if not epoch_batches:
                epoch_batches = make_batches(train_set, budget, rng)
            taken.append(epoch_batches.pop())
        return taken[group.rank]

    epoch_batches: list = []
    steps = args.steps if args.steps or deadline is None else None
    steps = steps or (1000 if deadline is None else None)
    budget_steps = StepBudget(deadline, val_seconds) if steps is None else None
    step = tokens_seen = 0
    started = time.time()
    bar = None
    draft.train()
    while True:
        if budget_steps is not None:
            if step in budget_steps.MARKS and device.type == "cuda":
                torch.cuda.synchronize(device)
            fixed = budget_steps.at(step, time.time())
            if group.size > 1:  # rank 0's clock decides
                fixed = int(group.broadcast(torch.tensor([-1 if fixed is None else fixed], device=device)).item())
                fixed = None if fixed < 0 else fixed
            if fixed != steps:
                steps = fixed
                log(budget_steps.message)
                if bar is not None:
                    bar.total = steps
        if steps is not None and step >= steps:
            break
        if bar is None and steps is not None:
            bar = tqdm(total=steps, initial=step, desc="training", unit="step", mininterval=10, disable=quiet())
        ids, rows, cols = collate(next_batch(), device, pad)
        lr = lr_at(step, steps, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr * param_group["lr_mult"]
        with autocast():
            if eagle:
                from specserve.drafts.eagle_training import head_losses

                loss, kl, ce, _ = head_losses(draft, target, ids, rows, cols, args.passes, args.ce_weight, vocab)
            else:
                with torch.no_grad():
                    t_logits = logits_at(target, ids, rows, cols)
                d_logits = logits_at(draft, ids, rows, cols, vocab)
                loss, kl, ce = distill_loss(d_logits, t_logits, args.ce_weight, vocab)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(list(params.values()), group)
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        tokens_seen += len(rows)
        step += 1
        if bar is not None:
            bar.update(1)
        every = args.eval_every or max(1, (steps or 10**9) // 10)
        if step % 10 == 0 or step == steps:
            history["train"].append({"step": step, "lr": round(lr, 7), "loss": round(loss.item(), 4),
                                     "kl": round(kl.item(), 4), "ce": round(ce.item(), 4),
                                     "grad_norm": round(norm.item(), 3)})
        if steps is not None and (step % every == 0 or step == steps) and group.is_driver:
            val_started = time.time()
            result = {"step": step, **check(val_batches)}
            val_seconds.append(time.time() - val_started)
            history["val"].append(result)
            log(f"step {step}/{steps}: train kl {kl.item():.3f} ce {ce.item():.3f} | val {result}")
    if bar is not None:
        bar.close()
    seconds = time.time() - started
    if group.size > 1:
        tokens_seen = int(group.all_reduce(torch.tensor([tokens_seen], device=device)).item())
    test = [e for e in examples if e.split == "test"]
    held_out = check(make_batches(test, budget, random.Random(0))) if test and group.is_driver else None
    if held_out:
        log(f"held-out prompts, teacher-forced: {held_out}")
    return {"steps": steps, "seconds": round(seconds, 1), "batch_tokens": budget, "ranks": group.size,
            "held_out_replay": held_out,
            "response_tokens_seen": tokens_seen, "epochs": round(tokens_seen / max(1, sum(
                len(e.token_ids) - e.num_prompt for e in train_set)), 2),
            "history": history, "final_val": history["val"][-1]}


# ---------------------------------------------------------------------------- saving
def save_draft(draft, files, init_layers: list[int], out: Path, weights: str = "bfloat16") -> None:
    """The draft's own layers and norm; with ``weights="int8"`` each matrix as int8 values
    and a scale per row (``loader.quantize_int8_rows``), the norms in bf16."""
    from safetensors.torch import save_file

    from specserve.loader import INT8_SCALE_SUFFIX, quantize_int8_rows

    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, p in own_parameters(draft).items():
        p = p.detach().cpu()
        if weights == "int8" and p.dim() == 2:
            state[name], state[name + INT8_SCALE_SUFFIX] = quantize_int8_rows(p)
        else:
            state[name] = p.to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((files.path / "config.json").read_text())
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "id2label", "label2id"):
        config.pop(key, None)
    config["num_hidden_layers"] = len(init_layers)
    config["intermediate_size"] = draft.config.intermediate_size
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][i] for i in init_layers]
    config["dtype"] = "bfloat16"
    config["specserve_draft"] = {"shares_target_embeddings": True, "target": files.name,
                                 "init_from_target_layers": init_layers, "weights": weights,
                                 "trained_by": "python -m specserve.drafts.train_draft"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def draft_vocab(examples: list[Example], size: int) -> tuple[list[int], float]:
    """The ``size`` token ids most frequent in the responses of ``examples``, ascending,
    and the share of response tokens they cover."""
    counts: dict[int, int] = {}
    for e in examples:
        for token in e.token_ids[e.num_prompt:]:
            counts[token] = counts.get(token, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(top), sum(counts[t] for t in top) / max(1, sum(counts.values()))


# ---------------------------------------------------------------------------- evaluation
def evaluate_in_engine(args, out: Path, device: torch.device) -> dict:
    """Held-out chat and code prompts, greedy, k = 4, all at once: mean acceptance length
    for the trained draft and the baseline drafters."""
    from specserve.drafts.prompt_sets import held_out_prompts

    from specserve import LLM, SamplingParams

    prompts = {kind: held_out_prompts(kind, args.eval_prompts, args.seed) for kind in ("chat", "code")}
    methods = {"draft_model": {"draft_model": str(out)}}
    methods.update({m: {} for m in args.eval_baselines.split(",") if m})
    params = SamplingParams(temperature=0, max_tokens=args.eval_max_tokens)
    results = {}
    for method, extra in methods.items():
        # k fixed at 4: an adaptive engine would draft only where it pays on this device.
        llm = LLM(args.target, device=str(device), speculative_method=method, num_speculative_tokens=4,
                  speculative_adaptive=False, max_num_seqs=32,
                  max_model_len=args.max_seq_len + args.eval_max_tokens, **extra)
        tokenizer = llm.tokenizer
        results[method] = {}
        for kind, messages in prompts.items():
            ids = [p for p in (encode_prompt(tokenizer, m) for m in messages) if len(p) <= args.max_seq_len]
            outs = llm.generate(ids, params, use_tqdm=False)
            drafts = sum(o.spec_stats.num_drafts for o in outs)
            accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
            results[method][kind] = round(1 + accepted / drafts, 3) if drafts else 1.0
        log(f"held-out acceptance length, k = 4, {method}: {results[method]}")
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"num_prompts_per_kind": {k: len(v) for k, v in prompts.items()},
            "max_tokens": args.eval_max_tokens, "k": 4, "mean_acceptance_length": results}


# ---------------------------------------------------------------------------- model card
def write_model_card(out: Path, record: dict) -> None:
    t, d, e = record["training"], record["data"], record.get("evaluation")
    val0, val1 = t["history"]["val"][0], t["final_val"]
    eagle = record["args"].get("arch") == "eagle"
    passes = record["args"].get("passes", 4)
    vocab = record.get("draft_vocab")
    lines = [
        f"# {record['name']}",
        "",
        (f"An EAGLE-style draft head of {record['num_layers']} decoder layer(s) for **{record['target']}**, "
         "made for speculative decoding in specserve. Each of its cache entries reads a token and the "
         "target's final hidden state at the position before it (`fc([embedding; hidden])`"
         + (", each RMS-normed first" if record.get("input_norms") else "") +
         "), so it drafts from what the target has already computed; while drafting ahead it feeds its "
         "own output instead. It stores only its own layers, `fc` and final norm "
         if eagle else
         f"A {record['num_layers']}-layer draft model for **{record['target']}**, made for speculative "
         "decoding in specserve. It stores only its own decoder layers and final norm ")
        + f"({record['file_mb']:.1f} MB, "
        + ("int8 matrices with a scale per row, dequantised when loaded"
           if record["args"].get("weights") == "int8" else "bf16")
        + "); the target's embeddings and (tied) LM head are shared "
        "with it at load time, same storage, so it costs no memory for them."
        + (f" It drafts among the {vocab['size']} tokens most frequent in its training responses "
           f"(`draft_vocab.json`, {vocab['coverage']:.1%} of them), and was trained so (its losses over "
           "those tokens): a smaller LM head, the rest get probability 0 in q — verification stays exact."
           if vocab else ""),
        "",
        *(["It is the built-in draft of the embedded default model, used when no other is named:",
           "", "```bash", "specserve generate --speculative-method draft_model \"Why is the sky blue?\"",
           "```"] if record["args"]["target"] is None else [
            "Use it with its target:", "", "```bash",
            f"specserve generate --model {record['target']} --speculative-method draft_model "
            f"--draft-model {record['args']['out']} \"Why is the sky blue?\"", "```"]),
        "",
        "## How it was trained",
        "",
        (f"- **Initialisation:** a new head's layer from target layer {record['init_layers']} and the "
         "target's final norm, `fc` adding embedding and feature."
         if eagle and not record["args"].get("init_from") else
         f"- **Initialisation:** target layers {record['init_layers']} and the target's final norm"
         f", MLPs narrowed to the target's {record['args']['intermediate_size']} widest neurons"
         + (f"; then trained as below, and this run continued from that checkpoint "
            f"(`--init-from {record['args']['init_from']}`)" if record["args"].get("init_from") else "")
         + (f", growing it by target layers {record['args']['add_layers']} with their output projections "
            "at zero (`--add-layers`), so the grown draft started as exactly that checkpoint"
            if record["args"].get("add_layers") else "")
         + ("; `fc` passes the embedding through and starts with the features' half at zero, so the "
            "head starts as the draft it was made from" if eagle and record["args"].get("init_from") else "")
         + "."),
        f"- **Data:** {d['train_prompts']} training prompts ({d['train_by_kind']['chat']} chat, "
        f"{d['train_by_kind']['code']} code), built offline by "
        "`specserve.drafts.prompt_sets` (chat questions from topic lists × question templates, "
        "writing and maths tasks, code tasks and explain/summarise/rewrite tasks over Python "
        "standard-library functions and docstrings)"
        + (f", {d['self_written_prompts']} of them (chat) written by the target itself: user messages "
           f"sampled at temperature {SELF_PROMPT_TEMPERATURE} from the chat template's opening of a user "
           "turn (Magpie), deduplicated" if d.get("self_written_prompts") else "")
        + ". The target answered each with the chat "
        f"template applied: greedy, plus {d['sampled_examples']} sampled answers at temperature "
        f"{SAMPLE_TEMPERATURE}; at most {d['max_new_tokens']} new tokens; {d['response_tokens']} "
        f"response tokens in all, generated with "
        f"{'HF transformers generate' if d['generator'] == 'hf' else 'the specserve engine'} "
        f"in {d['seconds']:.0f} s.",
        "- **Held out:** the benchmark workloads (`benchmarks/workloads.py`) and every prompt whose "
        "source (topic, function, document) hashes into the test bucket (10 %); a further 5 % "
        f"(validation, {d['val_prompts']} prompts) is watched during training. Neither is trained on.",
        f"- **Objective:** forward KL(target ‖ draft) on response positions with the target's logits "
        f"computed on the fly, plus {record['args']['ce_weight']} × cross-entropy to the target's "
        f"argmax; only the draft's layers{', `fc`' if eagle else ''} and norm learn."
        + (f" The head's {passes} draft steps are unrolled (training-time test): step t reads its own "
           "step t-1 output as feature and attends to the target-feature entries before the chain and "
           f"to the chain's earlier entries, exactly as when drafting; step t's loss is weighted 0.8^t."
           if eagle else ""),
        f"- **Optimisation:** AdamW (lr {record['args']['lr']}"
        + (f", `fc` at {fc_mult:g}× that" if eagle and (fc_mult := record["args"].get("fc_lr_mult", 1.0)) != 1 else "")
        + ", betas 0.9/0.95, weight decay "
        f"{record['args']['weight_decay']}), {record['args']['warmup_steps']} warm-up steps then cosine "
        f"decay, {t['steps']} steps of ≤ {t['batch_tokens']} padded tokens, "
        f"{t['response_tokens_seen']} response tokens seen ({t['epochs']} epochs), "
        f"{t['seconds']:.0f} s on {record['device']}, seed {record['args']['seed']}.",
        f"- **Whole run:** {record['total_seconds']:.0f} s, {record['date']}, torch "
        f"{record['torch']}, transformers {record['transformers']}, Python {record['python']}.",
        "",
        "## Figures",
        "",
        "Validation (teacher forcing on the validation prompts' greedy answers; acceptance length "
        f"at k = {passes if eagle else 4} replayed exactly from draft-vs-target argmax agreement"
        + (", each draft step of a chain with its own unrolled pass" if eagle else "") + "):",
        "",
        "| | KL | top-1 agreement chat | top-1 agreement code | accept. length chat | accept. length code |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    replayed = [("before training", val0), ("after training", val1)]
    if t.get("held_out_replay"):
        replayed.append(("held-out prompts, after training", t["held_out_replay"]))
    for label, v in replayed:
        lines.append(f"| {label} | {v['kl']} | {v.get('top1_agreement_chat', '')} | "
                     f"{v.get('top1_agreement_code', '')} | {v.get('sim_accept_len_chat', '')} | "
                     f"{v.get('sim_accept_len_code', '')} |")
    if e:
        n = e["num_prompts_per_kind"]
        lines += ["", f"Held-out prompts in the engine ({n['chat']} chat, {n['code']} code), greedy, "
                  f"k = 4, up to {e['max_tokens']} new tokens, mean acceptance length (tokens per "
                  "verify step):", "", "| drafter | chat | code |", "| --- | ---: | ---: |"]
        for method, r in e["mean_acceptance_length"].items():
            name = "this draft" if method == "draft_model" else method
            lines.append(f"| {name} | {r['chat']:.2f} | {r['code']:.2f} |")
    if record.get("evaluation_error"):
        lines += ["", f"Evaluation in the engine failed: {record['evaluation_error']}"]
    lines += ["", "Validation during training:", "", "| step | KL | accept. length chat | accept. length code |",
              "| ---: | ---: | ---: | ---: |"]
    for v in t["history"]["val"]:
        lines.append(f"| {v['step']} | {v['kl']} | {v.get('sim_accept_len_chat', '')} | "
                     f"{v.get('sim_accept_len_code', '')} |")
    lines += ["", "`training_log.json` beside this card holds every figure and the training curve.", "",
              "## Reproduce", "", "```bash", record["command"], "```", "",
              "Greedy output with this draft equals the target's own (speculative decoding is "
              "lossless); the draft only changes speed.", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))


# ---------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.time_budget_min * 60 if args.time_budget_min else None
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    group = join_ranks(args)
    device = group.device if group.size > 1 else pick_device(args.device)
    out = Path(args.out)

    from transformers import AutoModelForCausalLM

    from specserve.loader import cache_dir, load_tokenizer, resolve_model

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
    start = json.loads((Path(args.init_from) / "config.json").read_text()) if args.init_from else None
    if start:  # a warm start: the checkpoint's shape, then its weights
        init_layers = start["specserve_draft"]["init_from_target_layers"]
        args.num_layers, args.intermediate_size = len(init_layers), start["intermediate_size"]
    elif args.arch == "eagle":
        total = target.config.num_hidden_layers
        try:
            init_layers = [int(x) % total for x in args.eagle_init_layers.split(",")]
        except ValueError:
            raise SystemExit(f"--eagle-init-layers {args.eagle_init_layers!r}: comma-separated layer indices") from None
        args.num_layers, args.intermediate_size = len(init_layers), target.config.intermediate_size
    else:
        init_layers = parse_init_layers(args.init_layers, args.num_layers, target.config.num_hidden_layers)
    width = target.config.intermediate_size * 2 // 3
    args.intermediate_size = args.intermediate_size or (width // 64 * 64 if width >= 64 else width)
    start_is_eagle = bool(start) and start["specserve_draft"].get("kind") == "eagle"
    if args.weights != "bfloat16" and args.arch == "eagle":
        raise SystemExit("--weights int8 stores a layers-only draft; an EAGLE head is saved in bf16")
    added = parse_added_layers(args, bool(start) and not start_is_eagle, target.config.num_hidden_layers)
    if start and not start_is_eagle:  # a warm start, grown by the added layers if any
        draft, init_layers = grow_draft(target, init_layers, added, device, args.intermediate_size,
                                        Path(args.init_from) / "model.safetensors")
        args.num_layers = len(init_layers)
    else:
        draft = build_draft(target, init_layers, device, args.intermediate_size)
    if args.arch == "eagle":
        from specserve.drafts.eagle_training import EagleHead, load_head_weights

        # From a layers-only draft: start as that draft; else on embedding + feature.
        from_layers = bool(start) and not start_is_eagle
        norms = args.eagle_input_norms
        if start_is_eagle:
            had = bool(start["specserve_draft"].get("input_norms"))
            if norms is not None and norms != had:
                raise SystemExit(f"--init-from {args.init_from} has input_norms {had}: drop --[no-]eagle-input-norms")
            norms = had
        input_norms = not from_layers if norms is None else norms
        draft = EagleHead(target, draft.model.layers, draft.model.norm, "tokens" if from_layers else "sum",
                          input_norms=input_norms).to(device)
        if start_is_eagle:
            load_head_weights(draft, Path(args.init_from) / "model.safetensors")
    elif start_is_eagle:
        raise SystemExit(f"--init-from {args.init_from} is an EAGLE head: add --arch eagle")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reserve = args.eval_reserve_s if args.eval_reserve_s is not None else (60 if device.type == "cuda" else 240)
    train_deadline = deadline - reserve if deadline else None
    vocab = coverage = None
    if args.draft_vocab:  # chosen first: the draft learns to draft among these tokens
        vocab, coverage = draft_vocab([e for e in examples if e.split == "train"], args.draft_vocab)
    training = train(args, target, draft, examples, device, pad, train_deadline,
                     torch.tensor(vocab, device=device) if vocab else None, group)
    group.barrier()
    destroy_tensor_parallel()  # rank 0 saves and evaluates alone
    if not group.is_driver:
        return {}

    if args.arch == "eagle":
        from specserve.drafts.eagle_training import save_head

        save_head(draft, files, init_layers, out)
    else:
        save_draft(draft, files, init_layers, out, args.weights)
    if vocab:
        (out / "draft_vocab.json").write_text(json.dumps(vocab) + "\n")
    del draft, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    record = make_record(args, argv, files, device, init_layers, out, prompts, examples, gen_seconds,
                         training, started)
    if args.draft_vocab:
        record["draft_vocab"] = {"size": args.draft_vocab, "coverage": round(coverage, 4)}
    if args.arch == "eagle":
        record["input_norms"] = input_norms
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


def write_outputs(out: Path, record: dict) -> None:
    (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    write_model_card(out, record)


def make_record(args, argv, files, device, init_layers, out, prompts, examples, gen_seconds,
                training, started) -> dict:
    import transformers

    train_examples = [e for e in examples if e.split == "train"]
    return {
        "name": f"{files.name} {'EAGLE head' if args.arch == 'eagle' else 'draft'} "
                f"({args.num_layers} layer{'s' if args.num_layers > 1 else ''})",
        "target": files.name,
        "num_layers": args.num_layers, "init_layers": init_layers, "device": device_name(device),
        "file_mb": (out / "model.safetensors").stat().st_size / 1e6,
        "args": vars(args), "command": " ".join(["python -m specserve.drafts.train_draft", *(
            sys.argv[1:] if argv is None else argv), *([] if args.steps else ["--steps", str(training["steps"])])]),
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "data": {"train_prompts": len(prompts["train"]), "val_prompts": len(prompts["val"]),
                 "self_written_prompts": sum(source.startswith("self:") for _, source, _ in prompts["train"]),
                 "train_by_kind": {k: sum(e.kind == k and not e.sampled for e in train_examples)
                                   for k in ("chat", "code")},
                 "sampled_examples": sum(e.sampled for e in train_examples),
                 "response_tokens": sum(len(e.token_ids) - e.num_prompt for e in train_examples),
                 "max_new_tokens": args.max_new_tokens, "seconds": gen_seconds,
                 "generator": generator_for(args, device)},
        "training": training, "evaluation": None,
        "total_seconds": round(time.time() - started, 1),
    }


if __name__ == "__main__":
    main()
