"""``python -m specserve.training``: see ``specserve/training/main.py``."""
from specserve.training.main import main

main()
