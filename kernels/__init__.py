"""Kernels for the ragged paged batch, installed as ``specserve.kernels``.

Every kernel sits beside a pure-torch reference with the same semantics
(``reference.py``); the references are the CPU path and the oracle in tests.
"""
