"""The training record (``training_log.json``) and the model card written from it."""
from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import transformers

from specserve.training.data import KINDS, SAMPLE_TEMPERATURE, SELF_PROMPT_TEMPERATURE, generator_for
from specserve.training.runtime import device_name


ARCH_NAMES = {"layers": "draft", "eagle": "EAGLE head", "eagle3": "EAGLE-3 head"}


def write_outputs(out: Path, record: dict) -> None:
    (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    write_model_card(out, record)


def make_record(args, argv, files, device, init_layers, out, prompts, examples, gen_seconds,
                training, started) -> dict:
    train_examples = [e for e in examples if e.split == "train"]
    return {
        "name": f"{files.name} {ARCH_NAMES[args.arch]} "
                f"({args.num_layers} layer{'s' if args.num_layers > 1 else ''})",
        "target": files.name,
        "num_layers": args.num_layers, "init_layers": init_layers, "device": device_name(device),
        "file_mb": (out / "model.safetensors").stat().st_size / 1e6,
        "args": vars(args), "command": " ".join(["python -m specserve.training", *(
            sys.argv[1:] if argv is None else argv), *([] if args.steps else ["--steps", str(training["steps"])])]),
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "data": {"train_prompts": len(prompts["train"]), "val_prompts": len(prompts["val"]),
                 "self_written_prompts": sum(source.startswith("self:") for _, source, _ in prompts["train"]),
                 "train_by_kind": {k: sum(e.kind == k and not e.sampled for e in train_examples)
                                   for k in KINDS},
                 "sampled_examples": sum(e.sampled for e in train_examples),
                 "response_tokens": sum(len(e.token_ids) - e.num_prompt for e in train_examples),
                 "max_new_tokens": args.max_new_tokens, "seconds": gen_seconds,
                 "generator": generator_for(args, device)},
        "training": training, "evaluation": None,
        "total_seconds": round(time.time() - started, 1),
    }


def write_model_card(out: Path, record: dict) -> None:
    t, d, e = record["training"], record["data"], record.get("evaluation")
    val0, val1 = t["history"]["val"][0], t["final_val"]
    eagle = record["args"].get("arch") in ("eagle", "eagle3")
    passes = record["args"].get("passes", 4)
    vocab = record.get("draft_vocab")
    eagle3 = record["args"].get("arch") == "eagle3"
    lines = [
        f"# {record['name']}",
        "",
        _eagle3_intro(record) if eagle3 else
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
        # (A draft trained for the default model becomes its built-in draft only once shipped
        # in ``drafts/``: until then it is named, as any other.)
        "Use it with its target:", "", "```bash",
        "specserve generate " + (f"--model {shlex.quote(str(record['args']['target']))} "
                                 if record["args"]["target"] is not None else "")
        + f"--speculative-method draft_model --draft-model {shlex.quote(str(record['args']['out']))} "
        "\"Why is the sky blue?\"",
        "```",
        "",
        "## How it was trained",
        "",
        (f"- **Initialisation:** its layer from target layer {record['init_layers']} (q/k/v reading the "
         "embedding's and the feature's halves alike), the target's final norm, `fc` passing the highest "
         "feature layer through, and the target's LM head rows of its draft vocabulary"
         + (f"; then trained as below, and this run continued from that checkpoint "
            f"(`--init-from {record['args']['init_from']}`)" if record["args"].get("init_from") else "") + "."
         if eagle3 else
         f"- **Initialisation:** a new head's layer from target layer {record['init_layers']} and the "
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
        "`specserve.bench.prompt_sets` (chat questions from topic lists × question templates, "
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
        f"argmax; only the draft's layers{', `fc`' if eagle else ''}{', LM head' if eagle3 else ''} and norm learn."
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
        "| | KL | " + " | ".join(f"{name} {kind}" for name in ("top-1 agreement", "accept. length")
                              for kind in KINDS) + " |",
        "| --- | ---: |" + " ---: |" * (2 * len(KINDS)),
    ]
    replayed = [("before training", val0), ("after training", val1)]
    if t.get("held_out_replay"):
        replayed.append(("held-out prompts, after training", t["held_out_replay"]))
    for label, v in replayed:
        lines.append(f"| {label} | {v['kl']} | " + " | ".join(
            _figure(v, key, kind) for key in ("top1_agreement", "sim_accept_len") for kind in KINDS) + " |")
    if e:
        n = e["num_prompts_per_kind"]
        counts = ", ".join(f"{n[kind]} {kind}" for kind in KINDS)
        lines += ["", f"Held-out prompts in the engine ({counts}), greedy, "
                  f"k = 4, up to {e['max_tokens']} new tokens, mean acceptance length (tokens per "
                  "verify step):", "", "| drafter | " + " | ".join(KINDS) + " |",
                  "| --- |" + " ---: |" * len(KINDS)]
        for method, r in e["mean_acceptance_length"].items():
            name = "this draft" if method == "draft_model" else method
            lines.append(f"| {name} | " + " | ".join(f"{r[kind]:.2f}" for kind in KINDS) + " |")
    if record.get("evaluation_error"):
        lines += ["", f"Evaluation in the engine failed: {record['evaluation_error']}"]
    lines += ["", "Validation during training:", "",
              "| step | KL | " + " | ".join(f"accept. length {kind}" for kind in KINDS) + " |",
              "| ---: | ---: |" + " ---: |" * len(KINDS)]
    for v in t["history"]["val"]:
        lines.append(f"| {v['step']} | {v['kl']} | "
                     + " | ".join(_figure(v, "sim_accept_len", kind) for kind in KINDS) + " |")
    lines += ["", "`training_log.json` beside this card holds every figure and the training curve.", "",
              "## Reproduce", "", "```bash", record["command"], "```", "",
              "Greedy output with this draft equals the target's own (speculative decoding is "
              "lossless); the draft only changes speed.", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))


def _figure(validation: dict, key: str, kind: str) -> str:
    """A validation figure's cell: its value, "no answers" where the kind had none replayed
    (``validate``'s ``answers_{kind}`` 0), blank where a record predates those counts."""
    if validation.get(f"answers_{kind}") == 0:
        return "no answers"
    return str(validation.get(f"{key}_{kind}", ""))


def _eagle3_intro(record: dict) -> str:
    vocab = record.get("draft_vocab")
    return (f"An EAGLE-3 draft head for **{record['target']}**, made for speculative decoding, in the "
            "published EAGLE-3 layout (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`/`t2d`; config "
            "`LlamaForCausalLMEagle3`), the names vLLM's EAGLE-3 loader reads. Each of its cache entries "
            "reads a token and `fc` of the target's residual stream entering target layers "
            f"{record.get('feature_layers')} at the position before it; while drafting ahead it feeds its "
            "own output instead. Its one decoder layer attends over [normed embedding; normed feature], "
            "and its own LM head drafts "
            + (f"among the {vocab['size']} tokens most frequent in its training responses ({vocab['coverage']:.1%} "
               "of them; `d2t` maps them to the target's ids), the rest getting probability 0 in q, so "
               "verification stays exact" if vocab else "over the whole vocabulary")
            + f". It stores its own weights ({record['file_mb']:.1f} MB, bf16); the target's embeddings "
            "are shared with it at load time.")
