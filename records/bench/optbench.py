"""Time the optimizer's elementwise work on one GPU at the default's bucket sizes (ShardedOptimizer, one process):

1. an Adam step with cautious decay of the Adam buckets (463M fp32 values: the head's 77M, the embeddings'
   386M): the rules as torch ops (adam_update, then cautious_step) against the one kernel (cautious_step_fused);
2. the cautious step of the NorMuon buckets (75.5M values) given the update: torch ops against the kernel;
3. the divergence check of every bucket (539M values): isfinite().all() against finite (one aminmax).

Prints ms per call (median of --repeats runs of --n calls), each pair's ratio, and the kernel's largest
distance from the torch ops in units of the operands' scale. Adam runs every second step, the other two every
step. One process on the GPU at a time.

    python records/bench/optbench.py [--n 5] [--repeats 5]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from mlpbench import median_ms  # noqa: E402  (this folder: a script's own folder is on its path)

ADAM_BUCKETS = {"head": 77_266_944, "embeds": 386_334_720}  # the default's (param_groups), one process
MUON_VALUES = 75_497_472
BETAS = {"head": tg.ADAM_GROUPS["head"].betas, "embeds": tg.ADAM_GROUPS["embeds"].betas}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(n, scale=1.0):
        return torch.randn(n, device="cuda", generator=gen) * scale

    buckets = {name: [rand(n), rand(n, 1e-3), rand(n, 1e-3), rand(n, 1e-3).square()]
               for name, n in ADAM_BUCKETS.items()}  # p, grad, exp_avg, exp_avg_sq

    def adam_torch():
        for name, (p, g, m, v) in buckets.items():
            g = g.clone()  # the rule writes its direction over grad
            tg.cautious_step(p, tg.adam_update(g, m, v, 7, BETAS[name], 1e-10), 1e-4, 1e-6, True)

    def adam_fused():
        for name, (p, g, m, v) in buckets.items():
            tg.cautious_step_fused(p, m, 1e-4, 1e-6, True, adam=(g, v, 7, BETAS[name], 1e-10))

    def grad_copies():  # what adam_torch spends on its clones, taken off its time
        for p, g, m, v in buckets.values():
            g.clone()

    p, u = rand(MUON_VALUES), rand(MUON_VALUES)
    flats = [b[0] for b in buckets.values()] + [p]
    rows = []
    clone_ms = median_ms(grad_copies, args.n, args.repeats)
    rows.append(("Adam step + cautious decay, 463M (every 2nd step)",
                 median_ms(adam_torch, args.n, args.repeats) - clone_ms, median_ms(adam_fused, args.n, args.repeats)))
    rows.append(("NorMuon's cautious step, 75.5M",
                 median_ms(lambda: tg.cautious_step(p, u, 1e-4, 1e-6, False), args.n, args.repeats),
                 median_ms(lambda: tg.cautious_step_fused(p, u, 1e-4, 1e-6, False), args.n, args.repeats)))
    rows.append(("divergence check, 539M",
                 median_ms(lambda: torch.stack([f.isfinite().all() for f in flats]).all(), args.n, args.repeats),
                 median_ms(lambda: torch.stack([tg.finite(f) for f in flats]).all(), args.n, args.repeats)))

    # the same inputs through both paths once more: the kernel's distance from the torch ops
    a = [t.clone() for t in buckets["embeds"]]
    b = [t.clone() for t in a]
    tg.cautious_step(a[0], tg.adam_update(a[1], a[2], a[3], 7, BETAS["embeds"], 1e-10), 0.6, 0.01, True)
    tg.cautious_step_fused(b[0], b[2], 0.6, 0.01, True, adam=(b[1], b[3], 7, BETAS["embeds"], 1e-10))
    far = [((x - y).abs().max() / scale).item() for x, y, scale in zip((a[0], a[2], a[3]), (b[0], b[2], b[3]),
                                                                        (1.0, 1e-3, 1e-6))]

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call, median of {args.repeats} x "
          f"{args.n}")
    print(f"{'':52s} {'torch ops':>10s} {'one kernel':>11s} {'ratio':>7s}")
    for what, slow, fast in rows:
        print(f"{what:52s} {slow:10.3f} {fast:11.3f} {fast / slow:7.3f}")
    per_step = (rows[0][1] - rows[0][2]) / 2 + sum(slow - fast for _, slow, fast in rows[1:])
    print(f"saved per training step (Adam's half): {per_step:.2f} ms")
    print("kernel against torch ops, embeddings' Adam step, largest |difference| / operand scale: "
          f"p {far[0]:.2e}, exp_avg {far[1]:.2e}, exp_avg_sq {far[2]:.2e}")


if __name__ == "__main__":
    main()
