"""Not yet run on a GPU: the softcap CE kernel's launch tiles (BLOCK_T rows, BLOCK_V columns, warps), swept at
the training shape (49,152 tokens x 50,304 vocab) for the next round of issue 17.

Why: train_gpt.py's CE_TILES (32, 128, 4) takes 3.7 ms per micro-step (29.6 ms per step at steps 100-101,
profiles/new_s0_profile.txt). It reads each row of bf16 logits twice (a log-sum-exp pass, then a grad pass)
and writes the e5m2 grad: 12.4 GB, ~3.3 TB/s. A program's 32 rows are 3.2 MB of logits, so the second pass
finds none of them in the 50 MB L2 once 132 SMs run such programs. With 1 or 2 rows per program (100-200 KB),
the second pass could read L2 instead of HBM: 7.4 GB from HBM instead of 12.4. Round one tried BLOCK_T 16 only
in a variant that also wrote the transposed grad (12.3 ms, ../2026-12-03_speed-h200/pieces.txt), never below.
The grads of the sweep are compared with those of the current tiles (the row sums' order changes with BLOCK_V,
so a few e5m2 values may round the other way) and the losses too.

    python records/2026-12-03_speed4-h200/bench_ce_tiles.py                      # on a GPU
    TRITON_INTERPRET=1 python records/2026-12-03_speed4-h200/bench_ce_tiles.py   # CPU, a small shape
"""
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

SWEEP = [(32, 128, 4), (1, 512, 4), (1, 1024, 4), (1, 1024, 8), (1, 2048, 8), (2, 512, 4), (2, 1024, 8),
         (4, 256, 4), (4, 512, 4), (4, 512, 8), (8, 256, 4), (8, 256, 8), (16, 128, 4), (16, 256, 8)]


def run(z, targets, tiles):
    """The kernel as softcap_ce_grad launches it, with these tiles: (loss, e5m2 grad)."""
    T, V = z.shape
    block_t, block_v, warps = tiles
    loss = torch.empty(T, device=z.device, dtype=torch.float32)
    g = torch.empty(T, V, device=z.device, dtype=torch.float8_e5m2)
    tg._softcap_ce_kernel[(triton.cdiv(T, block_t),)](z, targets, loss, g, T, 1 / tg.HEAD_GRAD_SCALE, V=V,
                                                      CAP=tg.SOFTCAP, DIV=tg.SOFTCAP_DIV, TOP=tg.E5M2_MAX,
                                                      BLOCK_T=block_t, BLOCK_V=block_v, APPROX=tg.CE_TANH_APPROX,
                                                      num_warps=warps)
    return loss, g


def sweep(T, V, device, configs, time_it):
    gen = torch.Generator(device=device).manual_seed(0)
    z = (torch.randn(T, V, device=device, generator=gen) * 8).bfloat16()
    targets = torch.randint(0, V, (T,), device=device, generator=gen)
    base_loss, base_g = run(z, targets, configs[0])
    rows = []
    for tiles in configs:
        if V % tiles[1]:
            continue
        loss, g = run(z, targets, tiles)
        differ = (g.view(torch.uint8) != base_g.view(torch.uint8)).float().mean().item()
        loss_err = (loss - base_loss).abs().max().item()
        del loss, g
        ms = time_it(lambda: run(z, targets, tiles)) if time_it else float("nan")
        rows.append((ms, tiles, differ, loss_err))
        print(f"tiles {tiles}: {ms:.3f} ms, grads differing from {configs[0]}: {differ:.1e}, "
              f"max |loss difference| {loss_err:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        tg.CE_TANH_APPROX = False  # the interpreter runs no inline PTX
        rows = sweep(5, 512, "cpu", [(4, 128, 4), (1, 256, 4), (2, 512, 4)], None)
        assert all(d < 0.01 and e < 1e-3 for _, _, d, e in rows), rows  # the same function at any tiles
        print("ok")
    else:
        from triton.testing import do_bench
        print(torch.cuda.get_device_name(), torch.__version__)
        rows = sweep(49152, 50304, "cuda", SWEEP,
                     lambda fn: do_bench(fn, warmup=10, rep=50, return_mode="median"))
        print("fastest first:")
        for ms, tiles, differ, loss_err in sorted(rows, key=lambda r: r[0]):
            print(f"  {tiles}: {ms:.3f} ms ({8 * ms:.1f} ms per step of 8 micro-steps)")
