"""GPU benchmark: correctness first, then every timing in one run, one table last.

1. Default model (SmolLM2-135M-Instruct, real weights, bf16): greedy outputs of the engine
   (Triton + CUDA graphs) against the torch reference backend run eagerly, and against HF
   transformers; then batch 1, 32 and 64 concurrent requests (chat and code-edit prompts
   alternating), plain decoding and each drafter:
   tokens/s, ms per engine step, acceptance length — beside HF ``generate`` greedy, HF
   prompt lookup and HF ``generate_batch``, same card, same run.
   Then (section ``host``) where a batch-1 decode step's time goes on the same engines:
   µs per step in each engine phase (schedule, propose, prepare, forward, sample + sync,
   update, postprocess) and the GPU time of the forward and the drafter, from
   ``host_overhead.py``; printed as its own table after the main one, and under
   ``host_overhead`` in the JSON.
2. Llama-3.1-8B shape with random bf16 weights, built on the GPU: the forward step (CUDA
   graph replay) at batch 1 against the bandwidth floor (weight bytes / measured copy
   bandwidth), the verify pass for 1 + 4 tokens against a 1-token step, batch 64 decode.

    python benchmarks/gpu_bench.py [--max-tokens 128] [--skip-8b] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------- default model
def engine_run(llm, prompts, max_tokens: int, k: int | None = None):
    from specserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            num_speculative_tokens=k)
    eng = llm.engine
    stats0 = (eng.spec_stats.num_drafts, eng.spec_stats.num_accepted_tokens)
    steps = 0
    ids = [eng.add_request(p, params) for p in prompts]
    _sync()
    start = time.perf_counter()
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.req_id] = out
        steps += 1
    _sync()
    seconds = time.perf_counter() - start
    outs = [final[i].token_ids for i in ids]
    drafts = eng.spec_stats.num_drafts - stats0[0]
    accepted = eng.spec_stats.num_accepted_tokens - stats0[1]
    tokens = sum(map(len, outs))
    return {"tokens_per_s": tokens / seconds, "ms_per_step": 1000 * seconds / steps,
            "acceptance_length": 1 + accepted / drafts if drafts else None, "token_ids": outs}


def hf_generate(model, tok, prompts, max_tokens: int, lookup: int | None = None):
    outs, seconds = [], 0.0
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                      pad_token_id=tok.pad_token_id or 0)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
        _sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, **kwargs)
        _sync()
        seconds += time.perf_counter() - start
        outs.append(out[0, enc.input_ids.shape[1]:].tolist())
    return {"tokens_per_s": sum(map(len, outs)) / seconds, "token_ids": outs}


def hf_generate_batch(model, tok, prompts, max_tokens: int):
    from transformers import GenerationConfig

    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=-1, pad_token_id=tok.pad_token_id or 0)
    _sync()
    start = time.perf_counter()
    with torch.no_grad():  # its static buffers may not be inference tensors
        results = model.generate_batch(inputs=ids, generation_config=config, progress_bar=False)
    _sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"tokens_per_s": tokens / seconds}


def default_model_section(args, rows: list, record: dict) -> None:
    from transformers import AutoModelForCausalLM

    from specserve import LLM
    from specserve.loader import resolve_model
    from workloads import WORKLOADS, chat_prompts

    common = dict(device=args.device, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)
    log("loading the default model (graphs, triton) and its eager torch twin")
    llm = LLM(**common, speculative_method="ngram", num_speculative_tokens=args.k,
              speculative_adaptive=False)
    tok = llm.tokenizer
    code = chat_prompts(tok, WORKLOADS["code-edit"])
    chat = chat_prompts(tok, WORKLOADS["chat"])
    mixed = [p for pair in zip(chat, code) for p in pair] * 4  # chat and code alternating, 64

    # --- correctness
    base = engine_run(llm, code[:4], args.max_tokens, k=0)
    ref_llm = LLM(**common, attention_backend="torch", enforce_eager=True)
    ref = engine_run(ref_llm, code[:4], args.max_tokens)
    del ref_llm
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.bfloat16).to(args.device).eval()
    hf_out = hf_generate(hf, tok, code[:4], args.max_tokens)
    spec = engine_run(llm, code[:4], args.max_tokens, k=args.k)
    agree = {name: agreement(base["token_ids"], other["token_ids"])
             for name, other in (("torch eager", ref), ("HF", hf_out), ("ngram spec", spec))}
    log(f"greedy agreement of specserve (triton + graphs) over {args.max_tokens} tokens x 4 prompts: "
        + ", ".join(f"{k}: {v:.3f}" for k, v in agree.items()))
    record["agreement"] = agree

    # --- timings
    engines = {"ngram": llm}
    for method in args.drafters:
        if method != "ngram":
            log(f"loading the engine with {method}")
            try:
                engines[method] = LLM(**common, speculative_method=method, num_speculative_tokens=args.k,
                                      speculative_adaptive=False)
                # Its proposals are verified from the device: greedy output must track speculation off.
                drafted = engine_run(engines[method], code[:4], args.max_tokens)
                agree[f"{method} spec"] = agreement(base["token_ids"], drafted["token_ids"])
                log(f"greedy agreement of {method} k={args.k} with speculation off: "
                    f"{agree[f'{method} spec']:.3f} (acceptance length {drafted['acceptance_length']})")
            except Exception as exc:  # noqa: BLE001 - one drafter failing must not stop the run
                log(f"  skipped {method}: {type(exc).__name__}: {exc}")
    card = _card()
    workloads = [("code-edit b1", 1, code[:4]), ("chat b1", 1, chat[:4]),
                 ("mixed b32", 32, mixed[:32]), ("mixed b64", 64, mixed[:64])]
    for label, batch, prompts in workloads:
        if f"b{batch}" not in args.sections.split(","):
            continue
        run = (lambda e, k: engine_run(e, prompts, args.max_tokens, k)) if batch > 1 else \
              (lambda e, k: _one_by_one(e, prompts, args.max_tokens, k))
        # Warm-up: every engine once on these very prompts, so no Triton kernel is compiled
        # for a new shape inside a timed run (a 64-request run lasts well under a second).
        run(llm, 0)
        for eng in engines.values():
            run(eng, args.k)
        off = run(llm, 0)
        entries = [("specserve, speculation off", off)]
        for method, eng in engines.items():
            entries.append((f"specserve {method} k={args.k}", run(eng, args.k)))
        if batch == 1:
            hf_plain = hf_generate(hf, tok, prompts, args.max_tokens)
            hf_lookup = hf_generate(hf, tok, prompts, args.max_tokens, lookup=8)
            entries += [("HF generate greedy", hf_plain), ("HF prompt lookup 8", hf_lookup)]
        else:
            try:
                hf_plain = hf_generate_batch(hf, tok, prompts, args.max_tokens)
            except Exception as exc:  # noqa: BLE001 - report, don't stop the run
                log(f"HF generate_batch failed: {type(exc).__name__}: {exc}")
                hf_plain = None
            if hf_plain and hf_plain["tokens_per_s"] > 0:
                entries.append(("HF generate_batch (paged)", hf_plain))
            else:
                hf_plain = None
        for name, r in entries:
            row = {"section": "SmolLM2-135M", "workload": label, "method": name,
                   "tokens_per_s": round(r["tokens_per_s"], 1),
                   "ms_per_step": round(r["ms_per_step"], 3) if "ms_per_step" in r else None,
                   "acceptance_length": round(r["acceptance_length"], 2) if r.get("acceptance_length") else None,
                   "vs_hf": round(r["tokens_per_s"] / hf_plain["tokens_per_s"], 1) if hf_plain else None,
                   "card": card}
            rows.append(row)
            log(json.dumps(row))
    if "host" in args.sections.split(","):  # last: it leaves the engines' methods wrapped
        host_section(args, llm, engines, record)


def host_section(args, llm, engines: dict, record: dict) -> None:
    """Per-phase host time of batch-1 decode steps on the engines timed above (median of
    ``--host-repeats`` runs of ``--host-steps`` steps), and the GPU time of the forward."""
    from host_overhead import format_table, measure

    log("host time per engine step, batch 1")
    # Layer-skip drafts through the target's own runner, whose phases would absorb its work.
    targets = [("off", llm, 0)] + [(f"{method} k={args.k}", eng, args.k) for method, eng in engines.items()
                                   if not getattr(eng.engine.speculator.drafter, "shares_target_cache", False)]
    results = []
    for label, eng, k in targets:
        runs = [measure(eng.engine, 1, args.host_steps, 8, sync=False, k=k) for _ in range(args.host_repeats)]
        row = {"method": label, "batch": 1,
               **{key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]}}
        results.append(row)
        log(json.dumps(row))
    record["host_overhead"] = results
    record["host_overhead_table"] = format_table(
        results, f"\nhost time per engine step (µs, median of {args.host_repeats}), default model, "
                 f"batch 1 decode, {_card()}; sample includes the wait for the GPU")


def _one_by_one(llm, prompts, max_tokens, k):
    results = [engine_run(llm, [p], max_tokens, k) for p in prompts]
    tokens = sum(len(r["token_ids"][0]) for r in results)
    seconds = sum(len(r["token_ids"][0]) / r["tokens_per_s"] for r in results)
    steps_ms = statistics.mean(r["ms_per_step"] for r in results)
    als = [r["acceptance_length"] for r in results if r["acceptance_length"]]
    return {"tokens_per_s": tokens / seconds, "ms_per_step": steps_ms,
            "acceptance_length": statistics.mean(als) if als else None,
            "token_ids": [r["token_ids"][0] for r in results]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each output's tokens before the first difference."""
    fractions = []
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        fractions.append(same / max(len(x), 1))
    return sum(fractions) / len(fractions)


# ---------------------------------------------------------------------- 8B shape
def llama_8b_config(**overrides):
    """The Llama-3.1-8B shape (``overrides``: a smaller one for dry runs)."""
    from transformers import LlamaConfig

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**shape, **overrides})


def random_llama(config, device: torch.device, dtype=torch.bfloat16, tp=None, seed: int = 0):
    """Our model with random weights made on ``device`` (never zeros: speed must not
    depend on them). With a tensor-parallel group ``tp`` only this rank's shard exists:
    the whole model is never materialised on one device."""
    from specserve.attention import get_backend
    from specserve.distributed import SINGLE
    from specserve.models import ARCHITECTURES, LlamaForCausalLM

    backend = get_backend("triton" if device.type == "cuda" else "torch", device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ARCHITECTURES["LlamaForCausalLM"], backend, tp or SINGLE)
    model = model.to(dtype).to_empty(device=device)  # allocated in ``dtype`` straight away
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.model.rotary.reset_tables(device)  # to_empty left inv_freq and the cos/sin cache garbage
    return model.eval()


def decode_step(batch: int, drafts: int, context: int, block_size: int = 16, distinct: bool = False):
    """A SchedulerOutput of ``batch`` requests each feeding 1 token + ``drafts`` drafts
    after ``context`` cached tokens (distinct blocks per request). ``distinct``: request i
    feeds token 3 + i (and drafts after it) instead of all feeding token 1, so a mixture of
    experts routes them apart as a real batch's would."""
    from specserve.sampling_params import SamplingParams
    from specserve.scheduler import ScheduledRequest, SchedulerOutput

    blocks_per = -(-(context + 1 + drafts) // block_size)
    greedy = SamplingParams(temperature=0)
    token = (lambda i: 3 + 97 * i) if distinct else (lambda i: 1)
    return SchedulerOutput([ScheduledRequest(f"r{i}", [token(i)], context,
                                             list(range(i * blocks_per, (i + 1) * blocks_per)), greedy,
                                             num_lookahead=drafts,
                                             draft_token_ids=[token(i) + 1 + j for j in range(drafts)] if distinct
                                             else [2] * drafts)
                            for i in range(batch)], [])


def median_ms(fn, reps: int, device: torch.device, warmup: int = 3) -> float:
    """Median time of ``fn()`` in ms: CUDA events on a GPU, a synchronised clock otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            _sync()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def graph_us(fn, calls: int = 20, reps: int = 30) -> float:
    """µs one call of ``fn`` takes inside a CUDA graph of ``calls`` calls (median over
    ``reps`` replays): a kernel's time with its launch gaps as a step's graph has them."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1000 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_read_bytes(model, context: int, batch: int = 1, element: int | None = None) -> int:
    """K and V one decode step reads: ``context`` tokens per request, this rank's heads,
    ``element`` bytes a value (default: the model's dtype)."""
    attn = model.model.layers[0].self_attn
    element = element or next(model.parameters()).element_size()
    return 2 * model.config.num_hidden_layers * context * attn.num_kv_heads * attn.head_dim * element * batch


def eight_b_section(args, rows: list, device: torch.device = torch.device("cuda")) -> None:
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner

    log("building the Llama-3.1-8B shape with random bf16 weights on the GPU")
    model = random_llama(llama_8b_config(), device)
    bandwidth = _copy_bandwidth(device)
    cfg = EngineConfig(device=str(device), dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
                       num_kv_blocks=4096, block_size=16)
    runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=4096)
    context = 512
    runner.enable_graphs(5, 4096)

    def step(batch: int, drafts: int) -> float:
        out = decode_step(batch, drafts, context)
        return median_ms(lambda: runner.execute(out), args.reps, device)

    floor_ms = 1000 * (weight_bytes(model) + kv_read_bytes(model, context)) / bandwidth
    decode = step(1, 0)
    verify = step(1, 4)
    b64 = step(64, 0)
    card = _card()
    for name, value, note in (
            ("batch 1 decode step (ms)", decode, f"floor {floor_ms:.2f} ms -> {decode / floor_ms:.2f}x floor"),
            ("batch 1 verify 1+4 step (ms)", verify, f"verify/decode {verify / decode:.3f}"),
            ("batch 64 decode step (ms)", b64, f"{64 * 1000 / b64:.0f} tokens/s")):
        row = {"section": "Llama-3.1-8B shape (random bf16)", "method": name, "value": round(value, 3),
               "note": note, "weight_gb": round(weight_bytes(model) / 1e9, 2),
               "copy_bandwidth_tb_s": round(bandwidth / 1e12, 2), "card": card}
        rows.append(row)
        log(json.dumps(row))


def _card() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def _copy_bandwidth(device: torch.device = torch.device("cuda"), size: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_ms(lambda: dst.copy_(src), 10, device) / 1000
    return 2 * src.numel() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--drafters", default="ngram,draft_model,layerskip")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-default", action="store_true")
    parser.add_argument("--sections", default="b1,b32,b64,host",
                        help="default-model sections: b1, b32, b64 (workloads: batch 1, 32 and 64 "
                             "concurrent requests), host (per-phase host time, batch 1)")
    parser.add_argument("--host-steps", type=int, default=64, help="host section: timed steps per run")
    parser.add_argument("--host-repeats", type=int, default=3, help="host section: runs per engine (median)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cuda (the real run) or cpu (a dry run)")
    args = parser.parse_args()
    args.drafters = args.drafters.split(",")
    rows, record = [], {}
    if not args.skip_default:
        default_model_section(args, rows, record)
    if not args.skip_8b:
        eight_b_section(args, rows, torch.device(args.device))
    log(f"\n{_card()}, torch {torch.__version__}")
    for row in rows:
        log(" | ".join(str(v) for v in row.values()))
    if "host_overhead_table" in record:
        log(record.pop("host_overhead_table"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, **record}, indent=1))


if __name__ == "__main__":
    main()
