"""Time the soft-capped cross-entropy kernel (softcap_ce_rows on a GPU: the FP8 head's loss, its e5m2 grad) at
one launch of the default: a 16,384-row sequence of bf16 logits over the 50,304-column vocab, the multi-token
weights and the prefix term on, tanh.approx, as a stage-3 step makes it 24 times. Each launch of LAUNCHES
(rows, vocab columns, warps) is timed (CUDA events, the median of --n calls). Two versions of the trainer run
in two processes (--script; both register the same torch ops): --save FILE keeps what the first launch wrote
(losses, grad; 0.9 GB), and --against FILE gives each launch's distance from it (the largest loss difference,
the share of grad bytes that differ). One process on the GPU at a time.

    python records/bench/cebench.py [--script train_gpt.py] [--n 50] [--launches JSON] [--out FILE]
        [--save FILE | --against FILE]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dcbench import timed  # noqa: E402  CUDA events, the median of n runs after 3 unclocked
from stagebench import REPO, load_trainer  # noqa: E402  a trainer's file loaded as train_gpt

# one or two rows a program, 16 warps: at most ~40 MB of rows in flight (3 programs of 40 registers a thread on
# each of 132 multiprocessors), so that the second pass may read them from L2 (records/2026-12-08_ce-sass)
LAUNCHES = [(8, 512, 8), (4, 512, 4), (8, 256, 8), (16, 512, 8), (4, 1024, 8), (2, 1024, 4), (1, 1024, 8),
            (1, 2048, 16), (2, 2048, 16), (1, 4096, 16)]
ROWS, LAUNCHES_PER_STEP = 16384, 24  # a stage-3 step: 24 sequences of 16,384 rows


def distance(out, kept) -> str:
    """How far a launch's (loss, ntp, grad) lie from those kept by --save."""
    loss = max((a - b).abs().max().item() for a, b in zip(out[:2], kept[:2]))
    return f"losses {loss:.1e} apart, {(out[2].view(torch.uint8) != kept[2].view(torch.uint8)).float().mean():.1e} " \
        "of grad bytes differ"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default=str(REPO / "train_gpt.py"), help="the trainer whose kernel is timed")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--launches", default=None, help="a JSON list of [rows, columns, warps] to time instead")
    parser.add_argument("--out", default=None, help="a file the lines are appended to")
    parser.add_argument("--save", default=None, help="a file for what the first launch wrote")
    parser.add_argument("--against", default=None, help="a file --save wrote: each launch's distance from it")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: cebench times a GPU kernel: it needs CUDA")
    tg = load_trainer(args.script)
    gen = torch.Generator(device="cuda").manual_seed(0)
    V = 50304
    z = (torch.randn(ROWS, V, device="cuda", generator=gen) * 4).bfloat16()
    targets = torch.randint(0, 50257, (ROWS,), device="cuda", generator=gen)
    prefix = torch.tensor(tg.prefix_tokens(V), device="cuda")[targets]
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25], device="cuda")
    out = tg.ce_outputs(ROWS, V, z.device)
    launches = [tuple(x) for x in json.loads(args.launches)] if args.launches else LAUNCHES
    kept = torch.load(args.against, map_location="cuda") if args.against else None
    lines = [f"{Path(args.script).name}: {torch.cuda.get_device_name()}, {ROWS} x {V} logits, n {args.n}"]
    for launch in launches:
        def call():
            tg.softcap_ce_rows(z, targets, weights, tg.HEAD_GRAD_SCALE, launch, True, ROWS, out, prefix)
        try:
            ms = timed(call, args.n)
        except Exception as e:  # a launch that does not fit the GPU
            lines.append(f"{launch}: {type(e).__name__}")
            continue
        lines.append(f"{launch}: {ms:.3f} ms a call, {LAUNCHES_PER_STEP * ms:.1f} ms a stage-3 step"
                     + (f"; from {Path(args.against).name}: {distance(out, kept)}" if kept else ""))
        print(lines[-1], flush=True)
        if args.save and launch == launches[0]:
            torch.save([t.cpu() for t in out], args.save)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
