"""Kernels for the ragged paged batch, installed as ``specserve.kernels``.

Every kernel sits beside a pure-torch reference with the same semantics
(``reference.py``); the references are the CPU path and the oracle in tests.
"""
if __name__ == "kernels":
    # Imported as a top-level ``kernels``: a clone's root is on ``sys.path`` (``python -m`` or
    # ``-c`` run there), and this folder shadows the Hugging Face ``kernels`` package that
    # transformers imports when it is installed. That package takes this one's place; where
    # it is not installed, this folder stays what ``kernels`` names (as it always did).
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module
        _spec.loader.exec_module(_module)
