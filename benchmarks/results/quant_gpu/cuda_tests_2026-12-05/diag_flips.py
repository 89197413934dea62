"""Does the W8A8 engine test fail on CUDA because float32 noise flips float8 roundings?
Per W8A8 layout: each quantized projection's input in the engine's teacher-forced pass
against transformers' (before its hooks round it), the float8 values that come out
different and how near the HF value lies to a rounding midpoint; each engine layer against
``reference_linear`` on its own input; then transformers run on the engine's own rounded
inputs, whose logits should equal the engine's to 1e-4 if flips are the whole story. A
pytest module for the tests' fixtures: copy into tests/, ``pytest -q -s``."""
import pytest
import torch
from test_checkpoint_quant import (  # noqa: F401
    DEVICE,
    QUANT_LAYOUTS,
    checkpoints,
    fp8_round,
    reference_linear,
)
from test_model import ragged_logits

from specserve import LLM
from specserve.models.checkpoint_quant import Fp8Linear, parse_scheme

HF_OF = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def rounded(x, scheme, static, codes=False):
    """x rounded as the scheme says, as values; ``codes``: the float8 values before scaling."""
    if scheme.activations == "static":
        s = static.reshape(()).double()
        return fp8_round(x, s.float()) / (s if codes else 1)
    group = x.shape[-1] if scheme.activations == "token" else scheme.block[1]
    out = []
    for p in x.split(group, dim=-1):
        s = (p.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        out.append(fp8_round(p, s) / (s.double() if codes else 1))
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("layout", ["ct_fp8_dynamic", "ct_fp8_static", "fbgemm_fp8", "fp8_block", "fp8_tensor_static"])
def test_flips(layout, checkpoints):  # noqa: F811
    from safetensors import safe_open

    path, reference = checkpoints(layout)
    scheme = parse_scheme(QUANT_LAYOUTS[layout], "q")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        statics = {n[:-len(".input_scale")]: f.get_tensor(n) for n in f.keys() if n.endswith("input_scale")}  # noqa: SIM118 (not a dict)
    plain = LLM(str(path), device=DEVICE.type, dtype="float32", block_size=4, num_kv_blocks=128)
    model = plain.engine.runner.model
    prompt = [(5 * i) % 500 + 3 for i in range(12)]
    eng_in, eng_out, order = {}, {}, []
    names = {id(m): n for n, m in model.named_modules()}

    def rec(mod, args, out):
        n = names[id(mod)]
        if n not in eng_in:
            order.append(n)
        eng_in.setdefault(n, []).append(args[0].detach().float().cpu().reshape(-1, mod.in_features))
        eng_out.setdefault(n, []).append(out.detach().double().cpu().reshape(-1, mod.out_features))
    hs = [m.register_forward_hook(rec) for m in model.modules() if isinstance(m, Fp8Linear)]
    got = ragged_logits(model, [prompt], chunk=5, device=DEVICE)[0].cpu()
    for h in hs:
        h.remove()
    eng_in = {n: torch.cat(v) for n, v in eng_in.items()}
    eng_out = {n: torch.cat(v) for n, v in eng_out.items()}
    print(f"\n== {layout}: activations={scheme.activations} block={scheme.block}")
    for n in order:
        mod = model.get_submodule(n)
        want = reference_linear(mod, eng_in[n])
        err = ((eng_out[n] - want).abs().max() / want.abs().max()).item()
        print(f"  engine layer {n}: rel err vs reference_linear on its own input {err:.3g}")
    hf_in = {}
    hs = []
    for name, module in reference.named_modules():
        if name.split(".")[-1] in sum(HF_OF.values(), ()):
            hs.append(module.register_forward_pre_hook(
                lambda m, a, name=name: hf_in.__setitem__(name, a[0].detach().float().reshape(-1, a[0].shape[-1]))))
    for name, module in reference.named_modules():  # then rounded by HF's own values
        if name.split(".")[-1] in sum(HF_OF.values(), ()):
            hs.append(module.register_forward_pre_hook(
                lambda m, a, name=name: (rounded(a[0], scheme, statics.get(name)).float(),)))
    with torch.no_grad():
        hf_q = reference(torch.tensor([prompt])).logits[0]
    for h in hs:
        h.remove()
    print(f"  engine vs hooked HF logits {(got - hf_q).abs().max():.4g}; per position "
          f"{[round(v, 4) for v in (got - hf_q).abs().amax(-1).tolist()]}")
    for n in order:
        parent, leaf = n.rsplit(".", 1)
        hf_name = f"{parent}.{HF_OF[leaf][0]}"
        e, h = eng_in[n], hf_in[hf_name]
        static = statics.get(hf_name)
        re, rh = rounded(e, scheme, static, codes=True), rounded(h, scheme, static, codes=True)
        diff = re != rh
        line = f"  {n}: input max diff {(e - h).abs().max():.3g} (|x| max {h.abs().max():.3g}); float8 values differing {int(diff.sum())}/{diff.numel()}"
        if diff.any():
            # how far the HF value is from the midpoint between the two roundings, relative
            # how far HF's scaled value lies from the midpoint between the two codes, relative
            sh = (rounded(h, scheme, static) / rh.where(rh != 0, 1))[diff]  # HF's scale per element
            mid = (re[diff] + rh[diff]) / 2
            line += f"; HF's scaled value from the midpoint, relative: max {((h[diff].double() / sh - mid).abs() / mid.abs()).max():.3g}"
        print(line)
    # transformers on the engine's own rounded inputs, its own inputs (before) against the engine's
    hs, sub_in = [], {}
    for n in order:
        parent, leaf = n.rsplit(".", 1)
        for hf_leaf in HF_OF[leaf]:
            static = statics.get(f"{parent}.{hf_leaf}")
            sub = rounded(eng_in[n], scheme, static).float().reshape(1, -1, eng_in[n].shape[-1])
            hs.append(reference.get_submodule(f"{parent}.{hf_leaf}").register_forward_pre_hook(
                lambda m, a, sub=sub, n=n: (sub_in.setdefault(n, a[0].detach().float().reshape(-1, a[0].shape[-1])), sub)[1:]))
    with torch.no_grad():
        hf_sub = reference(torch.tensor([prompt])).logits[0]
    for h in hs:
        h.remove()
    print(f"  engine vs HF on the engine's rounded inputs {(got - hf_sub).abs().max():.4g}; its inputs against the engine's, "
          f"relative to their largest: {[f'{((eng_in[n] - sub_in[n]).abs().max() / sub_in[n].abs().max()).item():.2g}' for n in order]}")
