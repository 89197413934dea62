"""The fuzz and property suites run long: the same tests CI runs bounded
(``tests/test_fuzz_api.py``, ``tests/test_engine_properties.py``), with many more cases.

Prints each suite's case counts and time, and the first failure if any (exit 1).

    python benchmarks/fuzz_long.py                                  # 500 per route, 200 per drafter
    python benchmarks/fuzz_long.py --fuzz-examples 2000 --property-examples 1000 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_suite(test_file: str, env: dict) -> dict:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-s", "-p", "no:cacheprovider",
                           "--timeout", "0"], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    seconds = time.monotonic() - started
    counts = [line for line in done.stdout.splitlines() if line.startswith(("fuzzed ", "property runs:"))]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    result = {"suite": test_file, "env": env, "seconds": round(seconds, 1), "passed": done.returncode == 0,
              "counts": counts, "summary": summary}
    if done.returncode != 0:
        result["failure"] = "\n".join(re.findall(r"^E .*$", done.stdout, re.M)[:40]) or done.stdout[-4000:]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz-examples", type=int, default=500, help="cases per route and generation phase")
    parser.add_argument("--property-examples", type=int, default=200, help="workloads per drafter")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = [run_suite("tests/test_fuzz_api.py", {"SPECSERVE_FUZZ_EXAMPLES": str(args.fuzz_examples)}),
               run_suite("tests/test_engine_properties.py",
                         {"SPECSERVE_PROPERTY_EXAMPLES": str(args.property_examples)})]
    for r in results:
        print(f"{r['suite']}: {'passed' if r['passed'] else 'FAILED'} in {r['seconds']} s; {r['summary']}")
        for line in r["counts"]:
            print("  " + line)
        if not r["passed"]:
            print(r["failure"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
