"""Where an engine step's time goes: microseconds per step in each phase of steady-state
decoding, for batch 1 and batch 32, speculation off / n-gram / draft model.

Phases (exclusive: a phase's time excludes the phases it calls)::

    schedule     Scheduler.schedule and the per-request draft lengths
    propose      the drafter (its model's forwards included)
    prepare      SchedulerOutput -> ForwardBatch / CUDA-graph input buffers
    forward      the target's forward + logits (an eager run, or a graph replay)
    sample       rejection sampler, including its one device->host copy (the sync)
    update       Scheduler.update (append tokens, stop checks, KV rollback)
    postprocess  detokenise, stop strings, speculation counters, RequestOutputs
    other        the rest of Engine.step (step total minus the phases above)

Without ``--sync-phases`` a CUDA phase counts only the host time to launch its work and the
GPU time surfaces where the host waits for it (``sample``'s copy): that split is what
shows whether a step is bound by the host. ``--sync-phases`` synchronises after every
phase, so each phase then also holds the GPU time of the work it launched.

On CUDA each row also gets the GPU time of the target's forward (from its inputs being on
the device to its logits: the graph replay) and of the drafter, from CUDA events read
after the run: a step much longer than its GPU time is bound by the host.

By default the model is SmolLM2-135M-Instruct on CUDA, and on the CPU a tiny seeded random
Llama (2 layers, hidden 64) with the default model's tokenizer and vocabulary — whose LM
head and argmax over 49k tokens still cost about a millisecond; ``--stub-forward`` stands
in a near-free function for the models, leaving only the engine's host work to time.

    python benchmarks/host_overhead.py                       # CPU, tiny model
    python benchmarks/host_overhead.py --stub-forward --graphs   # CPU, host work only
    python benchmarks/host_overhead.py --device cuda         # the default model on the GPU
    python benchmarks/host_overhead.py --device cuda --sync-phases --profile prof/
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("schedule", "propose", "prepare", "forward", "sample", "update", "postprocess", "other")


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------- instrumentation
class PhaseTimer:
    """Exclusive wall time per phase: entering a nested phase pauses the enclosing one.
    Kept lean (about a microsecond a phase): it runs inside what it measures."""

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, start of its current slice]

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.totals[outer[0]] += now - outer[1]
        self._stack.append([name, now])

    def exit(self) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        name, start = self._stack.pop()
        self.totals[name] += now - start
        if self._stack:
            self._stack[-1][1] = now

    def wrap(self, obj, attr: str, name: str) -> bool:
        """Time ``obj.attr`` (a method) as phase ``name``; False when it has no such method."""
        fn = getattr(obj, attr, None)
        if fn is None or not callable(fn):
            return False
        enter, exit_ = self.enter, self.exit

        def timed(*args, **kwargs):
            enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                exit_()

        setattr(obj, attr, timed)
        return True

    def reset(self) -> None:
        self.totals.clear()


class _TimedCall:
    """Stands in for an object whose ``__call__`` is a phase (the rejection sampler)."""

    def __init__(self, obj, timer: PhaseTimer, name: str) -> None:
        self._obj, self._timer, self._name = obj, timer, name

    def __call__(self, *args, **kwargs):
        self._timer.enter(self._name)
        try:
            return self._obj(*args, **kwargs)
        finally:
            self._timer.exit()

    def __getattr__(self, attr):
        return getattr(self._obj, attr)


class GpuSpans:
    """GPU time between CUDA events, read once a run is over (so no extra sync):
    ``forward`` from the target's inputs being on the device to its logits (the graph
    replay itself), ``propose`` the drafter's whole span on the GPU."""

    def __init__(self) -> None:
        self.spans: dict[str, list] = defaultdict(list)
        self._open: dict[str, torch.cuda.Event] = {}

    def start(self, name: str) -> None:
        if name not in self._open:
            self._open[name] = _event()

    def stop(self, name: str) -> None:
        start = self._open.pop(name, None)
        if start is not None:
            self.spans[name].append((start, _event()))

    def wrap(self, obj, attr: str, before=None, after=None) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:
            return

        def marked(*args, **kwargs):
            if before:
                before()
            try:
                return fn(*args, **kwargs)
            finally:
                if after:
                    after()

        setattr(obj, attr, marked)

    def totals_us(self) -> dict[str, float]:
        return {name: 1000 * sum(s.elapsed_time(e) for s, e in pairs) for name, pairs in self.spans.items()}

    def reset(self) -> None:
        self.spans.clear()
        self._open.clear()


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def instrument_gpu(engine) -> GpuSpans:
    """CUDA events around the target's forward and the drafter (innermost wrappers, so
    their cost lands in the phases they mark)."""
    spans = GpuSpans()
    runner = engine.runner
    for obj in (runner, runner.graphs):
        for attr in ("prepare", "_write"):  # inputs written: the forward starts here
            spans.wrap(obj, attr, after=lambda: spans.start("forward"))
    spans.wrap(runner, "execute", after=lambda: spans.stop("forward"))
    if drafter_of(engine) is not None:
        spans.wrap(drafter_of(engine), "propose", before=lambda: spans.start("propose"),
                   after=lambda: spans.stop("propose"))
    return spans


def drafter_of(engine):
    """The engine's drafter (behind its speculator, or on the engine in earlier versions)."""
    speculator = getattr(engine, "speculator", None)
    return speculator.drafter if speculator is not None else engine.drafter


def instrument(engine, sync: bool = False) -> PhaseTimer:
    """Wrap the engine's phase methods (on these instances only) with a PhaseTimer.

    Only the target runner is wrapped: the drafter's own runner stays inside ``propose``.
    Method names of earlier versions of the engine are wrapped too where they exist, so
    one script times the code before and after a change.
    """
    timer = PhaseTimer(sync)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine, "_draft_lengths", "schedule")  # choosing k: before the speculator
    if getattr(engine, "speculator", None) is not None:
        timer.wrap(engine.speculator, "plan", "schedule")
    if drafter_of(engine) is not None:
        timer.wrap(drafter_of(engine), "propose", "propose")
    runner = engine.runner
    timer.wrap(runner, "execute", "forward")     # minus what prepare takes, as phases nest
    timer.wrap(runner, "prepare", "prepare")
    if runner.graphs is not None:
        timer.wrap(runner.graphs, "run", "forward")
        for attr in ("prepare", "_write"):       # the graph input writer (new / old name)
            timer.wrap(runner.graphs, attr, "prepare")
    engine.sampler = _TimedCall(engine.sampler, timer, "sample")
    timer.wrap(engine.scheduler, "update", "update")
    for attr in ("_postprocess", "_apply_stop_strings", "_output"):  # before / after the speculator
        timer.wrap(engine, attr, "postprocess")
    return timer


# ---------------------------------------------------------------------- models
def tiny_checkpoints(root: Path, draft_layers: int = 1) -> tuple[str, str]:
    """A 2-layer target and a ``draft_layers``-layer draft, seeded random weights, with the
    default model's tokenizer and vocabulary (so detokenising costs what it really does)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specserve.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    paths = []
    for name, layers, seed in (("target", 2, 0), ("draft", draft_layers, 1)):
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=8192, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2)
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.08)
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def build_engine(args, method: str, target: str | None, draft: str | None, graphs: bool):
    from specserve import LLMEngine
    from specserve.config import EngineConfig

    kwargs = dict(model=target, device=args.device, dtype=args.dtype, max_num_seqs=max(64, *args.batches),
                  max_num_batched_tokens=max(2048, (1 + args.k) * max(args.batches)), max_model_len=4096, seed=0)
    method, _, mode = method.partition(":")
    if method != "none":
        kwargs.update(speculative_method=method, num_speculative_tokens=args.k,
                      speculative_adaptive=mode == "adaptive")
        if method == "draft_model":
            kwargs["draft_model"] = draft
    if args.device == "cpu":
        kwargs["kv_cache_memory_gib"] = 0.25
    engine = LLMEngine(EngineConfig(**kwargs))
    if graphs and engine.runner.graphs is None:  # CPU: the graph path's padding, run eagerly
        enable = getattr(engine, "enable_graphs", None)
        if enable is not None:
            enable(capture=False)
        else:  # the engine before it had enable_graphs: the target runner only
            max_k = args.k if drafter_of(engine) else 0
            engine.runner.enable_graphs(1 + max_k, engine.max_model_len, capture=False)
    return engine


def stub_forward(engine) -> None:
    """Replace the target's and the draft model's forward and LM head by a cheap function
    of (token, position) over a 1024-token slice of the vocabulary, so that on the CPU
    every phase but ``forward`` is the engine's real host work, undisturbed by the model.
    Target and draft compute the same function: a draft model's proposals are all accepted.
    CPU only (on CUDA the graphs hold the real model)."""
    tokenizer = engine.tokenizer
    printable = [i for i in range(100, 1024) if (text := tokenizer.decode([i])).isascii() and text.isprintable()]
    table = torch.tensor(printable)

    def hidden(input_ids, positions, kv_caches, batch, num_layers=None):
        return ((input_ids * 31 + positions) % 1009).float()[:, None]

    def logits(hidden_states):
        tokens = table[(hidden_states[:, 0].long() * 7 + 13) % len(printable)]
        return torch.nn.functional.one_hot(tokens, 1024).float()

    for model in (engine.runner.model, getattr(drafter_of(engine), "model", None)):
        if model is not None:
            model.forward, model.compute_logits = hidden, logits


# ---------------------------------------------------------------------- one measurement
def prompts_for(engine, batch: int) -> list[str]:
    from workloads import WORKLOADS, chat_prompts

    code = chat_prompts(engine.tokenizer, WORKLOADS["code-edit"])
    chat = chat_prompts(engine.tokenizer, WORKLOADS["chat"])
    mixed = [p for pair in zip(code, chat) for p in pair]
    return (mixed * (batch // len(mixed) + 1))[:batch]


def measure(engine, batch: int, steps: int, warmup: int, sync: bool, profile_dir: str | None = None,
            label: str = "", gpu_events: bool = True, k: int | None = None) -> dict:
    """Decode ``batch`` requests to a steady state, then time ``steps`` engine steps.
    Returns µs per step for each phase plus the step total and tokens per step (and on
    CUDA the GPU time of the target's forward and the drafter's span). ``k`` overrides
    the engine's draft length per request (0: no speculation on a drafting engine).

    The engine's methods stay wrapped by the timers afterwards: time nothing else with it."""
    from specserve import SamplingParams

    if not hasattr(engine, "_phase_timer"):  # GPU events innermost, then the phase timer
        engine._gpu_spans = instrument_gpu(engine) if engine.device.type == "cuda" and gpu_events else None
        engine._phase_timer = instrument(engine, sync)
    timer, spans = engine._phase_timer, engine._gpu_spans
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=(steps + warmup + 8) * 8,
                            num_speculative_tokens=k)
    ids = [engine.add_request(p, params) for p in prompts_for(engine, batch)]
    sched = engine.scheduler
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        engine.step()  # prefill
    for _ in range(warmup):
        engine.step()
    _cuda_sync(engine)
    timer.reset()
    if spans:
        spans.reset()
    tokens = sum(len(sched.requests[i].all_token_ids) for i in ids)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _cuda_sync(engine)
    total = time.perf_counter() - start
    tokens = sum(len(sched.requests[i].all_token_ids) for i in ids) - tokens
    per_step = {name: 1e6 * timer.totals.get(name, 0.0) / steps for name in PHASES[:-1]}
    per_step["other"] = 1e6 * total / steps - sum(per_step.values())
    per_step["step"] = 1e6 * total / steps
    per_step["tokens_per_step"] = tokens / steps
    if spans:
        gpu = spans.totals_us()
        per_step["gpu_forward"] = gpu.get("forward", 0.0) / steps
        per_step["gpu_propose"] = gpu.get("propose", 0.0) / steps
    if profile_dir:
        _profile(engine, profile_dir, label)
    for req_id in ids:
        engine.abort(req_id)
    engine.step()
    return per_step


def _cuda_sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def _profile(engine, out_dir: str, label: str, steps: int = 12) -> None:
    """A torch.profiler trace of a few steps (chrome trace) and the top host ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(steps):
            engine.step()
        _cuda_sync(engine)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    trace = path / f"{label.replace(' ', '_').replace('=', '')}.json"
    prof.export_chrome_trace(str(trace))
    log(f"profile of {steps} steps ({label}) -> {trace}")
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if engine.device.type == "cuda":  # the kernels, with their counts per step: what bounds a replay
        log(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))


# ---------------------------------------------------------------------- the report
def run(args) -> list[dict]:
    target = draft = None
    tmp = None
    if args.model == "tiny":
        tmp = tempfile.TemporaryDirectory(prefix="host-overhead-")
        target, draft = tiny_checkpoints(Path(tmp.name))
    elif args.model != "default":
        target, draft = args.model, args.draft_model
    rows = []
    for method in args.methods:
        name, _, mode = method.partition(":")
        label_method = "off" if method == "none" else f"{name} k={args.k}" + (" adaptive" if mode else "")
        engine = build_engine(args, method, target, draft, args.graphs)
        if args.stub_forward:
            stub_forward(engine)
        results = defaultdict(list)
        for repeat in range(args.repeats):
            for batch in args.batches:  # batches interleaved within each repeat
                results[batch].append(measure(engine, batch, args.steps, args.warmup, args.sync_phases,
                                              gpu_events=not args.no_gpu_events))
        if args.profile:
            for batch in args.batches:
                measure(engine, batch, 4, args.warmup, args.sync_phases, args.profile,
                        f"{label_method} b{batch}", gpu_events=not args.no_gpu_events)
        for batch in args.batches:
            median = {key: statistics.median(r[key] for r in results[batch]) for key in results[batch][0]}
            row = {"method": label_method, "batch": batch, **{k: round(v, 1) for k, v in median.items()}}
            rows.append(row)
            log(json.dumps(row))
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if tmp is not None:
        tmp.cleanup()
    return rows


def format_table(rows: list[dict], title: str) -> str:
    gpu = [c for c in ("gpu_forward", "gpu_propose") if any(c in row for row in rows)]
    columns = ["method", "batch", *PHASES, "step", "tokens_per_step", *gpu]
    header = ["method", "b", *PHASES, "step µs", "tok/step", *gpu]
    lines = [title, " | ".join(header)]
    for row in rows:
        lines.append(" | ".join(str(row.get(c, "")) for c in columns))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None,
                        help="tiny (CPU default), default (SmolLM2-135M, CUDA default) or a path")
    parser.add_argument("--draft-model", default=None, help="draft checkpoint for --model PATH")
    parser.add_argument("--methods", default="none,ngram,draft_model",
                        help="comma-separated: none, ngram, draft_model, layerskip; METHOD:adaptive "
                             "lets the engine choose each request's k")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per config (median)")
    parser.add_argument("--sync-phases", action="store_true",
                        help="torch.cuda.synchronize() after every phase (CUDA)")
    parser.add_argument("--no-gpu-events", action="store_true",
                        help="CUDA: no events around the forward and the drafter (GPU time columns)")
    parser.add_argument("--graphs", action="store_true",
                        help="CPU: run the CUDA-graph padded input path eagerly (capture=False)")
    parser.add_argument("--stub-forward", action="store_true",
                        help="CPU: a near-free stand-in for the models, so the other phases are pure host work")
    parser.add_argument("--profile", default=None, help="folder for torch.profiler traces")
    parser.add_argument("--json", default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.model is None:
        args.model = "default" if args.device.startswith("cuda") else "tiny"
    if args.sync_phases and not args.device.startswith("cuda"):
        args.sync_phases = False
    if args.stub_forward and args.device.startswith("cuda"):
        parser.error("--stub-forward is for the CPU (CUDA graphs hold the real model)")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = run(args)
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    model = f"{args.model} model{' (forward stubbed)' if args.stub_forward else ''}"
    title = (f"\nhost time per engine step (µs, median of {args.repeats}), {model}, {card}, "
             f"torch {torch.__version__}{', phases synchronised' if args.sync_phases else ''}"
             f"{', graph input path (eager)' if args.graphs else ''}")
    log(format_table(rows, title))
    if args.json:
        Path(args.json).write_text(json.dumps({"card": card, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
