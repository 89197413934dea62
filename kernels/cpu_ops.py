"""C++ kernels for the CPU path: the decoder layer's glue (RMSNorm with the residual add,
Gemma's norm, SiLU·mul and GeGLU, rotary + KV store) and paged attention for decode rows
and verify spans, one op each (source: ``cpu_ops.cpp``); and batch-invariant linear
layers for the deterministic mode (``cpu_gemm.cpp``); linear layers over quantized (GGUF)
weights (``cpu_quant.cpp``) and a whole decoder layer over them in one call (``cpu_layer.cpp``).

On a CPU a small model's decode step spends about as long outside its projections as in
them, most of it dispatching some 25 tiny torch ops per layer; these ops make each piece
one call. They are compiled once per machine at first use by torch's extension loader
(g++ and ninja; the log says so, then cached under
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). Where that cannot work
(no compiler, a read-only cache) the engine logs why and keeps the torch references;
``SPECSERVE_CPU_KERNELS=0`` chooses them outright.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("specserve")

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "cpu_gemm.cpp", "cpu_quant.cpp", "cpu_layer.cpp")]
# Headers the sources include. torch's loader rebuilds when a source or a flag changes, not a
# header: their digest goes in as a flag.
_HEADERS = [Path(__file__).with_name(name) for name in ("cpu_glue.h", "cpu_quant.h")]
ENV_SWITCH = "SPECSERVE_CPU_KERNELS"
AMX_SWITCH = "SPECSERVE_CPU_AMX"  # 0: build and run without AMX tiles where the CPU has them
# Vector ISA flags by what torch found this CPU to run (the build is per machine and named
# by it, so a cache shared with another CPU holds one build each).
_VECTOR_FLAGS = {"AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
                 "AVX2": ["-mavx2", "-mfma", "-mf16c"]}  # (every AVX2 CPU converts float16: F16C)


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.specserve_cpu`` is loaded (built now if it has to be)."""
    if _switched_off(ENV_SWITCH):
        return False
    try:
        from torch.utils import cpp_extension  # lazy: it imports setuptools, only to build

        name, flags = build_name_and_flags()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        if not any(build_dir.glob(f"{name}*.so")):  # a first start: say why it waits
            logger.info("compiling the C++ CPU kernels for this machine, once (a minute or less; cached in %s)",
                        build_dir)
        with _building(build_dir):
            cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES],
                               extra_cflags=["-O3", "-fopenmp", *flags],
                               extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
        return hasattr(torch.ops.specserve_cpu, "add_rms_norm")
    except Exception as exc:  # no compiler, no ninja, a read-only cache, ...
        logger.warning("CPU kernels unavailable, using the torch ops (slower): %s",
                       str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__)
        return False


def _switched_off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def amx_tiles() -> bool:
    """Whether quantized layers multiply many rows on AMX tiles (``cpu_quant.cpp``): the CPU
    has AMX with bf16, the kernels were built for it, and the OS lets this process use it."""
    return available() and bool(torch.ops.specserve_cpu.amx_tiles())


# ``bits`` of a quantized weight held as 4-bit indices into the IQ4 table (``cpu_quant.h``: kIq4).
IQ4 = -4


@functools.cache
def weight_forms() -> frozenset[int]:
    """The weight forms (``bits``) quantized layers take here (``cpu_quant.h``): 4 and 8 bits
    everywhere; 5 and 6 bits (the 4-bit layout plus planes of the higher bits) and ``IQ4``
    where the kernels are built for AVX-512 VNNI. Elsewhere those run as 8 bits."""
    return frozenset(torch.ops.specserve_cpu.weight_forms()) if available() else frozenset()


@functools.cache
def two_level_scales() -> bool:
    """Whether quantized layers take two-level scales here (``cpu_quant.h``: ``Sub8``, an int8
    a group and a float32 factor a super-block of 256 inputs, the K-quants' and IQ4_XS's
    own structure): where the kernels are built for AVX-512 VNNI."""
    return available() and bool(torch.ops.specserve_cpu.two_level_scales())


@contextlib.contextmanager
def _building(build_dir: Path):
    """Hold an OS lock on ``build_dir`` while torch's loader builds and loads there.

    The loader marks a build in progress with a ``lock`` file that only the building
    process removes: a build killed midway (Ctrl-C on a first run) leaves it, and every
    later process waits for it forever. The OS lock goes with its process, and every
    specserve process builds only while holding it, so a ``lock`` file found under it is
    such a leftover and is removed."""
    import fcntl  # lazy: POSIX only, like the build itself (g++)

    with open(build_dir / "specserve.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another rank building: wait for it
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build of the CPU kernels that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_name_and_flags() -> tuple[str, list[str]]:
    """The extension's name (one build per CPU kind) and the compiler flags it takes."""
    capability = torch.backends.cpu.get_cpu_capability()  # what this CPU runs, e.g. AVX512
    flags = list(_VECTOR_FLAGS.get(capability, []))
    if capability == "AVX512" and _avx512_bf16():
        flags.append("-mavx512bf16")  # cpu_gemm.cpp's vdpbf16ps
        capability += "_bf16"
    if capability.startswith("AVX512") and _avx512_vnni():
        flags.append("-mavx512vnni")  # cpu_quant.cpp's vpdpbusd
        capability += "_vnni"
    if capability.startswith("AVX512_bf16") and _amx() and not _switched_off(AMX_SWITCH):
        flags += ["-mamx-tile", "-mamx-bf16"]  # cpu_quant.cpp's tiles for many rows
        capability += "_amx"
    headers = hashlib.sha256(b"".join(path.read_bytes() for path in _HEADERS)).hexdigest()[:16]
    return f"specserve_cpu_ops_{capability.lower()}", [f"-DSPECSERVE_HEADERS={headers}", *flags]


def _avx512_bf16() -> bool:
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def _amx() -> bool:
    """AMX tiles with bf16 products (Sapphire Rapids and later Xeons)."""
    if not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return False
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " amx_bf16" in line for line in info)
    except OSError:
        return False


def _avx512_vnni() -> bool:
    return bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (bf16 or fp32) in ``linear_invariant``'s blocked layout."""
    return torch.ops.specserve_cpu.pack_linear_weight(weight)


def linear_invariant(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """``x · Wᵀ + bias`` with each output element summed in one fixed order whatever the
    number of rows (``cpu_gemm.cpp``): a row's result does not depend on its batch.
    ``bias``: float32 (added before the one rounding to ``x``'s dtype)."""
    return torch.ops.specserve_cpu.linear_invariant(x, packed, bias, out_features)


def quant_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bits: int, group: int, bias: torch.Tensor | None, dequant_rows: int = 0) -> torch.Tensor:
    """``x · Wᵀ + bias`` with W = scale · q + min held in ``bits`` bits per weight (or 4-bit
    indices of q for ``IQ4``) and one scale and min per ``group`` inputs (``cpu_quant.cpp``:
    int16 activations per block of 32, VNNI integer dot products); ``scales`` and ``mins``
    both float32, or both float16 with groups of 32, or ``mins`` a 0-dim float32 factor f
    (each min f · its scale). ``bias``: float32. The result has ``x``'s dtype. From
    ``dequant_rows`` rows on (0: never) W is unpacked, reusing each weight over the rows:
    onto AMX tiles for bf16 ``x`` where ``amx_tiles()``, else to ``x``'s dtype for ATen's GEMM."""
    return torch.ops.specserve_cpu.quant_linear(x, packed, scales, mins, bits, group, bias, dequant_rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.specserve_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.specserve_cpu.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.specserve_cpu.silu_and_mul(gate_up)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.specserve_cpu.gemma_rms_norm(x, weight, eps)


def gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.specserve_cpu.gemma_add_rms_norm(x, residual, weight, eps)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.specserve_cpu.gelu_tanh_and_mul(gate_up)


def rotary_store_kv(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q and k (``qk`` ``[tokens, q_heads + kv_heads, head_dim]``) with ``cos`` /
    signed ``sin`` (``Rotary.forward``'s tables), store k and ``value`` at
    ``slot_mapping`` (−1: skipped); returns the rotated q ``[tokens, q_heads, head_dim]``."""
    return torch.ops.specserve_cpu.rotary_store_kv(qk, value, cos, sin, k_cache, v_cache, slot_mapping)


def rotary_tables(rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``Rotary.forward``'s (cos, signed sin) tables of ``positions`` in one C++ op, the C
    library's cos and sin in place of torch's vectorised ones (which may differ in a float's
    last bit): every path of the C++ kernels takes its tables from here, so they agree."""
    return torch.ops.specserve_cpu.rotary_tables(positions, rope_tensors(rotary), rotary.long_offset, dtype)


def rope_tensors(rotary) -> list[torch.Tensor]:
    """A ``Rotary``'s frequencies and scaling as the C++ ops take them (with the long ones
    of LongRoPE)."""
    rope = [rotary.inv_freq, rotary.scaling]
    if rotary.long_offset:
        rope += [rotary.inv_freq_long, rotary.scaling_long]
    return rope


def paged_attention_short(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                          max_span: int, out: torch.Tensor, softcap: float | None = None,
                          tree_masks: torch.Tensor | None = None) -> None:
    """``reference.paged_attention`` for the requests whose query span is at most
    ``max_span`` rows (decode rows, verify spans), written into ``out``
    ``[tokens, heads, head_dim]``; the other requests' rows are left alone.
    ``tree_masks``: the rows' visibility masks (``reference.TREE_SPAN``)."""
    torch.ops.specserve_cpu.paged_attention_short(query, k_cache, v_cache, block_tables, cu_query_lens,
                                                  seq_lens, scale, sliding_window or 0, softcap or 0.0,
                                                  max_span, out, tree_masks)
