"""draft_acceptance.py with the tree's expansion levels and width set: LEVELS EXPAND args..."""
import runpy
import sys

levels, expand = int(sys.argv[1]), int(sys.argv[2])
from specserve.spec import tree

defaults = list(tree.DraftTrees.__init__.__defaults__)
defaults[0], defaults[1] = levels, expand
tree.DraftTrees.__init__.__defaults__ = tuple(defaults)
sys.argv = ["draft_acceptance.py"] + sys.argv[3:]
sys.path.insert(0, "/work/main/benchmarks")
runpy.run_path("/work/main/benchmarks/draft_acceptance.py", run_name="__main__")
