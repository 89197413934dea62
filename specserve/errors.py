"""Errors a user can act on. Each subclasses ValueError so the Python API contract holds:
bad input raises ValueError with a one-line message; the CLI prints it and exits 2."""


class SpecserveError(ValueError):
    """Base class for user-facing errors."""


class ModelLoadError(SpecserveError):
    """The model could not be found, read or is of an unsupported architecture."""


class KVCacheError(RuntimeError):
    """Misuse of the KV cache manager (double free, unknown request). A bug, not bad input."""


class RanksOutOfStepError(RuntimeError):
    """A forward pass failed on a tensor-parallel engine after the other ranks were told
    to run it: they can no longer agree on what runs next, so the engine stops."""
