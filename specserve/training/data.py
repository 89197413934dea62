"""Training data: prompts (the offline prompt set and the target's self-written ones), the
target's responses to them (generated once and cached), and the batches training reads."""
from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig

from specserve.bench.prompt_sets import build_prompt_set, held_out_prompts
from specserve.distributed import SINGLE, TPGroup
from specserve.engine import LLM
from specserve.loader import eos_token_ids, load_hf_config
from specserve.sampling_params import SamplingParams
from specserve.training.runtime import device_name, gather, log, quiet

SAMPLE_TEMPERATURE = 0.7
KINDS = ("chat", "code")  # the kinds of prompt a draft is trained and validated on


@dataclass
class Example:
    token_ids: list[int]   # prompt (chat template applied) + response
    num_prompt: int        # the response starts here
    kind: str              # one of KINDS
    split: str             # train | val
    sampled: bool


def select_prompts(args, tokenizer, extra_chat: list[str] = ()) -> dict[str, list[tuple[str, str, list[int]]]]:
    """(kind, source, prompt token ids) for the train and val splits, seeded order;
    training prompts alternate chat and code so any prefix of the list is balanced, and
    ``extra_chat`` (self-written prompts, all train) follows them."""
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
        encoded = {kind: [encode_prompt(tokenizer, m) for m in held_out_prompts(kind, args.eval_prompts, args.seed)]
                   for kind in KINDS}
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
    todo = [j for j in generation_order(jobs) if ResponseCache.key(j[2], j[3]) not in cache.data]
    log(f"generation: {len(jobs)} responses wanted, {len(jobs) - len(todo)} cached, "
        f"{len(todo)} to generate with {generator} on {device_name(device)}"
        + (f" and {group.size - 1} more like it" if group.size > 1 else ""))
    group.barrier()  # every rank has read the cache (and its leftover shares) before any writes a share
    mine = rank_share(todo, group.rank, group.size)
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
    counts = Counter(f"{e.split} {e.kind}" for e in examples)
    log(f"generation: {len(examples)} examples ({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))}), "
        f"{sum(len(e.token_ids) - e.num_prompt for e in examples)} response tokens")
    return examples


def generation_order(jobs: list[tuple]) -> list[tuple]:
    """The order responses are generated in, which is the order a time budget cuts from
    the end: the validation and held-out prompts' answers first (what validation and the
    held-out replay read: all of them, or the figures would be of the prompts left), then
    the training prompts' greedy answers, then each round of sampled ones; within each,
    every kind's prompts in ``select_prompts``' (seeded, shuffled) order, the kinds
    interleaved so that any prefix holds each kind's share (``_by_share``). Sorted by length
    instead, a budget cut dropped the longest prompts, mostly code, from training and
    validation alike; in ``select_prompts``' order, the self-written chat prompts last."""
    ordered = []
    for _, group in itertools.groupby(sorted(jobs, key=_generation_group), key=_generation_group):
        ordered += _by_share(list(_by_kind(group).values()))
    return ordered


def _generation_group(job: tuple) -> tuple[bool, int]:
    """(a training prompt's, its round: 0 greedy, 1 "sampled", 2 "sampled2", ...):
    ``generation_order``'s groups."""
    mode = job[3]
    return job[0] == "train", 0 if mode == "greedy" else int(mode.removeprefix("sampled") or 1)


def rank_share(order: list[tuple], rank: int, size: int) -> list[tuple]:
    """The jobs rank ``rank`` of ``size`` generates, of an order as ``generation_order``
    makes it: every ``size``-th job of each group's each kind, merged by share again. (Every
    ``size``-th job of the merged order could give a rank one kind only: chat, code, chat,
    code over two ranks.)"""
    mine = []
    for _, group in itertools.groupby(order, key=_generation_group):
        mine += _by_share([jobs[rank::size] for jobs in _by_kind(group).values()])
    return mine


def _by_kind(jobs) -> dict[str, list[tuple]]:
    by_kind: dict[str, list[tuple]] = {}
    for job in jobs:
        by_kind.setdefault(job[1], []).append(job)
    return by_kind


def _by_share(streams: list[list], size=lambda item: 1) -> list:
    """The items of every stream, each stream in its order, merged so that every prefix holds
    about each stream's share of the whole (by ``size``): each item comes at the middle of its
    own part of its stream."""
    keyed = []
    for index, items in enumerate(streams):
        total, done = sum(size(x) for x in items) or 1, 0
        for item in items:
            keyed.append(((done + size(item) / 2) / total, index, len(keyed), item))
            done += size(item)
    return [item for *_, item in sorted(keyed, key=lambda k: k[:3])]


def generator_for(args, device: torch.device) -> str:
    if args.generator != "auto":
        return args.generator
    return "hf" if device.type == "cuda" else "engine"


def eos_ids(files, tokenizer) -> list[int]:
    return sorted(eos_token_ids(files, load_hf_config(files), tokenizer))


def _batches_by_length(jobs, budget: int, max_new: int, max_batch: int):
    """HF ``generate`` batches of at most ``budget`` padded tokens and ``max_batch`` jobs, for
    ``jobs`` in ``generation_order``: per group of that order and per kind, the jobs sorted
    by prompt length (so a batch pads little) and cut into batches, those in a seeded
    shuffled order (so that a budget that ends generation early drops batches of every
    length alike, not the longest), and the kinds' batches interleaved by their share of the
    jobs (``_by_share``: any prefix keeps the kinds' mix)."""
    rng = random.Random(0)
    for _, group in itertools.groupby(jobs, key=_generation_group):
        def full(batch, job):  # (the jobs come by length: ``job`` is the longest)
            return (len(batch) + 1) * (len(job[2]) + max_new) > budget or len(batch) >= max_batch

        streams = [_length_batches(kind_jobs, lambda j: len(j[2]), full, rng)
                   for kind_jobs in _by_kind(group).values()]
        yield from _by_share(streams, size=len)


def _length_batches(items: list, length, full, rng: random.Random) -> list[list]:
    """``items`` sorted by ``length`` and cut into batches where ``full(batch, item)`` says
    the next one would not fit, the batches in ``rng``'s shuffled order (so that they come
    in no order of length, while each pads little)."""
    batches, batch = [], []
    for item in sorted(items, key=length):
        if batch and full(batch, item):
            batches.append(batch)
            batch = []
        batch.append(item)
    if batch:
        batches.append(batch)
    rng.shuffle(batches)
    return batches


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
    """The target in our engine, batched for generating data (wider on a GPU). A response
    must depend only on its prompt and seed, not on which other prompts this process (or
    rank) answers beside it or answered before: batch-invariant kernels (``deterministic``;
    a batch of other rows rounds otherwise, and a near tie sampled another token on one
    rank than in one process), and no prefix caching (KV left behind rounds differently
    in bfloat16 than computing the prefix again)."""
    return LLM(args.target, device=str(device), max_num_seqs=256 if device.type == "cuda" else 64,
               max_num_batched_tokens=2048, max_model_len=max_model_len, enable_prefix_caching=False,
               deterministic=True)


def _generate_engine(args, files, tokenizer, todo, device, deadline, cache, eos) -> None:
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


def draft_vocab(examples: list[Example], size: int) -> tuple[list[int], float]:
    """The ``size`` token ids most frequent in the responses of ``examples``, ascending,
    and the share of response tokens they cover."""
    counts: dict[int, int] = {}
    for e in examples:
        for token in e.token_ids[e.num_prompt:]:
            counts[token] = counts.get(token, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(top), sum(counts[t] for t in top) / max(1, sum(counts.values()))


PAD_TO = 64


def padded_length(length: int) -> int:
    return -(-length // PAD_TO) * PAD_TO


def make_batches(examples: list[Example], budget: int, rng: random.Random) -> list[list[Example]]:
    """Examples of similar length together, at most ``budget`` padded tokens a batch (as
    ``collate`` pads them: so the batches of one padded length have one shape)."""
    return _length_batches(examples, lambda e: len(e.token_ids),
                           lambda batch, e: (len(batch) + 1) * padded_length(len(e.token_ids)) > budget, rng)


def collate(batch: list[Example], device: torch.device, pad: int):
    """Right-padded ids ``[B, L]`` and the response positions: row and column of each
    position whose next token is a response token. Causal attention never lets a real
    token see the padding after it, so no attention mask is needed. L is a multiple of
    ``PAD_TO``: on a GPU every new shape costs kernel selection, and with exact lengths a
    first epoch is nearly all new shapes, several times slower than later ones."""
    width = padded_length(max(len(e.token_ids) for e in batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    rows, cols = [], []
    for r, e in enumerate(batch):
        ids[r, :len(e.token_ids)] = torch.tensor(e.token_ids)
        span = range(e.num_prompt - 1, len(e.token_ids) - 1)
        rows.extend([r] * len(span))
        cols.extend(span)
    return ids.to(device), torch.tensor(rows, device=device), torch.tensor(cols, device=device)
