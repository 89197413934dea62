"""Tiny seeded random Llama-family checkpoints with a real (tiny) tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

TINY_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# One tiny config per supported variant; each differs where the real architectures do.
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "smollm2_tied_gqa3": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3_qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # Phi-3: q/k/v and gate/up stored merged, LongRoPE (short factors up to 256 positions,
    # long ones, far enough apart to change greedy tokens, past them).
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, original_max_position_embeddings=256, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 6.0, 20.0, 50.0, 90.0, 140.0, 200.0, 260.0]})),
    # Phi-4-mini: LongRoPE over the first 3/4 of each head (partial rotary), tied embeddings.
    "phi4_mini_partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, original_max_position_embeddings=256, partial_rotary_factor=0.75,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.2, 1.5, 2.1, 2.8, 3.6], "long_factor": [1.0, 6.0, 20.0, 50.0, 90.0, 140.0]})),
    # Mixture of experts: top-2 of 4; Qwen2-MoE with a shared expert and a dense layer.
    "mixtral_moe": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        norm_topk_prob=False, mlp_only_layers=[1])),
    # Gemma 3 (text): (1 + w) norms around the attention and the MLP, GeGLU, scaled
    # embeddings, q/k norms, a local rope for sliding layers and a global one, logit softcap.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0)),
    # Gemma 2: Gemma 3's layer without q/k norms or a local rope, with attention logit
    # soft-capping (caps low enough to matter at these weights). Gemma 1: (1 + w) norms,
    # GeGLU and scaled embeddings, no norms after the attention and the MLP.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, tie_word_embeddings=True, pad_token_id=0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
}


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a few standard-library modules' source (fixed
    text, so the tokenizer does not change as this repository does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import inspect
    import bisect, fractions, heapq, shlex, string, textwrap  # noqa: E401  stable text

    corpus = [inspect.getsource(m) for m in (bisect, fractions, heapq, shlex, string, textwrap)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def make_sentencepiece_tokenizer(vocab_size: int = 600):
    """A Llama-2-style tokenizer: SentencePiece's "▁" for a space, and the 256 bytes as
    ``<0x00>`` … ``<0xFF>`` tokens for what the vocabulary cannot spell."""
    import bisect, string, textwrap  # noqa: E401  stable text
    import inspect
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tok.train_from_iterator([inspect.getsource(m) for m in (bisect, string, textwrap)], trainer)
    spec = json.loads(tok.to_str())  # the byte tokens belong to the vocabulary, as in Llama's
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def hf_config(variant: str, **overrides):
    import transformers

    config_cls, _, extra = VARIANTS[variant]
    return getattr(transformers, config_cls)(**{**TINY_COMMON, **extra, **overrides})


def make_hf_model(variant: str, seed: int = 0, **overrides):
    import transformers

    config = hf_config(variant, **overrides)
    if getattr(config, "attn_logit_softcapping", None):
        # Only transformers' eager attention soft-caps on every version (5.17's default SDPA
        # for Gemma 2 leaves the cap out).
        config._attn_implementation = "eager"
    model_cls = VARIANTS[variant][1]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    return model


def sharpened(path: str, factor: float = 40.0) -> str:
    """The draft at ``path`` with its logits scaled by ``factor`` (its final norm): a tiny
    random model's q is nearly uniform (top probability ~0.01), so its confidence would
    say nothing; scaled, it ranges over (0, 1) and its argmax stays put."""
    file = Path(path) / "model.safetensors"
    weights = load_file(file)
    weights["model.norm.weight"] = weights["model.norm.weight"] * factor
    save_file(weights, file, metadata={"format": "pt"})
    return path


def save_perturbed(target_dir, path, noise: float, seed: int = 7) -> str:
    """The checkpoint at ``target_dir`` with Gaussian noise of std ``noise`` added to every
    weight, saved with the tiny tokenizer at ``path``: a draft that agrees with its
    target often, not always (more often the smaller the noise). Returns ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    model.save_pretrained(path)
    make_tokenizer(512).save_pretrained(path)
    return str(path)


def LLM32(*args, **kwargs):  # noqa: N802  (reads like the class it builds)
    """``LLM`` in float32 with a GGUF model's weights dequantised: exact comparisons with
    transformers need both (``auto`` picks bfloat16 on CPUs with native bf16 GEMM, and
    keeps a GGUF's weights quantized on a CPU)."""
    from specserve import LLM

    return LLM(*args, dtype="float32", gguf_weights="dequantized", **kwargs)


def make_eagle_head(target_dir, layers: list[int], path, seed: int = 0, input_norms: bool = False):
    """An EAGLE head for the tiny target at ``target_dir`` as ``python -m specserve.training --arch eagle``
    starts one from target layers ``layers`` (``input_norms``: with its embedding and
    feature norms before ``fc``), its weights nudged at random so that its
    drafts depend on every part of it, saved to ``path`` as training saves heads (bf16).
    Returns (``str(path)``, the training head in float32 with its weights rounded to bf16,
    i.e. exactly what the engine loads)."""
    from transformers import AutoModelForCausalLM

    from specserve.training.eagle_head import EagleHead, save_head
    from specserve.training.draft import build_draft
    from specserve.loader import resolve_model

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = build_draft(target, layers, torch.device("cpu"), target.config.intermediate_size // 2)
    head = EagleHead(target, draft.model.layers, draft.model.norm, input_norms=input_norms)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.copy_(p.to(torch.bfloat16).float())
    save_head(head, resolve_model(str(target_dir)), layers, path)
    return str(path), head.eval()



# A tiny llama as a GGUF file: each weight's ggml type, by the name llama.cpp gives it.
GGUF_TYPES = {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q4_0",
              "ffn_gate": "Q4_1", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
# Formats the gguf package quantizes (the others get random blocks), and what their random
# blocks' scales are divided by to keep weights near the others' size (q up to 31 and
# sub-block scales up to 63 multiply them).
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Where each block format holds its float16 scales (byte offsets, as ggml-common.h lays the
# blocks out): random bytes elsewhere make a valid block, random bytes there may not be finite.
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,),
                "Q5_1": (0, 2), "Q5_K": (0, 2), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,), "IQ4_XS": (0,)}
SCALE_DIVISORS = {"Q6_K": 16, "Q5_K": 32, "Q3_K": 4, "IQ4_NL": 8, "IQ4_XS": 64}
TINY_GGUF = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                 rope_theta=10000.0)


def random_gguf_weight(kind: str, rows: int, k: int, seed: int = 0):
    """A ``GGUFWeight`` of random blocks of ``kind`` (every bit pattern is a valid block)
    with finite fp16 scales."""
    import numpy as np

    from specserve.models.quantized import FORMATS, GGUFWeight

    rng = np.random.default_rng(seed)
    per, nbytes, _ = FORMATS[kind]
    raw = rng.integers(0, 256, size=(rows, k // per, nbytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[kind]:
        raw[..., offset:offset + 2] = (rng.standard_normal((rows, k // per, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return GGUFWeight(kind, raw.reshape(rows, -1), k)


def write_tiny_gguf(directory, seed: int = 0, types: dict | None = None):
    """A tiny tied-embedding llama written as llama.cpp writes a GGUF: q and k rows
    permuted for its rotary layout, every weight in its block format (``types``, default
    GGUF_TYPES: 4-, 6- and 8-bit formats mixed inside one projection; F32, F16 or BF16 for
    a float weight, and under the key "norm" for the norms, F32 by default; a key such as
    "blk.1.ffn_down" sets one layer's). The K-quants and IQ4 formats get
    random blocks (the ``gguf`` package cannot quantize to them), the others quantize
    random weights. Writes ``model.gguf`` plus config.json, a tokenizer and the dequantised
    weights beside it (what ``resolve_model``'s conversion writes), and returns
    (gguf path, the HF model holding exactly the dequantised weights)."""
    from pathlib import Path

    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    from specserve.models.quantized import FORMATS

    types = {**GGUF_TYPES, **(types or {})}
    directory = Path(directory)
    rng = np.random.default_rng(seed)
    config = LlamaConfig(**TINY_GGUF)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    tokenizer = make_tokenizer(config.vocab_size)
    tokenizer.save_pretrained(directory)

    def blocks(weight: torch.Tensor, kind: str) -> np.ndarray:
        qtype = gguf.GGMLQuantizationType[kind]
        rows, k = weight.shape
        if kind not in FORMATS:  # a format without a kernel: zeros
            per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            return np.zeros((rows, k // per * nbytes), np.uint8)
        if kind not in QUANTIZABLE:  # random blocks with small, finite fp16 scales
            per, nbytes, _ = FORMATS[kind]
            raw = rng.integers(0, 256, size=(rows, k // per, nbytes), dtype=np.uint8)
            for off in SCALE_FIELDS[kind]:
                scale = (rng.uniform(0.2, 1.0, (rows, k // per, 1)) * 0.02 / SCALE_DIVISORS.get(kind, 1))
                raw[..., off:off + 2] = scale.astype(np.float16).view(np.uint8)
            return raw.reshape(rows, -1)
        return quantize(weight.float().numpy(), qtype)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(directory / "model.gguf"), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(TINY_GGUF["rope_theta"])
    # The tokenizer as llama.cpp's converter writes it: long arrays (the loader steps over them).
    tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([f"{a} {b}" for a, b in zip(tokens[3:303], tokens[4:304])])
    writer.add_array("general.tags", ["tiny", "test"])  # and a short one, read
    state = hf.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    ours = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(config.num_hidden_layers):
        for hf_part, gguf_part in ours.items():
            names[f"model.layers.{i}.{hf_part}.weight"] = f"blk.{i}.{gguf_part}.weight"
    dequantised = {}
    for hf_name, gguf_name in names.items():
        weight = state[hf_name]
        kind = types.get(gguf_name.removesuffix(".weight"),  # one layer's (as Q4_K_M varies ffn_down)
                         types.get("norm" if weight.dim() == 1 else gguf_name.split(".")[-2], "F32"))
        if kind in ("F32", "F16", "BF16"):  # float tensors, rounded to their type
            rounded = weight.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind])
            dequantised[hf_name] = rounded.float()
            raw = rounded.view(torch.int16).numpy().view(np.uint8) if kind == "BF16" else rounded.numpy()
            writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16 if kind == "BF16" else None)
            continue
        raw = blocks(weight, kind)
        dequantised[hf_name] = torch.from_numpy(
            dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(weight.shape).copy())
        part = gguf_name.split(".")[-2]
        if part in ("attn_q", "attn_k"):  # llama.cpp's convert_hf_to_gguf.py permute()
            n = heads if part == "attn_q" else kv_heads
            raw = raw[np.arange(raw.shape[0]).reshape(n, 2, raw.shape[0] // n // 2).swapaxes(1, 2).reshape(-1)]
        writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        for name, value in dequantised.items():
            state[name].copy_(value)
    hf.save_pretrained(directory)  # the dequantised weights, as resolve_model's conversion writes them
    return directory / "model.gguf", hf


def exact_continuations(target_dir, prompt: list[int], length: int, params: dict) -> dict[tuple, float]:
    """Every ``length``-token continuation of ``prompt`` that sampling with ``params`` (a
    top-k small enough to enumerate) can produce, with its exact probability under the
    checkpoint at ``target_dir`` (transformers, float32): the oracle of distribution tests."""
    from transformers import AutoModelForCausalLM

    from specserve import SamplingParams
    from specserve.sampler import SamplingMetadata, target_probs

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    meta = SamplingMetadata.build([SamplingParams(**params)], torch.device("cpu"))
    exact = {}

    def expand(seq, prob):
        if len(seq) == len(prompt) + length:
            exact[tuple(seq[len(prompt):])] = prob
            return
        with torch.no_grad():
            p = target_probs(hf(torch.tensor([seq])).logits[0, -1:], meta)[0]
        for token in torch.nonzero(p).flatten().tolist():
            expand(seq + [token], prob * p[token].item())

    expand(list(prompt), 1.0)
    return exact


def continuation_chi_square(engine, prompt: list[int], params: dict, exact: dict[tuple, float], n: int) -> float:
    """Run ``n`` copies of ``prompt`` through ``engine`` with sampling ``params`` (their
    ``max_tokens`` the continuations' length) and return the chi-square of the
    continuations seen against ``exact`` (``exact_continuations``); one outside it fails."""
    from specserve import SamplingParams

    length = len(next(iter(exact)))
    mine = {engine.add_request(prompt, SamplingParams(max_tokens=length, ignore_eos=True, **params))
            for _ in range(n)}
    counts: dict[tuple, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.req_id in mine:
                counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert set(counts) <= set(exact), set(counts) - set(exact)
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())


# ---------------------------------------------------------------------------- quantized checkpoints
# config.json's quantization_config per layout, as each library writes it (tiny groups and
# blocks so that the tiny projections hold several).
_CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
           "quantization_status": "compressed"}
QUANT_LAYOUTS = {
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [32, 32]},
    "fp8_tensor_static": {"quant_method": "fp8", "activation_scheme": "static"},
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "ct_fp8_dynamic": {**_CT_FP8, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                           "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}}},
    "ct_fp8_static": {**_CT_FP8, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                           "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                              "dynamic": False}}}},
    "ct_fp8_w8a16": {**_CT_FP8, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                           "symmetric": True, "dynamic": False},
        "input_activations": None}}},
    "awq": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "gptq_v2_asym": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                     "checkpoint_format": "gptq_v2"},
    "gptq_act_order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                       "checkpoint_format": "gptq"},
}
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack_nibbles(values: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """4-bit values (0…15) eight to an int32 along ``axis``: nibble i of word c holds
    position 8c + order[i] (AutoGPTQ's ``pack``: natural order; AutoAWQ's: 0 2 4 6 1 3 5 7)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for i, position in enumerate(order):
        words |= (v[..., position] & 0xF) << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _fp8_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 values and one scale per ``bn`` x ``bk`` block (max magnitude -> 448)."""
    n, k = w.shape
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    values = torch.zeros(n, k)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = block.abs().max() / 448
            values[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = block / scale[i, j]
    return values.to(torch.float8_e4m3fn), scale


def _int4_groups(w: torch.Tensor, group: int, sym: bool, g_idx: np.ndarray):
    """q ``[K, N]``, scales ``[K/G, N]`` fp16, zeros ``[K/G, N]`` for W ``[N, K]``ᵀ, each input
    k quantized with group g_idx[k]'s scale and zero (GPTQ's asymmetric form; symmetric: 8)."""
    wt = w.T.double().numpy()
    groups = int(g_idx.max()) + 1
    scales = np.zeros((groups, wt.shape[1]), np.float16)
    zeros = np.zeros((groups, wt.shape[1]), np.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            scales[g] = (np.maximum(-lo, hi) / 7.5).astype(np.float16)
            zeros[g] = 8
        else:
            scales[g] = ((hi - lo) / 15).astype(np.float16)
            zeros[g] = np.clip(np.round(-lo / scales[g].astype(np.float64)), 0, 15)
    s, z = scales[g_idx].astype(np.float64), zeros[g_idx]
    q = np.clip(np.round(wt / s) + z, 0, 15).astype(np.int64)
    return q, scales, zeros, (q - z) * s  # the last: the dequantised W^T, exact


def write_quantized_checkpoint(src_dir, path, layout: str, seed: int = 0, dequantised_dir=None):
    """The float checkpoint at ``src_dir`` with its projections quantized in ``layout``
    (``QUANT_LAYOUTS``), written at ``path`` as that library writes it; returns a
    transformers model holding the dequantised weights (the reference; embeddings, norms
    and the head stay float). Static activation scales are drawn at random, each its own.
    ``dequantised_dir``: instead, write the float checkpoint of the dequantised weights
    there and return None (for models whose transformers class names its tensors
    otherwise than its checkpoint, as Mixtral's fused experts)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    quant = QUANT_LAYOUTS[layout]
    path = Path(path)
    shutil.copytree(src_dir, path, dirs_exist_ok=True)
    state = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    out, reference, orders = {}, {}, {}
    for name, w in state.items():
        prefix = name[:-len("weight")]
        if not (name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_PROJECTIONS):
            out[name] = w
            continue
        w = w.float()
        n, k = w.shape
        method = quant["quant_method"]
        if method in ("awq", "gptq"):
            group = quant["group_size"]
            g_idx = np.arange(k) // group
            if quant.get("desc_act"):  # one order per input (GPTQ orders by the input's Hessian)
                shared = name.rsplit(".", 2)[0] + ("|qkv" if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
                                                   else "|gate_up" if name.split(".")[-2] in ("gate_proj", "up_proj")
                                                   else name)
                g_idx = g_idx[orders.setdefault(shared, rng.permutation(k))]
            sym = quant.get("sym", False)
            q, scales, zeros, wt = _int4_groups(w, group, sym, g_idx)
            reference[name] = torch.from_numpy(wt.T.copy()).float()
            if method == "awq":
                out[prefix + "qweight"] = torch.from_numpy(_pack_nibbles(q, 1, (0, 2, 4, 6, 1, 3, 5, 7)))
                out[prefix + "qzeros"] = torch.from_numpy(_pack_nibbles(zeros, 1, (0, 2, 4, 6, 1, 3, 5, 7)))
            else:
                stored = zeros - 1 if quant["checkpoint_format"] == "gptq" else zeros
                out[prefix + "qweight"] = torch.from_numpy(_pack_nibbles(q, 0))
                out[prefix + "qzeros"] = torch.from_numpy(_pack_nibbles(stored & 0xF, 1))
                out[prefix + "g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            out[prefix + "scales"] = torch.from_numpy(scales)
            continue
        if layout == "fp8_block":
            values, scale = _fp8_blocks(w, *quant["weight_block_size"])
            out[prefix + "weight_scale_inv"] = scale
            bn, bk = quant["weight_block_size"]
            grid = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        elif layout in ("fp8_tensor_static", "ct_fp8_static"):
            values, scale = _fp8_blocks(w, n, k)
            out[prefix + "weight_scale"] = scale.reshape(() if layout == "fp8_tensor_static" else (1,))
            out[prefix + "input_scale"] = torch.tensor([rng.uniform(0.004, 0.012)], dtype=torch.float32)
            grid = scale
        else:  # one scale per output channel
            values, scale = _fp8_blocks(w, 1, k)
            out[prefix + "weight_scale"] = scale.reshape(n, 1)
            grid = scale
        out[name] = values
        reference[name] = values.float() * grid
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    if dequantised_dir is not None:
        shutil.copytree(src_dir, dequantised_dir, dirs_exist_ok=True)
        save_file({**state, **{name: w.to(state[name].dtype) for name, w in reference.items()}},
                  str(Path(dequantised_dir) / "model.safetensors"))
        return None
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, value in reference.items():
            model.get_parameter(name).copy_(value)
    return model
