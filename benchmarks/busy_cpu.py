"""``specserve generate`` on a CPU that other work keeps busy: tokens/s with the machine
quiet and with ``--load`` processes spinning beside it, for each thread setting.

Each setting runs ``specserve generate --json`` in a fresh process (the default model,
greedy, EOS ignored) and reads its own tokens/s; the busy processes are plain Python loops,
one per ``--load``, started before and stopped after each loaded run. Settings: the
default (specserve's choice of threads and OpenMP's waiting), and whatever else is named
with ``--setting NAME=ENV...|FLAGS`` (e.g. ``one=--cpu-threads 1``).

    python benchmarks/busy_cpu.py
    python benchmarks/busy_cpu.py --load 2 --max-tokens 64 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys

DEFAULT_SETTINGS = [
    "default=",                        # specserve's choice: sleep at once only on a busy machine
    "always-spin=OMP_WAIT_POLICY=",    # OpenMP's own default whatever the load (before #35)
    "always-sleep=OMP_WAIT_POLICY=PASSIVE",
    "one-thread=--cpu-threads 1",
]


def _spin() -> None:
    while True:
        pass


def run_generate(env: dict, flags: list[str], max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "specserve.cli", "generate", "Write a short story about a lighthouse.",
           "--max-tokens", str(max_tokens), "--ignore-eos", "--json", "-q", *flags]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse(setting: str) -> tuple[str, dict, list[str]]:
    name, _, rest = setting.partition("=")
    env, flags = {}, []
    for part in rest.split():
        if "=" in part and not part.startswith("--"):
            key, _, value = part.partition("=")
            env[key] = value
        else:
            flags.append(part)
    return name, env, flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the loaded runs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--setting", action="append", default=None, help="NAME=[ENV=VALUE ...] [--flags]")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    settings = [parse(s) for s in (args.setting or DEFAULT_SETTINGS)]
    rows = []
    for round_ in range(args.rounds):
        for loaded in (False, True):
            for name, env, flags in settings:
                spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load if loaded else 0)]
                for p in spinners:
                    p.start()
                try:
                    result = run_generate(env, flags, args.max_tokens)
                finally:
                    for p in spinners:
                        p.terminate()
                        p.join()
                row = {"setting": name, "loaded": loaded, "round": round_, "tokens_per_s": result["tokens_per_s"],
                       "elapsed_s": result["elapsed_s"]}
                rows.append(row)
                print(f"round {round_} {'busy ' if loaded else 'quiet'} {name:12s} {row['tokens_per_s']:7.1f} tok/s "
                      f"({row['elapsed_s']:.1f} s)", flush=True)
    table = [f"| setting | quiet tok/s | {args.load} busy processes tok/s | busy / quiet |", "|---|---:|---:|---:|"]
    for name, _, _ in settings:
        quiet = statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == name and not r["loaded"])
        busy = statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == name and r["loaded"])
        table.append(f"| {name} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.2f} |")
    print("\n".join(table))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "runs": rows, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
