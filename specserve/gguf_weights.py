"""A GGUF file's tensors as our checkpoint names, the quantized ones kept in their blocks.

``GGUFCheckpoint`` reads a llama-architecture GGUF (Llama 2/3, SmolLM2, Mistral as
llama.cpp converts them) with the ``gguf`` package, memory-mapped. Float tensors (norms,
F16/BF16/F32 weights) come out as torch tensors; quantized linear weights as
``GGUFWeight`` blocks, which ``QuantLinear`` runs quantized; F32, F16 and BF16 weights
load as float layers beside them. The token embedding is
dequantised for the lookup; when the model ties its LM head to it, the head is those same
blocks, quantized (``tied_head``).

llama.cpp's converter permutes the rows of q and k for its rotary layout; they are
permuted back here, rows whole (as transformers' GGUF loader does for the float weights),
which a quantized row survives unchanged.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import torch

from specserve.models.quantized import FORMATS, GGUFWeight, decode

ARCHITECTURES = ("llama",)
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
# GGUF name (after "blk.N.") -> ours (after "model.layers.N.")
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
               "ffn_down.weight": "mlp.down_proj.weight"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Derived from the config's rope scaling (llama 3), which the model computes itself.
DERIVED = {"rope_freqs.weight"}


# Metadata arrays longer than this are stepped over, not read (``open_gguf``).
LONG_ARRAY = 256


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path`` that steps over metadata arrays longer than
    ``LONG_ARRAY`` (a tokenizer's vocabulary, types and merges: ~150k values in the
    default model's file) instead of reading them value by value as the stock reader does,
    which made reading a file's metadata most of loading it; nothing here reads them (the
    tokenizer and config come from the conversion's cache). They leave ``fields``: their
    names and lengths are in ``skipped``, so a lookup finds nothing rather than an empty
    list. Everything else, the tensors included, is the stock reader's."""
    # lazy: the gguf package (numpy only), only to read a GGUF file
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        def __init__(self, file: str) -> None:
            self.skipped: dict[str, int] = {}
            super().__init__(file)
            for name, field in list(self.fields.items()):
                if field.types and field.types[0] == GGUFValueType.ARRAY and not field.data \
                        and int(field.parts[-1][0]) > 0:
                    self.skipped[name] = int(field.parts[-1][0])
                    del self.fields[name]

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            item, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
            scalar = self.gguf_scalar_to_np.get(item)
            if count <= LONG_ARRAY or (scalar is None and item != GGUFValueType.STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs + 12
            if scalar is not None:
                offs += count * np.dtype(scalar).itemsize
            else:  # strings: a uint64 length, then its bytes
                little = (sys.byteorder == "little") != (self.byte_order == "S")  # "S": the host's swapped
                length = struct.Struct("<Q" if little else ">Q").unpack_from
                buffer = memoryview(self.data)
                for _ in range(count):
                    offs += 8 + length(buffer, offs)[0]
            return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, item]

    return Reader(str(path))


class GGUFCheckpoint:
    """The tensors of GGUF file ``path``, for ``build_model``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = open_gguf(path)
        arch = self.reader.get_field("general.architecture")
        self.architecture = arch.contents() if arch is not None else "?"
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.tied_head: GGUFWeight | None = None

    def _int_field(self, key: str) -> int:
        field = self.reader.get_field(f"{self.architecture}.{key}")
        if field is None:
            raise ValueError(f"{self.path.name}: no {self.architecture}.{key} in its metadata")
        return int(field.contents())

    def refusal(self) -> str | None:
        """Why this file cannot run with quantized kernels, or None when it can."""
        if self.architecture not in ARCHITECTURES:
            return f"its architecture {self.architecture!r} has no quantized path (supported: {', '.join(ARCHITECTURES)})"
        if self.reader.byte_order != "I":  # blocks are read in this host's byte order
            return "it is written in the other byte order than this machine's (a big-endian file)"
        for tensor in self.tensors.values():
            kind = tensor.tensor_type.name
            if kind not in FORMATS and kind not in FLOAT_TYPES and kind != "BF16":
                return f"tensor {tensor.name} is {kind}, which has no quantized CPU kernel (supported: {', '.join(FORMATS)})"
        return None

    def formats(self) -> dict[str, int]:
        """Tensor type -> how many tensors have it (what the log says was loaded)."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts

    def items(self):
        """(our checkpoint name, torch tensor or GGUFWeight) for every tensor."""
        heads, kv_heads = self._int_field("attention.head_count"), self._int_field("attention.head_count_kv")
        for name, tensor in self.tensors.items():
            if name in DERIVED:
                continue
            ours = _our_name(name)
            if ours is None:
                raise ValueError(f"{self.path.name}: unexpected tensor {name!r} for architecture {self.architecture!r}")
            value = self._read(tensor)
            if name.endswith(".attn_q.weight"):
                value = _unpermute(value, heads)
            elif name.endswith(".attn_k.weight"):
                value = _unpermute(value, kv_heads)
            if name == "token_embd.weight" and isinstance(value, GGUFWeight):
                if "output.weight" not in self.tensors:
                    self.tied_head = value
                value = torch.from_numpy(decode(value).dequantize())
            yield ours, value

    def _read(self, tensor):
        kind = tensor.tensor_type.name
        if kind == "BF16":  # numpy has no bfloat16: the raw 16 bits, viewed by torch
            bits = np.ascontiguousarray(np.asarray(tensor.data)).view(np.int16)
            return torch.from_numpy(bits.copy()).view(torch.bfloat16).float()
        if kind in FLOAT_TYPES:
            data = np.asarray(tensor.data)
            if data.dtype != FLOAT_TYPES[kind]:
                data = data.view(FLOAT_TYPES[kind])
            return torch.from_numpy(np.ascontiguousarray(data).astype(np.float32))
        if kind not in FORMATS:
            raise ValueError(f"{self.path.name}: tensor {tensor.name} is {kind}, which has no quantized CPU kernel")
        raw = np.asarray(tensor.data)
        in_features = int(tensor.shape[0])  # ggml lists the fastest (input) dimension first
        return GGUFWeight(kind, raw.reshape(raw.shape[0], -1), in_features)


def _our_name(name: str) -> str | None:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(value, heads: int):
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py's ``permute``), which
    interleaves each head's two rotary halves."""
    rows = value.shape[0]
    # transformers' _reverse_permute_weights, applied to row numbers: row r of ours is ggml's row index[r]
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)
    if isinstance(value, GGUFWeight):
        return value.take_rows(index)
    return value[torch.from_numpy(index)]
