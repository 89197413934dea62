"""The process's garbage collector tuned for a serving loop (``freeze_heap``)."""
from __future__ import annotations

import atexit
import gc

# The youngest generation is collected after this many net new objects (CPython: 700).
GC_YOUNG_THRESHOLD = 50_000
_unfreeze_at_exit = True


def freeze_heap() -> None:
    """Move every object the process holds now (the loaded engine with it) out of the
    cyclic garbage collector's reach (``gc.freeze``), so its collections walk only what
    steps create: after loading a model a process holds hundreds of thousands of objects,
    and a full collection of them is a stall of its own in the middle of a step.

    Unfrozen first, so the garbage of an engine dropped since the last freeze is collected
    now instead of never; and unfrozen at exit, so the interpreter's last collection still
    finalises everything (extension modules report what it does not as leaks).

    The youngest generation is collected after ``GC_YOUNG_THRESHOLD`` net new objects
    instead of CPython's 700: a step at tens of requests leaves thousands alive until it
    ends (token lists, scheduled requests, outputs), and at 700 several collections ran in
    every step. Objects that die by reference count never wait for a collection; only
    cycles live a little longer. A threshold the process set lower than the default (0:
    collections off) is left as it is."""
    global _unfreeze_at_exit
    if _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = False
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if young >= 700:
        gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), *older)
