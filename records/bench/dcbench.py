"""Time DC's kernels (train_gpt.dc_mix: forward, then its backward's query and key sides) at one training pass's
shape (4 sequences of 16,384 tokens, 6 heads of 128, documents of up to 2048 tokens, DC's window 112), for each
launch setting given, and the torch rule (dc_correction's blocked product, compiled) beside them. Prints ms per
pass, forward and forward + backward, medians of --n; CUDA only.

    python records/bench/dcbench.py [--n 20] [--settings "BM,BN,BQ,KV_WARPS,KV_HEADS_IN_GRID" ...]

e.g. --settings 16,32,64,4,1 16,64,64,8,0 16,64,64,4,1 (train_gpt's DC_KERNEL_TILES, DC_KV_WARPS and
DC_KV_HEADS_IN_GRID; the first is the default, records/2026-12-07_master-h200 timed these and more).
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


def timed(fn, n: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20)
    default = (*tg.DC_KERNEL_TILES, tg.DC_KV_WARPS, int(tg.DC_KV_HEADS_IN_GRID))
    parser.add_argument("--settings", nargs="*", default=[",".join(map(str, default))])
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # as setup() has it for the rule's fp32 scores
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, D, window = 4, 16384, 6, 128, 112
    ids = torch.randint(0, 50000, (B, T), device="cuda", generator=gen)
    ids[torch.rand(B, T, device="cuda", generator=gen) < 1 / 800] = tg.BOS_ID
    first = tg.first_visible(tg.document_starts(ids), window - 1)
    ins = [(torch.randn(B, T, H, D, device="cuda", generator=gen) * 0.4).bfloat16().requires_grad_() for _ in range(3)]
    ins += [torch.randn(B, T, H, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2)]
    g = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
    on_gpu = tg.on_gpu
    rule = torch.compile(tg.dc_correction, dynamic=False)
    rows = []
    for setting in [*args.settings, "torch rule"]:
        if setting == "torch rule":
            tg.on_gpu, fn = (lambda t: False), rule
        else:
            *tiles, warps, grid = (int(v) for v in setting.split(","))
            tg.on_gpu, fn, tg.DC_KERNEL_TILES = on_gpu, tg.dc_correction, tuple(tiles)
            tg.DC_KV_WARPS, tg.DC_KV_HEADS_IN_GRID = warps, bool(grid)
        with torch.no_grad():
            fwd = timed(lambda: fn(*ins, first, window), args.n)
        both = timed(lambda: torch.autograd.grad(fn(*ins, first, window), ins, g), args.n)
        rows.append(f"{setting:>16}  forward {fwd:6.2f} ms  forward + backward {both:6.2f} ms")
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
