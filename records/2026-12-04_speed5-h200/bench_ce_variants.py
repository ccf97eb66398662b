"""Variants of train_gpt.py's softcap CE kernel at the training shape (49,152 tokens x 50,304 vocab), each
checked against train_gpt.softcap_ce_grad (the CE kernel, then the separate transpose of its e5m2 grad):
- "fused T": the same kernel also stores each grad tile transposed, by pointer arithmetic (no tl.trans), so
  the separate transpose (1.3 ms per micro-step) goes;
- "persistent": a few programs per SM, each looping over rows of 1-2, any BLOCK_V (columns masked), so a row's
  100 KB of logits could still be in L2 when the second pass re-reads it.
Each line: ms per micro-step for CE plus whatever transpose is still needed, and how many grad bytes differ.
Call 1 ran every config (the one-shot list then had its first three): profiles/bench_ce_variants.txt; call 2
the one-shot ones (`one-shot` as the argument): profiles/bench_ce_oneshot.txt. "fused T" wrote wrong bytes
in its transposed grad on the H200 (15% of them), as round one's fused stores had, and was slower anyway.

    python data/proxy.py --src .gpu --dst /tmp/proxy --train 1    (not needed: the logits are random)
    python records/2026-12-04_speed5-h200/bench_ce_variants.py [NAME_PREFIX ...]   # on a GPU
    TRITON_INTERPRET=1 python records/2026-12-04_speed5-h200/bench_ce_variants.py   # CPU, a small shape
"""
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


@triton.jit
def ce_variant(z_ptr, targets_ptr, loss_ptr, g_ptr, gt_ptr, T, inv_grad_s, V: tl.constexpr, CAP: tl.constexpr,
               DIV: tl.constexpr, TOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
               APPROX: tl.constexpr, WRITE_T: tl.constexpr, ITERS: tl.constexpr):
    """Row blocks pid, pid + grid, ... (ITERS of them; rows past T are masked): a constexpr trip count,
    because triton 3.6's CPU interpreter cannot loop to a runtime bound."""
    LOG2E: tl.constexpr = 1.4426950408889634
    HALF_CAP2: tl.constexpr = 0.5 * CAP * LOG2E
    for i in range(ITERS):
        rb = tl.program_id(0) + i * tl.num_programs(0)
        rows = (rb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = rows < T
        s = tl.zeros((BLOCK_T,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            inside = live[:, None] & (cols < V)[None, :]
            z = tl.load(z_ptr + rows[:, None] * V + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            th = tg._tanh(z * (0.5 / DIV), APPROX)
            s += tl.sum(tl.where(inside, tl.exp2(th * HALF_CAP2 - HALF_CAP2), 0.0), axis=1)
        lse2 = CAP * LOG2E + tl.log2(s)
        t = tl.load(targets_ptr + rows, mask=live, other=0).to(tl.int64)
        z_t = tl.load(z_ptr + rows * V + t, mask=live, other=0.0).to(tl.float32)
        th_t = tg._tanh(z_t * (0.5 / DIV), APPROX)
        tl.store(loss_ptr + rows, (lse2 - (th_t + 1.0) * HALF_CAP2) / LOG2E, mask=live)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            inside = live[:, None] & (cols < V)[None, :]
            z = tl.load(z_ptr + rows[:, None] * V + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            th = tg._tanh(z * (0.5 / DIV), APPROX)
            p = tl.exp2(th * HALF_CAP2 + (HALF_CAP2 - lse2[:, None]))
            dc = tl.where(cols[None, :] == t[:, None], p - 1.0, p)
            g = dc * (1.0 - th * th) * (inv_grad_s * CAP / (4.0 * DIV))
            g = tl.minimum(tl.maximum(g, -TOP), TOP).to(tl.float8e5)
            tl.store(g_ptr + rows[:, None] * V + cols[None, :], g, mask=inside)
            if WRITE_T:
                tl.store(gt_ptr + cols[None, :] * T + rows[:, None], g, mask=inside)


def run(z, targets, block_t, block_v, warps, programs, write_t):
    """(loss, g, g transposed) from the variant; programs: grid size (None: one program per row block)."""
    T, V = z.shape
    loss = torch.empty(T, device=z.device, dtype=torch.float32)
    g = torch.empty(T, V, device=z.device, dtype=torch.float8_e5m2)
    gt = torch.empty(V, T, device=z.device, dtype=torch.float8_e5m2) if write_t else g
    grid = programs or triton.cdiv(T, block_t)
    iters = triton.cdiv(triton.cdiv(T, block_t), grid)
    ce_variant[(grid,)](z, targets, loss, g, gt, T, 1 / tg.HEAD_GRAD_SCALE, V=V, CAP=tg.SOFTCAP,
                        DIV=tg.SOFTCAP_DIV, TOP=tg.E5M2_MAX, BLOCK_T=block_t, BLOCK_V=block_v,
                        APPROX=tg.CE_TANH_APPROX, WRITE_T=write_t, ITERS=iters, num_warps=warps)
    return loss, g, (gt if write_t else tg.transposed(g))


def configs(sms):
    out = [("trainer's", None)]
    for bt, bv, w in [(32, 128, 4), (32, 128, 8), (16, 128, 4), (64, 128, 8), (32, 256, 8)]:
        out.append((f"fused T {bt}x{bv} w{w}", dict(block_t=bt, block_v=bv, warps=w, programs=None, write_t=True)))
    for bt, bv, w, per_sm in [(1, 1024, 4, 2), (1, 1024, 4, 4), (1, 2048, 8, 1), (1, 2048, 8, 2), (2, 1024, 8, 1),
                              (2, 1024, 8, 2), (1, 512, 4, 8), (1, 1024, 8, 2), (4, 512, 8, 1)]:
        out.append((f"persistent {bt}x{bv} w{w} {per_sm}/SM",
                    dict(block_t=bt, block_v=bv, warps=w, programs=per_sm * sms, write_t=False)))
    for bt, bv, w in [(1, 1024, 4), (2, 1024, 8), (8, 256, 8),  # call 1; call 2 added the rest
                      (8, 256, 4), (4, 256, 4), (4, 512, 8), (8, 512, 8), (16, 256, 8), (8, 128, 4), (16, 128, 4),
                      (2, 512, 4), (16, 512, 16), (4, 1024, 8)]:
        out.append((f"one-shot {bt}x{bv} w{w}", dict(block_t=bt, block_v=bv, warps=w, programs=None, write_t=False)))
    return out


def trainers_kernel(z, targets):
    """train_gpt's CE kernel launched as softcap_ce_grad launches it on GPU, then torch's transpose: on CPU
    softcap_ce_grad takes its torch path, whose e5m2 rounding the interpreter's casts (which truncate) miss."""
    T, V = z.shape
    block_t, block_v, warps = tg.CE_TILES
    loss = torch.empty(T, dtype=torch.float32)
    g = torch.empty(T, V, dtype=torch.float8_e5m2)
    tg._softcap_ce_kernel[(triton.cdiv(T, block_t),)](z, targets, loss, g, T, 1 / tg.HEAD_GRAD_SCALE, V=V,
                                                      CAP=tg.SOFTCAP, DIV=tg.SOFTCAP_DIV, TOP=tg.E5M2_MAX,
                                                      BLOCK_T=block_t, BLOCK_V=block_v, APPROX=False,
                                                      num_warps=warps)
    return loss, g, g.T.contiguous()


def sweep(T, V, device, cfgs, time_it):
    gen = torch.Generator(device=device).manual_seed(0)
    z = (torch.randn(T, V, device=device, generator=gen) * 8).bfloat16()
    targets = torch.randint(0, V, (T,), device=device, generator=gen)
    trainers = (lambda: tg.softcap_ce_grad(z, targets, tg.HEAD_GRAD_SCALE)) if z.is_cuda else \
        (lambda: trainers_kernel(z, targets))
    base = trainers()
    rows = []
    for name, kw in cfgs:
        fn = trainers if kw is None else (lambda kw=kw: run(z, targets, **kw))
        try:
            loss, g, gt = fn()
            differ = (g.view(torch.uint8) != base[1].view(torch.uint8)).float().mean().item()
            differ_t = (gt.view(torch.uint8) != base[2].view(torch.uint8)).float().mean().item()
            loss_err = (loss - base[0]).abs().max().item()
            del loss, g, gt
            ms = time_it(fn) if time_it else float("nan")
        except Exception as e:  # a config that fails to compile or run is a row, not the end
            print(f"{name:<32} {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            continue
        rows.append((ms, name, differ, differ_t, loss_err))
        print(f"{name:<32} {ms:7.3f} ms  grad bytes differing {differ:.1e}, transposed {differ_t:.1e}, "
              f"max |loss diff| {loss_err:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        tg.CE_TANH_APPROX = False  # the interpreter runs no inline PTX
        cfgs = [("trainer's", None),
                ("fused T", dict(block_t=4, block_v=128, warps=4, programs=None, write_t=True)),
                ("persistent", dict(block_t=1, block_v=256, warps=4, programs=2, write_t=False)),
                ("persistent 2", dict(block_t=2, block_v=512, warps=4, programs=3, write_t=False))]
        rows = sweep(7, 640, "cpu", cfgs, None)
        assert len(rows) == 4 and all(d < 0.01 and dt < 0.01 and e < 1e-3 for _, _, d, dt, e in rows), rows
        print("ok")
    else:
        from triton.testing import do_bench
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        wanted = sys.argv[1:]  # name prefixes, e.g. "one-shot": only those configs (and the trainer's)
        cfgs = [c for c in configs(sms) if c[1] is None or not wanted or any(c[0].startswith(w) for w in wanted)]
        rows = sweep(49152, 50304, "cuda", cfgs,
                     lambda fn: do_bench(fn, warmup=5, rep=30, return_mode="median"))
        print("fastest first (CE + any transpose, per micro-step):")
        for ms, name, differ, differ_t, loss_err in sorted(rows):
            print(f"  {name:<32} {ms:.3f} ms ({8 * ms:.1f} ms per step)")
