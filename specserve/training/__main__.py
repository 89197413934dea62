"""``python -m specserve.training``: see ``specserve/training/main.py``."""
from specserve.distributed import exit_process
from specserve.training.main import main

main()
exit_process(0)
