"""window_attention (--attn_kernel) against compiled FlexAttention at stage 3's attention shapes, on one GPU: a pass
of 4 x 16,384 tokens of a real shard, per layer kind (short window 640, long 1408, paired heads: half the heads
over the interleaved 131,072 positions), forward and forward + backward (CUDA events, median of --reps). Each of
our three kernels is timed in each of its candidate launches (the other two at ATTN_HOPPER_TILES'); the fastest
are then timed together and checked against Flex (relative difference of the output and the grads). The last
line totals a stage-3 step (10 attention layers a pass, 6 passes). Its precursor took about 2 minutes on an H100
for a third as many launches, compiles included (records/2026-12-07_attn-h100, call C).

    python records/bench/attnbench.py SHARD [--reps N] [--out DIR]
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]
import train_gpt as tg  # noqa: E402
from dcbench import timed  # noqa: E402  CUDA events, the median of n runs after 3 unclocked
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

# candidate launches (ATTN_TILE: queries, keys, warps, stages, tma) of the forward, dq and dk/dv kernels (the
# dk/dv kernel's queries divide its keys, the others' keys their queries); records/2026-12-07_attn-h100 timed
# three each without TMA, where 64 x 64 won every kernel. TMA: the walked tiles by descriptors (compiled for
# sm_90 on a CPU, records/2026-12-08_ce-sass: fewer registers, 7-12% fewer instructions a tile)
CANDIDATES = {"fwd": [(64, 64, 4, 3, 0), (64, 64, 4, 3, 1), (128, 64, 8, 3, 0), (128, 64, 8, 3, 1), (64, 32, 4, 3, 0),
                      (64, 64, 4, 4, 1)],
              "dq": [(64, 64, 4, 2, 0), (64, 64, 4, 2, 1), (128, 64, 8, 2, 1), (64, 32, 4, 2, 0), (64, 64, 4, 3, 1)],
              "dkdv": [(64, 64, 4, 2, 0), (64, 64, 4, 2, 1), (64, 64, 4, 3, 1), (64, 128, 8, 2, 1), (32, 128, 8, 2, 0),
                       (32, 64, 4, 2, 0)]}
KINDS = {"short": (640, False, 4), "long": (1408, False, 2), "paired": (640, True, 4)}  # window, paired, layers
PASSES = 6  # a stage-3 step's passes: 24 sequences, 4 a pass


def launch(tiles: dict) -> list:
    return [x for name in ("fwd", "dq", "dkdv") for x in tiles[name]]


def ours(q, k, v, g, first, tiles: dict, backward: bool):
    out, lse = tg.window_attention(q, k, v, first, launch(tiles))
    return tg.window_attention_backward(q, k, v, out, lse, g, first, launch(tiles)) if backward else (out,)


def bench_kind(kind: str, starts, reps: int, lines: list) -> tuple:
    window, paired, _ = KINDS[kind]
    s = tg.interleaved_starts(starts) if paired else starts
    first = tg.first_visible(s, torch.tensor(window, device="cuda")).int()
    N, H, D = first.numel(), 3 if paired else 6, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(N, H, D, device="cuda", generator=gen).bfloat16() * sc for sc in (0.12, 1, 1, 1))
    mask = tg.block_attention_mask(first)
    flex = torch.compile(flex_attention, dynamic=False)
    leaves = [t.detach()[None].transpose(1, 2).requires_grad_() for t in (q, k, v)]
    g_flex = g[None].transpose(1, 2)

    def flex_fwd():
        return flex(*leaves, block_mask=mask, scale=1.0, kernel_options=dict(tg.FLEX_HOPPER_TILES))

    def flex_both():
        return torch.autograd.grad(flex_fwd(), leaves, g_flex)

    want = [t.transpose(1, 2)[0] for t in (flex_fwd(), *flex_both())]
    t_flex, t_flex_both = timed(flex_fwd, reps), timed(flex_both, reps)
    default = dict(zip(("fwd", "dq", "dkdv"), tg.ATTN_HOPPER_TILES))
    best = dict(default)
    for name, candidates in CANDIDATES.items():
        fastest = None
        for tile in candidates:
            tiles = dict(default, **{name: tile})
            try:
                t = timed(lambda: ours(q, k, v, g, first, tiles, backward=name != "fwd"), reps)
            except Exception as e:  # a tile whose shared memory does not fit this GPU
                lines.append(f"{kind} {name} {tile}: {type(e).__name__}")
                continue
            lines.append(f"{kind} {name} {tile}: {t:.3f} ms" + ("" if name == "fwd" else " (with the forward)"))
            if fastest is None or t < fastest[0]:
                fastest = (t, tile)
        best[name] = fastest[1]
    got = [*ours(q, k, v, g, first, best, backward=False), *ours(q, k, v, g, first, best, backward=True)]
    errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, want)]
    t_ours = timed(lambda: ours(q, k, v, g, first, best, backward=False), reps)
    t_ours_both = timed(lambda: ours(q, k, v, g, first, best, backward=True), reps)
    lines.append(f"== {kind}: N {N} H {H} window {window}: Flex forward {t_flex:.3f} ms, with backward "
                 f"{t_flex_both:.3f} | ours {t_ours:.3f}, {t_ours_both:.3f} (x{t_ours_both / t_flex_both:.3f}) | "
                 f"fastest tiles {best['fwd']} {best['dq']} {best['dkdv']} | from Flex: out, dq, dk, dv "
                 + " ".join(f"{e:.4f}" for e in errs))
    print(lines[-1], flush=True)
    return t_flex, t_flex_both, t_ours, t_ours_both


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shard", help="a token shard (.bin) whose first 65,536 tokens make the pass")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for attnbench.txt")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: attnbench times GPU kernels: it needs CUDA")
    tokens = torch.from_numpy(tg.load_shard(args.shard)[:4 * 16384].astype(np.int64))
    starts = tg.document_starts(tokens.view(4, 16384).cuda())
    lines, totals, start = [], np.zeros(4), time.time()
    for kind, (_, _, layers) in KINDS.items():
        totals += layers * np.array(bench_kind(kind, starts, args.reps, lines))
    lines.append(f"a stage-3 step ({PASSES} passes of 10 layers): Flex {PASSES * totals[0]:.1f} ms forward, "
                 f"{PASSES * totals[1]:.1f} with backward; ours {PASSES * totals[2]:.1f}, {PASSES * totals[3]:.1f} "
                 f"({time.time() - start:.0f} s)")
    print(lines[-1])
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "attnbench.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
