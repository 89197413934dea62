"""Quantized checkpoints run as stored: FP8 (W8A8 and W8A16, per tensor, per channel or in
128 × 128 blocks) and 4-bit AWQ / GPTQ (W4A16).

A checkpoint says its scheme in config.json's ``quantization_config``; ``parse_scheme``
reads it and refuses, naming it, any scheme not run here. While the tensors stream in,
``gather`` joins each quantized layer's tensors (its values, scales, zero points, group
order) into one weight (``Fp8Weight``, ``Int4Weight``) yielded under the layer's
``weight`` name, so the loader places it like a float weight; parts of one of our merged
projections (q/k/v, gate/up) are joined by ``quantized_linear``, which builds the layer.
Nothing is dropped: a tensor of the scheme without its layer, or a layer without one of
its tensors, is refused by name.

Layouts (as the libraries that write them lay them out):

* ``fp8`` (transformers' FineGrainedFP8 / DeepSeek-V3, Qwen3-FP8): ``weight`` float8_e4m3fn
  ``[N, K]``, ``weight_scale_inv`` fp32 ``[⌈N/128⌉, ⌈K/128⌉]`` (a multiplier, despite the
  name), activations quantized per token and group of 128 at run time. Without
  ``weight_block_size``: one ``weight_scale`` per tensor, and ``input_scale`` where the
  activation scheme is static.
* ``fbgemm_fp8``: ``weight_scale`` ``[N, 1]``, activations per token.
* ``compressed-tensors`` ``float-quantized`` (llm-compressor's FP8, FP8-dynamic, W8A16):
  ``weight_scale`` per tensor ``[1]``, per channel ``[N, 1]`` or per block; activations per
  token (dynamic), per tensor (static, ``input_scale``) or none.
* ``awq`` (AutoAWQ's GEMM layout): ``qweight`` int32 ``[K, N/8]`` (columns 0, 2, 4, 6, 1, 3,
  5, 7 of each eight in nibbles 0…7), ``qzeros`` int32 ``[K/G, N/8]`` packed alike,
  ``scales`` ``[K/G, N]``; w = (q − z) · s.
* ``gptq`` (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K/8, N]`` (input 8r + j in nibble j
  of row r), ``qzeros`` int32 ``[K/G, N/8]`` (nibble j: column 8c + j) holding z − 1 in the
  original format (``checkpoint_format`` "gptq") and z in "gptq_v2", ``scales`` ``[K/G, N]``,
  ``g_idx`` ``[K]``: each input's group, in any order when ``desc_act`` quantized them by
  activation order. Such a layer reads its inputs permuted so that groups are contiguous.

Where they run: FP8 with one scale per row (per tensor or channel) and per-token or
per-tensor activations goes through ``torch._scaled_mm`` on CUDA (bf16), and on the CPU
through a bf16 or fp32 GEMM over its values held widened (exact); block-wise FP8 and
W8A16 through ``kernels/quant_matmul.py`` (CUDA). 4-bit weights through
the Triton W4A16 GEMM on CUDA, and on the CPU through the GGUF kernels
(``models/quantized.py``), which hold (q − z) · s exactly as scale · q + min.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from specserve.errors import ModelLoadError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column in each nibble of an AWQ word


# ---------------------------------------------------------------------------- schemes
@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's quantization_config says its quantized layers hold."""

    method: str                       # quant_method
    kind: str                         # "fp8" or "int4"
    name: str                         # the scheme in words, for messages
    block: tuple[int, int] | None = None   # fp8: the weight scale's block (None: per tensor or row)
    activations: str | None = None    # fp8: "token", "group" (per token and block column), "static", None
    group: int = 0                    # int4: inputs per scale (0: all of K)
    gptq_v1: bool = False             # gptq: qzeros hold z − 1

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The tensors of a quantized layer, first the one every such layer has."""
        if self.kind == "int4":
            return ("qweight", "qzeros", "scales", "g_idx")
        scale = "weight_scale_inv" if self.method == "fp8" and self.block else "weight_scale"
        return ("weight", scale, "input_scale")

    def refusal(self, device: torch.device, tp_size: int, deterministic: bool) -> str | None:
        """Why this scheme cannot run here, or None."""
        if tp_size > 1:
            return "quantized checkpoints run without tensor parallelism"
        if device.type == "cpu" and self.kind == "fp8" and (self.block or self.activations is None):
            return "block-wise and weight-only FP8 run on CUDA GPUs"
        if device.type == "cpu" and self.kind == "fp8" and deterministic:
            return "deterministic mode runs FP8 checkpoints on CUDA GPUs"
        if device.type not in ("cpu", "cuda"):
            return f"quantized checkpoints run on CUDA or the CPU, not {device.type}"
        return None


def describe(quant: dict) -> str:
    """A quantization_config in one phrase: its method and what its weights hold."""
    details = [f"{key} {quant[key]!r}" for key in ("format", "bits", "fmt", "weight_block_size")
               if quant.get(key) is not None]
    for group in (quant.get("config_groups") or {}).values():  # compressed-tensors: what the weights hold
        weights = (group or {}).get("weights") or {}
        if weights:
            details.append(f"weights {weights.get('num_bits')}-bit {weights.get('type')} "
                           f"per {weights.get('strategy')}")
            break
    method = quant.get("quant_method", "unknown")
    return f"quant_method {method!r}" + (f" ({', '.join(details)})" if details else "")


def parse_scheme(quant, where: str) -> QuantScheme | None:
    """The scheme of config.json's ``quantization_config`` (None: not quantized); a scheme
    not run here is refused in one line that names it."""
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: vars(quant))()
    name = describe(quant)
    method = quant.get("quant_method")
    try:
        scheme = _SCHEMES[method](quant, name) if method in _SCHEMES else None
    except _Unsupported as why:
        raise ModelLoadError(f"{where}: a quantized checkpoint (config.json's quantization_config: {name}) "
                             f"that specserve does not run ({why}); {SUPPORTED}") from None
    if scheme is None:
        raise ModelLoadError(f"{where}: a quantized checkpoint (config.json's quantization_config: {name}) "
                             f"that specserve does not run; {SUPPORTED}")
    return scheme


SUPPORTED = ("it runs fp8 (per tensor, or 128x128 blocks), fbgemm_fp8, compressed-tensors float-quantized "
             "FP8, 4-bit awq (gemm) and gptq, GGUF files, and bf16/fp16/fp32 checkpoints")


class _Unsupported(Exception):
    pass


def _require(condition: bool, why: str) -> None:
    if not condition:
        raise _Unsupported(why)


def _fp8(quant: dict, name: str) -> QuantScheme:
    _require(quant.get("fmt", "e4m3") == "e4m3", f"fmt {quant.get('fmt')!r} (e4m3 runs)")
    acts = quant.get("activation_scheme", "dynamic")
    _require(acts in ("dynamic", "static"), f"activation_scheme {acts!r}")
    block = quant.get("weight_block_size")
    if block is not None:
        _require(len(block) == 2 and acts == "dynamic", "block-wise weights with static activations")
        return QuantScheme("fp8", "fp8", name, tuple(int(b) for b in block), "group")
    return QuantScheme("fp8", "fp8", name, None, "token" if acts == "dynamic" else "static")


def _fbgemm_fp8(quant: dict, name: str) -> QuantScheme:
    return QuantScheme("fbgemm_fp8", "fp8", name, None, "token")


def _compressed_tensors(quant: dict, name: str) -> QuantScheme:
    fmt = quant.get("format")
    _require(fmt in ("float-quantized", "naive-quantized"), f"format {fmt!r}")
    _require(not quant.get("kv_cache_scheme"), "a quantized KV cache (kv_cache_scheme)")
    _require(not quant.get("sparsity_config"), "sparse weights (sparsity_config)")
    groups = list((quant.get("config_groups") or {}).values())
    _require(len(groups) == 1, f"{len(groups)} config groups (one runs)")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    _require(weights.get("type") == "float" and weights.get("num_bits") == 8 and weights.get("symmetric", True),
             f"{weights.get('num_bits')}-bit {weights.get('type')} weights (8-bit float runs)")
    strategy = weights.get("strategy")
    _require(strategy in ("tensor", "channel", "block"), f"weight strategy {strategy!r}")
    _require(not weights.get("dynamic"), "dynamic weight scales")
    block = tuple(weights.get("block_structure") or ()) if strategy == "block" else None
    _require(block is None or len(block) == 2, f"block_structure {weights.get('block_structure')!r}")
    if acts is None:
        mode = None
    else:
        _require(acts.get("type") == "float" and acts.get("num_bits") == 8,
                 f"{acts.get('num_bits')}-bit {acts.get('type')} activations")
        act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
        if dynamic and act_strategy == "token" and block is None:
            mode = "token"
        elif dynamic and act_strategy == "group" and block and acts.get("group_size") == block[1]:
            mode = "group"
        elif not dynamic and act_strategy == "tensor" and block is None:
            mode = "static"
        else:
            raise _Unsupported(f"{'dynamic' if dynamic else 'static'} activations per {act_strategy} "
                               f"with {strategy} weights")
    return QuantScheme("compressed-tensors", "fp8", name, block, mode)


def _awq(quant: dict, name: str) -> QuantScheme:
    version = str(quant.get("version", "gemm")).lower()
    _require(version == "gemm", f"version {version!r} (gemm runs)")
    _require(int(quant.get("bits", quant.get("w_bit", 4))) == 4, f"{quant.get('bits')} bits (4 run)")
    _require(quant.get("zero_point", True), "no zero point")
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    return QuantScheme("awq", "int4", name, group=max(group, 0))


def _gptq(quant: dict, name: str) -> QuantScheme:
    _require(int(quant.get("bits", 4)) == 4, f"{quant.get('bits')} bits (4 run)")
    fmt = quant.get("checkpoint_format", "gptq")
    _require(fmt in ("gptq", "gptq_v2"), f"checkpoint_format {fmt!r}")
    return QuantScheme("gptq", "int4", name, group=max(int(quant.get("group_size", 128)), 0),
                       gptq_v1=fmt == "gptq")


_SCHEMES = {"fp8": _fp8, "fbgemm_fp8": _fbgemm_fp8, "compressed-tensors": _compressed_tensors,
            "awq": _awq, "gptq": _gptq}


# ---------------------------------------------------------------------------- weights
@dataclass
class Fp8Weight:
    """float8 ``values`` ``[rows, K]`` times fp32 ``scale`` over blocks of ``block`` (rows,
    inputs); ``input_scale``: the static activation scale, where the scheme has one."""

    values: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    input_scale: float | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        bn, bk = self.block
        rows, k = self.values.shape
        scale = self.scale.float().repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :k]
        return self.values.float() * scale


@dataclass
class Int4Weight:
    """w = (q − zero) · scale per group of ``group`` inputs in the order ``perm``
    (input perm[i] is the layer's i-th; None: as stored): q and zero uint8 0…15."""

    q: torch.Tensor          # [rows, K], inputs in ``perm`` order
    scale: torch.Tensor      # [rows, K / group], the checkpoint's float dtype
    zero: torch.Tensor       # [rows, K / group]
    group: int
    perm: torch.Tensor | None = None
    qtype: str = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight in the stored input order, fp32 (exact)."""
        w = (self.q.float() - self.zero.float().repeat_interleave(self.group, 1)) \
            * self.scale.float().repeat_interleave(self.group, 1)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def decoded(self):
        """The GGUF kernels' form (``models/quantized.py``): scale · q + min per group of 32."""
        from specserve.models.quantized import Decoded  # lazy: quantized imports the C++ kernels

        if self.perm is not None:
            raise ValueError("act-order GPTQ weights run on CUDA GPUs, not the CPU")
        if self.group % 32:
            raise ValueError(f"4-bit groups of {self.group} inputs do not run on the CPU (multiples of 32 do)")
        repeat = self.group // 32
        scale = self.scale.float().repeat_interleave(repeat, 1)
        mins = -self.zero.float().repeat_interleave(repeat, 1) * scale  # exact: z ≤ 16, s has 11 bits
        return Decoded(self.q.numpy(), scale.numpy(), mins.numpy(), 4, 32)


def _unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 nibbles, eight per word along ``dim`` (nibble j: position 8i + j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nib = (words.unsqueeze(-1) >> shifts) & 0xF
    if dim == 0:
        return nib.permute(0, 2, 1).reshape(-1, words.shape[1]).to(torch.uint8)
    return nib.reshape(words.shape[0], -1).to(torch.uint8)


def _check(condition: bool, where: str, what: str) -> None:
    if not condition:
        raise ModelLoadError(f"{where}: {what}")


def _fp8_weight(scheme: QuantScheme, prefix: str, t: dict, where: str) -> Fp8Weight:
    values = t["weight"]
    _check(values.dtype == FP8 and values.dim() == 2, where,
           f"tensor {prefix + 'weight'!r} is {str(values.dtype)[6:]} {tuple(values.shape)}, "
           f"the scheme's float8_e4m3fn [out, in]")
    rows, k = values.shape
    scale_name = "weight_scale_inv" if "weight_scale_inv" in scheme.suffixes else "weight_scale"
    _check(scale_name in t, where, f"{prefix + 'weight'!r} comes without {prefix + scale_name!r}")
    scale = t[scale_name].float()
    if scheme.block:
        bn, bk = scheme.block
        want = (-(-rows // bn), -(-k // bk))
    else:  # one scale per tensor or per row: held per row (exact), so parts stack
        bn, bk, want = 1, k, (rows, 1)
        scale = scale.reshape(1, 1).expand(want) if scale.numel() == 1 else scale
    _check(scale.numel() == want[0] * want[1] and torch.isfinite(scale).all(), where,
           f"{prefix + scale_name!r} of shape {tuple(t[scale_name].shape)} does not scale {tuple(values.shape)} "
           f"by {'blocks of ' + str(scheme.block) if scheme.block else 'tensor or row'}")
    input_scale = None
    if scheme.activations == "static":
        _check("input_scale" in t and t["input_scale"].numel() == 1, where,
               f"{prefix + 'weight'!r} comes without one {prefix + 'input_scale'!r} (static activations)")
        input_scale = float(t["input_scale"].float().reshape(()))
    else:
        _check("input_scale" not in t, where, f"unexpected tensor {prefix + 'input_scale'!r}: the scheme's "
                                               "activations are not static")
    return Fp8Weight(values, scale.reshape(want).contiguous(), (bn, bk), input_scale)


def _int4_weight(scheme: QuantScheme, prefix: str, t: dict, where: str) -> Int4Weight:
    for name in ("qweight", "qzeros", "scales"):
        _check(name in t, where, f"{prefix + 'qweight'!r} comes without {prefix + name!r}")
        fits = t[name].is_floating_point() if name == "scales" else t[name].dtype == torch.int32
        _check(fits and t[name].dim() == 2, where,
               f"tensor {prefix + name!r} is {str(t[name].dtype)[6:]} {tuple(t[name].shape)}")
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    if scheme.method == "awq":
        _check("g_idx" not in t, where, f"unexpected tensor {prefix + 'g_idx'!r} in an AWQ checkpoint")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        order = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # nibble holding column j
        q = _unpack(qweight, 1).reshape(k, -1, 8)[:, :, order].reshape(k, n).T
        zero = _unpack(qzeros, 1).reshape(qzeros.shape[0], -1, 8)[:, :, order].reshape(qzeros.shape[0], -1).T
        group_index = None
    else:
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        q = _unpack(qweight, 0).T
        zero = _unpack(qzeros, 1).T
        if scheme.gptq_v1:
            zero = zero + 1  # stored z − 1, run as the GPTQ kernels run it (z up to 16)
        group_index = t.get("g_idx")
    group = scheme.group or k
    groups = -(-k // group)
    _check(k % group == 0, where, f"{prefix!r}: {k} inputs are not whole groups of {group}")
    _check(tuple(scales.shape) == (groups, n) and tuple(zero.shape) == (n, groups), where,
           f"{prefix!r}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not fit "
           f"{groups} groups of {group} inputs and {n} outputs")
    perm = None
    if group_index is not None:
        group_index = group_index.long()
        _check(group_index.shape == (k,) and int(group_index.min()) >= 0 and int(group_index.max()) < groups,
               where, f"{prefix + 'g_idx'!r} is not one group per input")
        if not torch.equal(group_index, torch.arange(k) // group):
            _check(bool((torch.bincount(group_index, minlength=groups) == group).all()), where,
                   f"{prefix + 'g_idx'!r}: groups of other than {group} inputs")
            perm = torch.sort(group_index, stable=True).indices
            q = q[:, perm]
    return Int4Weight(q.contiguous(), scales.T.contiguous(), zero.to(torch.uint8).contiguous(), group, perm,
                      qtype=scheme.method.upper())


def gather(names: list[str], read, scheme: QuantScheme, where: str, progress=iter, tables=frozenset()):
    """(name, tensor) for every checkpoint tensor, a quantized layer's tensors joined into
    one weight under ``<layer>.weight``. Other tensors pass as they are: float ones, and
    the index tables a model declares (``tables``); any other integer or float8 tensor is
    refused, as are a layer's tensors without their weight."""
    suffixes = scheme.suffixes
    main = suffixes[0]
    present = set(names)
    layers = {name[:-len(main)] for name in names if name.endswith("." + main)}
    if scheme.kind == "fp8":  # float weights (norms, a head left unquantized) pass as they are
        layers = {prefix for prefix in layers if prefix + suffixes[1] in present}
    members = {prefix + s for prefix in layers for s in suffixes}
    for name in progress(names):
        if name in members:
            prefix, suffix = name.rsplit(".", 1)
            if suffix != main:
                _check(prefix + "." + main in present, where, f"tensor {name!r} comes without "
                                                              f"{prefix + '.' + main!r}")
                continue
            prefix += "."
            parts = {s: read(prefix + s) for s in suffixes if prefix + s in present}
            build = _fp8_weight if scheme.kind == "fp8" else _int4_weight
            yield prefix + "weight", build(scheme, prefix, parts, where)
            continue
        suffix = name.rsplit(".", 1)[-1]
        if suffix in suffixes[1:]:
            raise ModelLoadError(f"{where}: tensor {name!r} comes without {name.rsplit('.', 1)[0] + '.' + main!r}")
        tensor = read(name)
        if name not in tables and (not tensor.is_floating_point() or tensor.dtype == FP8):
            raise ModelLoadError(f"{where}: tensor {name!r} is {str(tensor.dtype)[6:]}, outside the "
                                 f"scheme's layers ({scheme.name})")
        yield name, tensor


# ---------------------------------------------------------------------------- layers
def _merge_fp8(parts: list[Fp8Weight], where: str) -> tuple[Fp8Weight, list | None]:
    """Row-stack parts (their scale grids stack where blocks line up), and the parts'
    (rows, static input scale) where those differ, else None."""
    bn = parts[0].block[0]
    if len({p.block for p in parts}) > 1 or any(p.shape[0] % bn for p in parts[:-1]):
        raise ModelLoadError(f"{where}: FP8 parts of one projection whose scale blocks do not line up")
    inputs = {p.input_scale for p in parts}
    merged = Fp8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]).contiguous(),
                       parts[0].block, next(iter(inputs)) if len(inputs) == 1 else None)
    return merged, [(p.shape[0], p.input_scale) for p in parts] if len(inputs) > 1 else None


class Fp8Rows(NamedTuple):
    """A layer's input already rounded to float8 by the op before it (a norm, an
    activation: ``Fp8Linear.input_group``), so that the layer does not launch its own
    quantizer: ``values`` float8 ``[rows, K]``, ``scales`` fp32 ``[rows, ⌈K / group⌉]``,
    each group scaled so that its largest magnitude is 448, by the layer's own
    quantizer's arithmetic on the op's output in ``dtype``, the dtype it hands on."""

    values: torch.Tensor
    scales: torch.Tensor
    group: int
    dtype: torch.dtype


class Fp8Linear(nn.Module):
    """A linear layer over float8 weights and their scales, as the checkpoint holds them.

    ``activations``: "token" or "group" quantize the input to float8 at run time with a
    scale per token (and per group of the weight block's width); "static" with the
    checkpoint's scale (per part of a merged projection, each its own); None multiplies
    the input as it is (W8A16). With dynamic scales the input may come rounded already
    (``Fp8Rows``, from the op before it: ``input_group``). ``deterministic``: every call
    through the Triton kernel, whose result for a row does not depend on the batch. On
    CUDA the layer holds its own tile counters for the Triton GEMM (``Int4Linear``'s
    reasons)."""

    def __init__(self, weight: Fp8Weight, segments, activations: str | None, bias: torch.Tensor | None,
                 deterministic: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block, self.activations = weight.block, activations
        self.register_buffer("weight", weight.values)
        self.register_buffer("weight_scale", weight.scale.float())
        self.register_buffer("bias", bias)
        counters = None
        if weight.values.is_cuda:
            from specserve.kernels.quant_matmul import tile_counters  # lazy: Triton

            counters = tile_counters(self.out_features, weight.values.device)
        self.register_buffer("tile_counters", counters, persistent=False)
        # (rows, static input scale) per part where the parts' scales differ, else one
        self.segments = segments or [(self.out_features, weight.input_scale)]
        self.deterministic = deterministic
        self.widened = None  # first row of each part -> its weight for the CPU's GEMM
        if weight.values.device.type == "cpu" and dtype is not None and self.block[0] == 1:
            self.widened = _widened(weight.values, [rows for rows, _ in self.segments], dtype)

    @property
    def input_group(self) -> int | None:
        """The inputs its run-time scales cover (the whole row: ``in_features``), where it
        rounds its input to float8 with dynamic scales; the op before it may then hand it
        ``Fp8Rows`` so rounded. None where it does not (static scales, W8A16)."""
        if self.activations == "token":
            return self.in_features
        return self.block[1] if self.activations == "group" else None

    def _scaled_mm(self, x: torch.Tensor, dtype: torch.dtype, rows: int) -> bool:
        """torch's scaled GEMM (cuBLASLt on CUDA) for per-row weight scales and one
        activation scale per row: on CUDA in bf16 (its row-wise output type), unless
        deterministic or for a decode or verify step's few rows (where the Triton kernel
        splits K and is faster); on a CPU for a layer built without a widened copy."""
        if self.block[0] != 1 or self.activations not in ("token", "static"):
            return False
        if x.device.type == "cpu":
            return True
        from specserve.kernels.quant_matmul import FEW_ROWS  # lazy: Triton, on CUDA only

        return (dtype == torch.bfloat16 and not self.deterministic and x.shape[0] > FEW_ROWS
                and rows % 16 == 0 and self.in_features % 16 == 0)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if isinstance(x, Fp8Rows):
            if x.group != self.input_group or x.values.shape[-1] != self.in_features:
                raise ValueError(f"float8 rows of {x.values.shape[-1]} inputs in groups of {x.group} for a layer "
                                 f"of {self.in_features} inputs rounded in groups of {self.input_group}")
            return self._matmul(x.values, x.scales, x.dtype, 0, self.out_features)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.activations == "static":
            outs, row = [], 0
            for rows, scale in self.segments:
                outs.append(self._matmul(*_quantize_static(x2, scale), x.dtype, row, row + rows))
                row += rows
            y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        elif self.activations in ("token", "group"):
            y = self._matmul(x2, None, x.dtype, 0, self.out_features, quantize=True)
        else:
            y = self._matmul(x2, None, x.dtype, 0, self.out_features)
        return y.view(*shape[:-1], self.out_features)

    def _matmul(self, xq, x_scale, dtype: torch.dtype, start: int, stop: int, quantize: bool = False) -> torch.Tensor:
        """Output rows ``start:stop`` in ``dtype``, of ``xq`` (float8, with ``x_scale``; or
        in ``dtype`` without). ``quantize``: ``xq`` is to be rounded to float8 per token
        (and group) here, or on CUDA by ``quant_matmul.fp8_linear`` (a Triton launch
        before its product)."""
        bias = None if self.bias is None else self.bias[start:stop]
        weight, scale = self.weight, self.weight_scale
        if (start, stop) != (0, self.out_features):  # a part's rows (static scales: scales per row)
            weight, scale = weight[start:stop], scale[start:stop]
        act_group = self.in_features if self.activations != "group" else self.block[1]
        scaled_mm = self._scaled_mm(xq, dtype, stop - start)
        if quantize and (not xq.is_cuda or scaled_mm):
            xq, x_scale = _quantize_rows(xq, act_group)
            quantize = False
        if self.widened is not None:
            w = self.widened[start]
            if w.is_mkldnn:
                y = torch.ops.mkldnn._linear_pointwise(xq.to(torch.bfloat16), w, None, "none", [], "")
            else:
                y = torch.nn.functional.linear(xq.to(w.dtype), w)
            y = (y.float() * x_scale.expand(xq.shape[0], 1) * scale.reshape(1, -1)).to(dtype)
            return y if bias is None else y + bias
        if scaled_mm:
            y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.expand(xq.shape[0], 1).contiguous(),
                                 scale_b=scale.reshape(1, -1).contiguous(), out_dtype=dtype)
            return y if bias is None else y + bias
        from specserve.kernels import quant_matmul  # lazy: Triton, on CUDA only

        return quant_matmul.fp8_linear(xq, None if x_scale is None else x_scale.expand(xq.shape[0], -1),
                                       act_group, weight, scale, self.block, bias, dtype, self.deterministic,
                                       quantize=quantize, counters=self.tile_counters)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"activations={self.activations}")


def _widened(values: torch.Tensor, rows: list[int], dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """A CPU has no float8 GEMM (``torch._scaled_mm`` there converts the weight every call),
    so each part's float8 values are held in the model's ``dtype``: exactly, as float8 is a
    subset of bf16, and so are the products of two float8 values; the GEMM sums them in
    fp32. bf16 parts are prepacked for oneDNN where the CPU has native bf16 GEMMs."""
    from specserve.models.packed_linear import bf16_packing_supported  # lazy: probes oneDNN once

    out, start = {}, 0
    for part in values.to(dtype).split(rows):
        packed = dtype == torch.bfloat16 and bf16_packing_supported()
        out[start] = torch.ops.mkldnn._reorder_linear_weight(part.contiguous(), None) if packed else part
        start += part.shape[0]
    return out


def _quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 x and fp32 scales ``[rows, ⌈K / group⌉]``: each row's group scaled so that its
    largest magnitude is 448 (on CUDA in one Triton launch, the same values)."""
    if x.is_cuda:
        from specserve.kernels import quant_matmul  # lazy: Triton, on CUDA only

        return quant_matmul.quantize_rows(x, group)
    rows, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(rows, groups, group)
    scale = (padded.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, -1)[:, :k]
    return q, scale


def _quantize_static(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from specserve.kernels import quant_matmul  # lazy: Triton, on CUDA only

        return quant_matmul.quantize_rows(x, x.shape[1], static=scale)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), \
        torch.full((1, 1), scale, dtype=torch.float32, device=x.device)


class Int4Linear(nn.Module):
    """A linear layer over 4-bit weights on CUDA (``kernels/quant_matmul.int4_linear``),
    packed eight inputs per int32, with the checkpoint's scales and zero points per group;
    act-order weights read their inputs permuted. ``deterministic``: a row's result does
    not depend on the batch. The layer's own tile counters let a decode or verify step's
    K splits be added in the GEMM's launch; its own, because a draft model's pass may run
    on another stream beside the target's."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, deterministic: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.out_features, self.in_features = weight.shape
        self.group, self.qtype = weight.group, weight.qtype
        from specserve.kernels import quant_matmul  # lazy: Triton

        self.register_buffer("packed", quant_matmul.pack_int4(weight.q))
        self.register_buffer("tile_counters", quant_matmul.tile_counters(self.out_features, weight.q.device),
                             persistent=False)
        self.register_buffer("scales", weight.scale)
        self.register_buffer("zeros", weight.zero)
        self.register_buffer("perm", weight.perm)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from specserve.kernels import quant_matmul  # lazy: Triton, on CUDA only

        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return quant_matmul.int4_linear(x, self.packed, self.scales, self.zeros, self.group, self.bias,
                                        self.deterministic, counters=self.tile_counters)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}, "
                f"group={self.group}, act_order={self.perm is not None}")


def quantized_linear(parts: list, linear: nn.Linear, scheme: QuantScheme | None, device: torch.device,
                     deterministic: bool, where: str) -> nn.Module:
    """The layer for ``linear``'s rows given as (first row, weight) ``parts``."""
    weights = [w for _, w in sorted(parts, key=lambda part: part[0])]
    bias = None if linear.bias is None else linear.bias.detach()
    k = linear.in_features
    step = weights[0].group if scheme.kind == "int4" else weights[0].block[1]
    if device.type == "cuda" and step < k and step % 16:  # the Triton tiles' K steps
        raise ModelLoadError(f"{where}: scale groups of {step} inputs: groups of a multiple of 16 run on CUDA")
    if scheme.kind == "int4":
        perms = {None if w.perm is None else tuple(w.perm.tolist()) for w in weights}
        if len(perms) > 1 or len({w.group for w in weights}) > 1:
            raise ModelLoadError(f"{where}: parts of one projection quantized in different group orders")
        if device.type == "cpu":
            from specserve.models.quantized import QuantLinear  # lazy: the C++ kernels

            try:
                return QuantLinear([(row, w) for row, w in parts], linear.in_features, linear.out_features,
                                   linear.bias)
            except ValueError as exc:
                raise ModelLoadError(f"{where}: {exc}") from None
        merged = Int4Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]),
                            torch.cat([w.zero for w in weights]), weights[0].group, weights[0].perm,
                            weights[0].qtype)
        return Int4Linear(_to(merged, device), bias, deterministic)
    merged, segments = _merge_fp8(weights, where)
    return Fp8Linear(_to(merged, device), segments, scheme.activations, bias, deterministic, linear.weight.dtype)


def _to(weight, device: torch.device):
    fields = {name: (value.to(device) if isinstance(value, torch.Tensor) else value)
              for name, value in vars(weight).items()}
    return type(weight)(**fields)


# ---------------------------------------------------------------------------- quantizing
def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weight:
    """An fp32/bf16 weight as float8 with a scale per row (``block`` None) or per block."""
    w = weight.float()
    rows, k = w.shape
    bn, bk = block or (1, k)
    nb, kb = -(-rows // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - rows)).view(nb, bn, kb, bk)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    values = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(values.view(nb * bn, kb * bk)[:rows, :k].contiguous(), scale, (bn, bk))


def quantize_int4(weight: torch.Tensor, group: int = 128) -> Int4Weight:
    """An fp32/bf16 weight as asymmetric 4-bit groups (AWQ's form), fp16 scales."""
    w = weight.float()
    rows, k = w.shape
    g = w.view(rows, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    return Int4Weight(q.view(rows, k).to(torch.uint8), scale, zero.to(torch.uint8), group, qtype="INT4")

