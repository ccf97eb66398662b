"""Not yet run on a GPU: the experiment for the next lever of issue 17, ReLU^2 fused into the MLP's matmuls.

Today the MLP's up-projection is a cuBLAS GEMM that writes pre = x @ W (bf16), then a compiled kernel reads pre
and writes post = relu(pre)^2; in backward a GEMM writes g_post = g_out @ P, then a kernel reads g_post and pre
and writes g_pre = g_post * 2 relu(pre). At 49,152 x 3,072 bf16 each pass over such a tensor is 302 MB:
the two pointwise kernels cost 13.5 + 19.7 ms per step on an H200 (profiles/new_s0_profile.txt). A GEMM whose
epilogue applies them has the tile in registers: forward writes pre and post, backward reads pre and writes
g_pre, which saves one read forward and a write and a read backward, if the Triton GEMM keeps up with cuBLAS.

This script times, at the training shape, (a) cuBLAS + the compiled pointwise kernel and (b) one Triton GEMM
with the epilogue, forward and backward, over a few tile configurations, and checks (b) against (a): the
epilogues round the fp32 accumulator to bf16 first, as cuBLAS does, so only the GEMM's summation order differs.

    python records/2026-12-03_speed2-h200/bench_mlp.py            # on a GPU
    TRITON_INTERPRET=1 python records/2026-12-03_speed2-h200/bench_mlp.py --check  # CPU, small shapes
"""
import argparse
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _mm_relu2_kernel(a_ptr, b_ptr, pre_ptr, out_ptr, M, N, K: tl.constexpr, stride_am, stride_ak, stride_bk, stride_bn,
                     BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """Forward (BACKWARD False): pre = a @ b and out = relu(pre)^2, both written. Backward: g = a @ b (the grad
    of relu^2's output) and out = g * 2 relu(pre), with pre read. c = (M x N), row-major; tiles grouped
    GROUP_M rows of tiles at a time so that b's columns stay in L2."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    tile_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    rm = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_tile = tl.load(a, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
        b_tile = tl.load(b, mask=(k0 + rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
        a += BLOCK_K * stride_ak
        b += BLOCK_K * stride_bk
    c = acc.to(tl.bfloat16).to(tl.float32)  # the GEMM's own bf16 result, as cuBLAS would write it
    offs = rm[:, None] * N + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    if BACKWARD:
        pre = tl.load(pre_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (c * 2.0 * tl.maximum(pre, 0.0)).to(tl.bfloat16), mask=inside)
    else:
        tl.store(pre_ptr + offs, c.to(tl.bfloat16), mask=inside)
        r = tl.maximum(c, 0.0)
        tl.store(out_ptr + offs, (r * r).to(tl.bfloat16), mask=inside)


def mm_relu2(a, b, pre=None, tiles=(128, 256, 64, 8, 3)):
    """Forward: (pre, relu(pre)^2) for pre = a @ b. Backward (pre given): (a @ b) * 2 relu(pre)."""
    M, K = a.shape
    N = b.shape[1]
    block_m, block_n, block_k, warps, stages = tiles
    out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    backward = pre is not None
    if not backward:
        pre = torch.empty_like(out)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _mm_relu2_kernel[grid](a, b, pre, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                           BACKWARD=backward, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                           num_warps=warps, num_stages=stages)
    return out if backward else (pre, out)


def to_bf16(t, truncate: bool):
    """t in bf16, rounded to nearest even as GPUs do, or truncated as Triton's CPU interpreter does."""
    if not truncate:
        return t.bfloat16()
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()


def reference(x, w, g_out, p, truncate=False):
    """What the trainer computes now, in the same roundings: bf16 GEMM results, pointwise math in fp32."""
    pre = to_bf16(x @ w, truncate)
    post = to_bf16(torch.relu(pre.float()).square(), truncate)
    g_post = to_bf16(g_out @ p, truncate)
    g_pre = to_bf16(g_post.float() * 2 * torch.relu(pre.float()), truncate)
    return pre, post, g_pre


def check(M, K, N, tiles, device, dtype=torch.bfloat16):
    """The kernel against reference() on random data. dtype: the GEMM inputs' (the interpreter's bf16 dot
    returns garbage on CPU, so the CPU check runs the same kernel on fp32 inputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=gen).to(dtype)
    w = (torch.randn(K, N, device=device, generator=gen) * K**-0.5).to(dtype)
    g_out = torch.randn(M, K, device=device, generator=gen).to(dtype)
    p = (torch.randn(K, N, device=device, generator=gen) * K**-0.5).to(dtype)
    want = reference(x, w, g_out, p, truncate=os.environ.get("TRITON_INTERPRET") == "1")
    pre, post = mm_relu2(x, w, tiles=tiles)
    g_pre = mm_relu2(g_out, p, pre=want[0], tiles=tiles)
    worst = []
    for name, got, ref in zip(("pre", "post", "g_pre"), (pre, post, g_pre), want):
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        worst.append(rel)
        print(f"  {name}: relative difference {rel:.2e}", flush=True)
    return max(worst)


def bench(tiles_list):
    from triton.testing import do_bench
    M, K, N = 49152, 768, 3072
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(K, N, device="cuda", generator=gen) * K**-0.5).bfloat16()
    g_out = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    p = (torch.randn(K, N, device="cuda", generator=gen) * K**-0.5).bfloat16()
    relu2 = torch.compile(lambda t: torch.relu(t).square())
    relu2_back = torch.compile(lambda g, t: g * 2 * torch.relu(t))
    pre = x @ w
    ms = lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    fwd = ms(lambda: relu2(x @ w))
    bwd = ms(lambda: relu2_back(g_out @ p, pre))
    gemm = ms(lambda: x @ w)
    print(f"cuBLAS GEMM alone {gemm:.3f} ms; cuBLAS + compiled relu^2: forward {fwd:.3f} ms, backward "
          f"{bwd:.3f} ms (x 12 layers x 8 micro-steps = {96 * (fwd + bwd):.1f} ms per step)", flush=True)
    for tiles in tiles_list:
        try:
            err = check(M, K, N, tiles, "cuda")
            f = ms(lambda: mm_relu2(x, w, tiles=tiles))
            b = ms(lambda: mm_relu2(g_out, p, pre=pre, tiles=tiles))
            print(f"Triton {tiles}: forward {f:.3f} ms, backward {b:.3f} ms, saves {96 * (fwd + bwd - f - b):.1f} ms "
                  f"per step; worst relative difference {err:.1e}", flush=True)
        except Exception as e:  # a tile that does not fit is a row, not the end of the bench
            print(f"Triton {tiles}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="small shapes only (the CPU interpreter)")
    args = parser.parse_args()
    if args.check or os.environ.get("TRITON_INTERPRET") == "1":
        device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
        err = check(192, 96, 320, (64, 64, 32, 4, 1), device,  # ragged: partial tiles in every dim
                    torch.float32 if device == "cpu" else torch.bfloat16)
        assert err < 1e-4, err  # only fp32 summation order differs, flipping a rare rounding
        print("ok")
    else:
        print(torch.cuda.get_device_name(), torch.__version__)
        bench([(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
               (128, 192, 64, 8, 3)])
