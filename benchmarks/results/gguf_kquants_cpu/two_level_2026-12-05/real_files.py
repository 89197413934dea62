"""llama.cpp-written blocks in both forms: every quantized tensor of the GGUF files given
(the 256-wide tiny llama's files that ../real_blocks.py writes, the default model's
requantized files) as a QuantLinear with two-level scales and with float32 products, the
same inputs through each (1 and 5 rows on the integer kernel, 40 rows unpacked for a GEMM
or AMX tiles, float32 and bf16): the outputs must be equal, bit for bit.

    python real_files.py FILE.gguf ...
"""
import collections
import sys

import gguf
import numpy as np
import torch
from specserve.kernels import cpu_ops

from specserve.models.quantized import FORMATS, GGUFWeight, QuantLinear

assert cpu_ops.two_level_scales(), "this build takes no two-level scales"
for path in sys.argv[1:]:
    reader = gguf.GGUFReader(path)
    counts, unequal = collections.Counter(), []
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in FORMATS:
            continue
        rows, k = int(tensor.shape[1]), int(tensor.shape[0])
        weight = GGUFWeight(name, np.asarray(tensor.data).reshape(rows, -1), k)
        two = QuantLinear([(0, weight)], k, rows, None)
        real = cpu_ops.two_level_scales
        cpu_ops.two_level_scales = lambda: False
        try:
            products = QuantLinear([(0, weight)], k, rows, None)
        finally:
            cpu_ops.two_level_scales = real
        form = "two-level" if two.scales.dtype == torch.uint8 else "unchanged"
        same = True
        for m, dequant_rows in ((1, 0), (5, 0), (40, 16)):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
                two.dequant_rows = products.dequant_rows = dequant_rows
                same &= torch.equal(two(x), products(x))
        counts[(name, form)] += 1
        if not same:
            unequal.append(tensor.name)
    print(f"{path}: tensors {dict(sorted(counts.items()))}; outputs unequal: {unequal}", flush=True)
