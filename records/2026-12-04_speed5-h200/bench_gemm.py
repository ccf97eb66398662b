"""The block matmuls of one micro-step at the training shape (49,152 tokens, width 768, MLP 3072), each as
train_gpt.py calls it (weights as the same transposed or plain views of their parameters), forward and
forward+backward, under torch's two bf16 GEMM back ends: cuBLAS (torch's default) and cuBLASLt
(torch.backends.cuda.preferred_blas_library). Prints ms per call and TFLOP/s, and the per-step total
(8 micro-steps; attention matmuls in 11 layers, MLP in 12).

    python records/2026-12-04_speed5-h200/bench_gemm.py

Call 1: profiles/bench_gemm.txt. Its backward figures for the 768 x 768 matmuls (0.2-0.3 ms) include
autograd's host overhead, which bench_layouts.py (one torch.mm per GEMM) leaves out.
"""
import torch
from triton.testing import do_bench

T, D, H = 49152, 768, 3072
# name: (input width, how the weight is made from its parameter, parameter shape, calls per micro-step)
MATMULS = {
    "qk   x @ W[:2].mT": (D, lambda p: p.flatten(0, 1).mT, (2, D, D), 11),
    "v    x @ W[2].mT": (D, lambda p: p.mT, (D, D), 11),
    "o    y @ W[3].mT": (D, lambda p: p.mT, (D, D), 11),
    "fc   x @ fc_w": (D, lambda p: p, (D, H), 12),
    "proj h @ proj_w.mT": (H, lambda p: p.mT, (D, H), 12),
}


def bench(name, width, view, shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    p = (torch.randn(shape, device="cuda", generator=gen) / width ** 0.5).bfloat16().requires_grad_()
    y = x @ view(p)
    dy = torch.randn_like(y)
    fwd = do_bench(lambda: x @ view(p), warmup=20, rep=100, return_mode="median")
    both = do_bench(lambda: torch.autograd.grad(x @ view(p), (x, p), dy), warmup=20, rep=100,
                    return_mode="median")
    flops = 2 * T * width * y.size(1)
    return fwd, both - fwd, flops


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    totals = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        total = 0.0
        for name, (width, view, shape, calls) in MATMULS.items():
            fwd, bwd, flops = bench(name, width, view, shape)
            total += 8 * calls * (fwd + bwd)
            print(f"{lib:<8} {name:<20} fwd {fwd:6.3f} ms ({flops / fwd / 1e9:4.0f} TFLOP/s)  "
                  f"bwd {bwd:6.3f} ms ({2 * flops / bwd / 1e9:4.0f} TFLOP/s)", flush=True)
        totals[lib] = total
        print(f"{lib:<8} per step (8 micro-steps): {total:.1f} ms", flush=True)
    print(f"cublaslt - cublas: {totals['cublaslt'] - totals['cublas']:+.1f} ms per step")


if __name__ == "__main__":
    main()
