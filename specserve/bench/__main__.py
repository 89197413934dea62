"""``python -m specserve.bench serve ...``: the same as ``specserve bench ...``."""
import sys

from specserve.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
