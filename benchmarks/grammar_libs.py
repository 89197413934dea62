"""xgrammar against llguidance on the default model's tokenizer, for the choice of the
structured-output library: time to compile each JSON schema of ``json_schemas.py`` (cold,
no cache), and time per token to compute the next-token mask, accept the token, and (for
speculation) roll back, walking a valid JSON instance of each schema token by token.

Both libraries compute masks on the CPU, so this runs on the CPU of the machine that would
serve (a GPU host's CPU included).

    python benchmarks/grammar_libs.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from specserve.bench.json_schemas import SCHEMA_TASKS
from specserve.loader import load_hf_config, load_tokenizer, resolve_model

# JSON as both libraries are set to write it: ", " and ": " between items, no other whitespace.
LLGUIDANCE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# One valid instance per schema, walked token by token.
INSTANCES = {
    "person": {"name": "Ada", "age": 36}, "weather": {"city": "Paris", "temperature_c": 14.5, "sky": "cloudy"},
    "book": {"title": "Dune", "author": "Frank Herbert", "year": 1965, "genres": ["sf"]},
    "todo": {"items": [{"task": "buy milk", "done": False}]},
    "address": {"street": "1 rue de Rivoli", "city": "Paris", "zip": "75001", "country": "FR"},
    "rating": {"stars": 4, "comment": "good"}, "point": {"lat": 48.8125, "lon": 2.4375},
    "color": {"name": "teal", "rgb": [0, 128, 128]},
    "order": {"size": "large", "toppings": ["cheese", "olives"], "quantity": 2},
    "event": {"title": "standup", "day": "mon", "hour": 9, "attendees": ["Bo"]},
    "company": {"name": "Acme", "ceo": {"name": "Wile", "since": 1999}, "public": True},
    "product": {"sku": "ABC-123", "price": 9.75, "in_stock": True},
    "sentiment": {"label": "positive", "confidence": 0.75},
    "translation": {"source": "good morning", "target": "bonjour", "language": "fr"},
    "recipe": {"name": "toast", "minutes": 3, "steps": ["toast bread"]},
    "flight": {"from": "CDG", "to": "JFK", "seats": 1, "class": "economy"},
    "matrix": {"rows": [[1, 2], [3, 4]]},
    "user_profile": {"username": "ada", "settings": {"theme": "dark", "notifications": True}},
    "tool_args": {"query": "speculative decoding", "max_results": 3, "safe": True},
    "invoice": {"number": 12, "lines": [{"item": "pen", "qty": 2, "unit_price": 1.25}], "currency": "EUR"},
    "yes_no": {"answer": True, "reason": "it is"}, "planet": {"name": "Mars", "moons": 2, "rings": False},
}


def bench_xgrammar(tokenizer, vocab_size: int, tasks, ids_per_task) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compile_s, mask_s, rollback_s = [], [], []
    for task, ids in zip(tasks, ids_per_task):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(task.schema), any_whitespace=False)
        compile_s.append(time.perf_counter() - t)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        for tok in ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(tok), (task.name, tok)
            mask_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        matcher.rollback(min(4, len(ids)))
        rollback_s.append(time.perf_counter() - t)
    return _summary("xgrammar", compile_s, mask_s, rollback_s)


def bench_llguidance(tokenizer, vocab_size: int, tasks, ids_per_task) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    compile_s, mask_s, rollback_s = [], [], []
    for task, ids in zip(tasks, ids_per_task):
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(task.schema), defaults=LLGUIDANCE_JSON)
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - t)
        assert not matcher.is_error(), matcher.get_error()
        bitmask = lt.allocate_token_bitmask(1, vocab_size)
        for tok in ids:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(tok), (task.name, tok, matcher.get_error())
            mask_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        matcher.rollback(min(4, len(ids)))
        rollback_s.append(time.perf_counter() - t)
    return _summary("llguidance", compile_s, mask_s, rollback_s)


def control_byte_probe(tokenizer, vocab_size: int) -> dict:
    """Whether each library lets a raw control byte (0x15, 0x0A) into a JSON string, where
    JSON forbids it (``json.loads`` refuses the output): one token after '{"name": "'."""
    import llguidance
    import llguidance.hf
    import xgrammar as xgr
    from tokenizers import pre_tokenizers

    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the others (in
    # order) for chr(256 + i)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    schema = json.dumps(SCHEMA_TASKS[0].schema)  # person: {"name": string, "age": integer}
    prefix = tokenizer.encode('{"name": "', add_special_tokens=False)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=LLGUIDANCE_JSON)
    out = {"xgrammar": {}, "llguidance": {}}
    for byte in (0x15, 0x0A):
        token = tokenizer.convert_tokens_to_ids(chars[byte])
        xm, lm = xgr.GrammarMatcher(compiled), llguidance.LLMatcher(lltok, grammar)
        assert all(xm.accept_token(t) for t in prefix) and lm.try_consume_tokens(prefix) == len(prefix)
        out["xgrammar"][f"0x{byte:02X}"] = xm.accept_token(token)
        out["llguidance"][f"0x{byte:02X}"] = lm.validate_tokens([token]) == 1
    return out


def _summary(name, compile_s, mask_s, rollback_s) -> dict:
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"library": name, "compile_ms_median": ms(compile_s), "compile_ms_max": round(1e3 * max(compile_s), 1),
            "mask_and_accept_us_median": round(1e3 * ms(mask_s), 1),
            "mask_and_accept_us_p99": round(1e6 * sorted(mask_s)[int(0.99 * (len(mask_s) - 1))], 1),
            "rollback_us_median": round(1e3 * ms(rollback_s), 1), "tokens": len(mask_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a folder with the tokenizer and config.json "
                                                       "(default: the embedded default model)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    files = resolve_model(args.model)
    tokenizer = load_tokenizer(files, None)
    vocab_size = load_hf_config(files).vocab_size
    tasks = list(SCHEMA_TASKS)
    ids_per_task = [tokenizer.encode(json.dumps(INSTANCES[t.name]), add_special_tokens=False)
                    for t in tasks]
    rows = []
    for _ in range(args.rounds):  # taking turns
        rows.append(bench_xgrammar(tokenizer, vocab_size, tasks, ids_per_task))
        rows.append(bench_llguidance(tokenizer, vocab_size, tasks, ids_per_task))
    machine = {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
               "python": sys.version.split()[0]}
    print(f"{len(tasks)} schemas, {rows[0]['tokens']} tokens; {machine}")
    keys = ["compile_ms_median", "compile_ms_max", "mask_and_accept_us_median", "mask_and_accept_us_p99",
            "rollback_us_median"]
    print(f"{'library':<12}" + "".join(f"{k:>28}" for k in keys))
    for lib in ("xgrammar", "llguidance"):
        mine = [r for r in rows if r["library"] == lib]
        print(f"{lib:<12}" + "".join(f"{statistics.median(r[k] for r in mine):>28}" for k in keys))
    probe = control_byte_probe(tokenizer, vocab_size)
    print("lets a raw control byte into a JSON string: "
          + "; ".join(f"{lib} {accepted}" for lib, accepted in probe.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows, "control_byte_probe": probe}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
