"""Errors a user can act on. Each subclasses ValueError so the Python API contract holds:
bad input raises ValueError with a one-line message; the CLI prints it and exits 2."""


class SpecserveError(ValueError):
    """Base class for user-facing errors."""


class ModelLoadError(SpecserveError):
    """The model could not be found, read or is of an unsupported architecture."""


class KVCacheError(RuntimeError):
    """Misuse of the KV cache manager (double free, unknown request). A bug, not bad input."""
