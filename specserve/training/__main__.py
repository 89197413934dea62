"""``python -m specserve.training``: see ``specserve/training/main.py``."""
from specserve.distributed import run_main
from specserve.training.main import main


def _train() -> int:
    main()  # its summary is for Python callers; the command's output is its log
    return 0


run_main(_train)
