"""torchrun for specserve's tensor-parallel ranks: ``python -m specserve.launch`` takes
torchrun's arguments and runs them, but ends a failed job with one line instead of
torchrun's traceback and failure report.

When rank 0 fails (a bad prompt, a model that cannot load) it has already said why, and
the job exits with its code. When another rank ends first (killed, out of memory), rank 0
has logged which one and how (``distributed.RankWatch``), and this adds the line the user
reads last: which rank, and how its process ended. Exit code 1.
"""
from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if rank == 0 and failure.exitcode > 0:
            return failure.exitcode
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        print(f"specserve: tensor-parallel rank {rank} (pid {failure.pid}) {how}; the job has ended",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
