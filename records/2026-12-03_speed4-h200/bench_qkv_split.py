"""What splitting the attention's input projection costs in cuBLAS: one x @ W_qkv.T (2304 outputs) against
x @ W_qk.T (1536) and x @ W_v.T (768), forward and both backward matmuls, at the training shape (49,152 tokens
of 768). A split lets a hand-written QK-norm + rotary op own the whole grad of its input (q and k), so its
backward writes that grad once instead of inductor copying it into the qkv grad; the price is two smaller
GEMMs per matmul and the sum of the two dx (timed here as an add, the worst case: in the trainer it can fuse
into rms_norm's backward).

    python records/2026-12-03_speed4-h200/bench_qkv_split.py   # on a GPU
"""
import torch
from triton.testing import do_bench


def main():
    T, D = 49152, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(3 * D, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    dy = torch.randn(T, 3 * D, device="cuda", generator=gen).bfloat16()
    w_qk, w_v = w[:2 * D], w[2 * D:]
    dy_qk, dy_v = dy[:, :2 * D].contiguous(), dy[:, 2 * D:].contiguous()
    ms = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    rows = {
        "forward": (lambda: x @ w.T, lambda: (x @ w_qk.T, x @ w_v.T)),
        "dx": (lambda: dy @ w, lambda: dy_qk @ w_qk + dy_v @ w_v),
        "dx (addmm)": (lambda: dy @ w, lambda: torch.addmm(dy_qk @ w_qk, dy_v, w_v)),
        "dw": (lambda: dy.T @ x, lambda: (dy_qk.T @ x, dy_v.T @ x)),
    }
    print(torch.cuda.get_device_name(), torch.__version__)
    total_one = total_two = 0.0
    for name, (one, two) in rows.items():
        a, b = ms(one), ms(two)
        if name != "dx (addmm)":
            total_one, total_two = total_one + a, total_two + b
        print(f"{name:12s} one GEMM {a:.3f} ms, split {b:.3f} ms ({b - a:+.3f})", flush=True)
    print(f"per call, forward + backward: one {total_one:.3f} ms, split {total_two:.3f} ms; x 88 calls per step: "
          f"{88 * (total_two - total_one):+.1f} ms per step", flush=True)


if __name__ == "__main__":
    main()
