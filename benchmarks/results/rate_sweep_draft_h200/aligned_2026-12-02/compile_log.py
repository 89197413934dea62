"""Run the specserve CLI with every Triton compile after the engines start logged to stderr."""
import sys
import time

from triton import knobs

T0 = time.perf_counter()


def hook(*args, **kwargs):
    fn = kwargs.get("fn")
    name = getattr(getattr(fn, "jit_function", fn), "__name__", "?")
    print(f"COMPILED {time.perf_counter() - T0:.2f} {name}", file=sys.stderr, flush=True)
    return False


knobs.runtime.jit_post_compile_hook = hook
from specserve.cli import main  # noqa: E402

sys.exit(main())
