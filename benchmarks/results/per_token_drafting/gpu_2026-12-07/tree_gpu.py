"""``benchmarks/draft_acceptance.py`` with the draft tree chosen by its candidates' chances
on a GPU too (``DYNAMIC=1``: the CPU's rule, ``DraftTrees.grow``), where by default a
GPU's tree takes a fixed shape (``DraftTrees.grow_fixed``): the same arguments."""
import os
import runpy
import sys
from pathlib import Path

from specserve.spec.speculator import Speculator

if os.environ.get("DYNAMIC") == "1":
    Speculator._fixed_trees = lambda self: False
benchmarks = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(benchmarks))
sys.argv = ["draft_acceptance.py"] + sys.argv[1:]
runpy.run_path(str(benchmarks / "draft_acceptance.py"), run_name="__main__")
