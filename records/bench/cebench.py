"""Time the training head's softcapped cross-entropy (softcap_ce_grad) on one GPU at a micro-step's shape (two
16K sequences: 32,768 rows x 50,304 logits): the CE kernel with the e5m2 grad's transpose made by a second
kernel (KernelSettings.ce_stores_transposed off, the launch of today's default) against the CE kernel storing
the transpose itself, at several tiles (rows, vocab columns, warps). Each launch's transposed grad must be the
default's bit for bit.

Prints ms per call (median of --repeats runs of --n calls), each against the default, and what stage 3 would
save per step (12 micro-steps of two sequences on one GPU). One process on the GPU at a time.

    python records/bench/cebench.py [--rows 32768] [--n 5] [--repeats 5]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from mlpbench import median_ms  # noqa: E402  (this folder: a script's own folder is on its path)

DEFAULT = (*tg.KernelSettings.ce_tiles, *tg.KernelSettings.transpose_tile, 0)
FUSED = [(8, 512, 8), (16, 512, 8), (16, 256, 8), (16, 256, 4), (32, 256, 8), (32, 128, 8), (32, 128, 4)]
STAGE3_PASSES = 12


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(args.rows, 50304, device="cuda", generator=gen) * 8).bfloat16()
    targets = torch.randint(0, 50257, (args.rows,), device="cuda", generator=gen)
    weights = torch.tensor([1.0, 0.5, 0.25], device="cuda")

    def ce(launch):
        return tg.softcap_ce_grad(z, targets, weights, tg.HEAD_GRAD_SCALE, launch, True, 16384)

    want = ce(DEFAULT)[3].view(torch.uint8)
    base = median_ms(lambda: ce(DEFAULT), args.n, args.repeats)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rows} x 50304; ms per call, median of "
          f"{args.repeats} x {args.n}")
    print(f"{'launch':34s} {'ms':>8s} {'ratio':>7s} {'stage 3 ms/step':>16s}  transpose")
    print(f"{str(DEFAULT) + ' (default)':34s} {base:8.3f} {1.0:7.3f} {0.0:16.2f}")
    for tile in FUSED:
        launch = (*tile, *tg.KernelSettings.transpose_tile, 1)
        try:
            same = torch.equal(ce(launch)[3].view(torch.uint8), want)
            ms = median_ms(lambda: ce(launch), args.n, args.repeats)
        except Exception as e:  # a tile past the GPU's shared memory or registers: say so, time the rest
            print(f"{str(launch):34s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        print(f"{str(launch):34s} {ms:8.3f} {ms / base:7.3f} {(ms - base) * STAGE3_PASSES:16.2f}  "
              f"{'the same' if same else 'DIFFERS'}")


if __name__ == "__main__":
    main()
