"""Where the W8A8 engine test's logits part from the reference on CUDA (not yet run on a GPU):
per layout, the engine's teacher-forced logits against transformers' with and without the
inputs quantized, per position, and each Fp8Linear call's output against
``reference_linear`` on the same input. A pytest module for the tests' fixtures: copy it
into tests/ and run ``pytest -q -s tests/diag_engine_fp8.py`` there (it is kept out of the
suite).
"""
import pytest
import torch
from test_checkpoint_quant import (
    DEVICE,
    QUANT_LAYOUTS,
    checkpoints,  # noqa: F401 (the fixture)
    quantize_inputs,
    reference_linear,
)
from test_model import ragged_logits

from specserve import LLM
from specserve.models.checkpoint_quant import Fp8Linear, parse_scheme


@pytest.mark.parametrize("layout", ["ct_fp8_dynamic", "ct_fp8_static", "ct_fp8_w8a16", "fp8_block"])
def test_diag(layout, checkpoints):  # noqa: F811 (pytest passes the fixture)
    path, reference = checkpoints(layout)
    scheme = parse_scheme(QUANT_LAYOUTS[layout], "q")
    plain = LLM(str(path), device=DEVICE.type, dtype="float32", block_size=4, num_kv_blocks=128)
    model = plain.engine.runner.model
    prompt = [(5 * i) % 500 + 3 for i in range(12)]
    records = []
    hs = [m.register_forward_hook(lambda mod, args, out: records.append((mod, args[0].detach().clone(), out.detach().clone())))
          for m in model.modules() if isinstance(m, Fp8Linear)]
    got = ragged_logits(model, [prompt], chunk=5, device=DEVICE)[0].cpu()
    for h in hs:
        h.remove()
    with torch.no_grad():
        hf_plain = reference(torch.tensor([prompt])).logits[0]
    hooks = quantize_inputs(reference, path, scheme)
    with torch.no_grad():
        hf_q = reference(torch.tensor([prompt])).logits[0]
    for h in hooks:
        h.remove()
    print(f"\n{layout}: activations={scheme.activations} block={scheme.block}; engine vs hooked {((got - hf_q).abs().max()):.4g}, "
          f"vs unhooked {((got - hf_plain).abs().max()):.4g}, hooked vs unhooked {((hf_q - hf_plain).abs().max()):.4g}; "
          f"per position vs hooked {[round(v, 4) for v in (got - hf_q).abs().amax(-1).tolist()]}")
    names = {id(m): n for n, m in model.named_modules()}
    for mod, x, y in records[:12]:
        want = reference_linear(mod, x)
        err = ((y.double().cpu().reshape(want.shape) - want).abs().max() / want.abs().max()).item()
        print(f"  {names[id(mod)]} x{tuple(x.shape)} {x.dtype} rel err {err:.3g} act={mod.activations} widened={mod.widened is not None}")
