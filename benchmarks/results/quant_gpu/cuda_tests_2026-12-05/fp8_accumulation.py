"""How exactly float8 products are summed on this GPU: a Triton kernel's ``tl.dot`` over
float8 inputs (one accumulator across K, as the W8A8 GEMMs hold it) with Triton's default
and with ``max_num_imprecise_acc`` set, and torch._scaled_mm with and without fast
accumulation, each against the float64 sum of the same products (which are exact)."""
import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn


@triton.jit
def _mm(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IMPRECISE: tl.constexpr, SET: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :])
        if SET:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    M, N = 64, 256
    for K in (64, 128, 1024, 4096):
        a = (torch.randn(M, K, device="cuda") * 100).clamp(-448, 448).to(FP8)
        b = (torch.randn(K, N, device="cuda") * 100).clamp(-448, 448).to(FP8)
        exact = a.double() @ b.double()

        def rel(c, exact=exact):
            return f"{((c.double() - exact).abs().max() / exact.abs().max()).item():.2e}"

        row = [f"K={K:5d}"]
        block_k = min(K, 128)
        for label, imprecise, set_ in (("triton default", 0, False), ("imprecise=0", 0, True),
                                       ("imprecise=32", 32, True), ("imprecise=128", 128, True)):
            if imprecise > block_k:  # (Triton refuses a bound beyond the product's K)
                continue
            c = torch.empty(M, N, device="cuda")
            _mm[(M // 64, N // 64)](a, b, c, M, N, K, 64, 64, block_k, imprecise, set_, num_warps=4)
            row.append(f"{label} {rel(c)}")
        one = torch.ones(1, device="cuda")
        for fast in (False, True):
            c = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                 use_fast_accum=fast)
            row.append(f"_scaled_mm fast={fast} {rel(c)}")
        print("  ".join(row))
    c32 = a.float() @ b.float()
    print(f"fp32 matmul (K=4096, tf32 {torch.backends.cuda.matmul.allow_tf32}): "
          f"{((c32.double() - exact).abs().max() / exact.abs().max()).item():.2e}")


if __name__ == "__main__":
    main()
