"""``specserve bench`` from a clone, without installing the console script:

    python benchmarks/bench.py serve --speculation none,ngram:4 --request-rate-sweep 0.5,1,2,inf
    python benchmarks/bench.py offline --workload chat --num-prompts 16
    python benchmarks/bench.py spec-sweep --drafters ngram,layerskip --ks 1,2,4,6

The code lives in ``specserve/bench/`` (installed with the package); ``--help`` on each
subcommand lists its flags.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specserve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
