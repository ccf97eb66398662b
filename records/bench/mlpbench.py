"""Time the ReLU^2 MLP's matmuls at one forward pass of the default on one GPU (four 16K sequences: 65,536
tokens, since records/2026-12-06_mb4-h100; dim 768 -> 3072, bf16):

1. each direction's fused ReLU^2 matmul kernel (relu_square_mm) at each launch of TILES against cuBLAS's
   matmul plus inductor's compiled ReLU^2 pass (forward: s = x @ fc_w.T, then relu(s)^2; backward: g @ proj_w.T,
   then 2 relu(pre) times it, where the fused kernel takes 2 sqrt(post));
2. the whole MLP, compiled with the norm before it as in a block, forward + backward: the plain path, the
   default's tiles (MLP_HOPPER_TILES) and the fastest of part 1 per direction.

Prints ms per call (median of --repeats runs of --n calls), the fused outputs' relative distance from
cuBLAS's and whether their bits are those of the default's launch (MLP_HOPPER_TILES); --write FILE saves the
fastest (forward, backward) launch as JSON (for stagebench.py --mlp_tiles); --tiles times other launches.
A launch that does not fit the GPU (shared memory) is reported and skipped. One process on the GPU at a time.

    python records/bench/mlpbench.py [--tokens 65536] [--n 50] [--repeats 5] [--write best.json] [--tiles JSON]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

# tg.MLP_TILE each: rows, columns, depth, warps, stages, store_split, warp_specialize, programs_per_sm
TILES = [(128, 256, 64, 8, 4, 4, 0, 1), (128, 256, 64, 8, 3, 2, 1, 1), (128, 256, 64, 8, 4, 2, 0, 1),
         (128, 256, 64, 8, 3, 2, 0, 1), (128, 256, 64, 8, 4, 4, 1, 1), (128, 256, 64, 8, 3, 4, 1, 1),
         (256, 128, 64, 8, 3, 2, 0, 1), (256, 128, 64, 8, 3, 2, 1, 1), (256, 128, 64, 8, 4, 2, 0, 1),
         (128, 128, 64, 4, 4, 1, 0, 1),
         # two programs per multiprocessor, where two fit in its 228 KiB of shared memory: the pipeline's
         # stages, the output's staging block and (backward) post's
         (128, 128, 64, 4, 3, 2, 0, 2), (128, 128, 64, 4, 3, 2, 1, 2), (128, 128, 64, 4, 2, 2, 0, 2),
         (128, 128, 64, 4, 2, 4, 0, 2), (128, 128, 64, 4, 3, 4, 0, 2), (128, 128, 64, 8, 2, 2, 0, 2),
         (128, 128, 64, 8, 3, 4, 0, 2), (128, 128, 32, 4, 4, 2, 0, 2), (128, 128, 32, 4, 5, 4, 0, 2),
         (64, 256, 64, 4, 2, 4, 0, 2), (128, 128, 64, 4, 2, 2, 1, 2)]


def median_ms(fn, n: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def dist(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernels_part(x2, g2, fc_w, proj_w, tiles, n, repeats):
    """Part 1: {direction: [(tile, ms, distance, same bits as the default's)]} and the cuBLAS + compiled
    reference's ms per direction."""
    relu_sq = torch.compile(lambda s: F.relu(s).square())
    relu_sq_grad = torch.compile(lambda d, p: (2 * F.relu(p.float()) * d.float()).to(d.dtype))
    pre = x2 @ fc_w.T
    post = relu_sq(pre)
    dpre = relu_sq_grad(g2 @ proj_w.T, pre)
    ref = {"forward": (median_ms(lambda: relu_sq(x2 @ fc_w.T), n, repeats), median_ms(lambda: x2 @ fc_w.T, n, repeats)),
           "backward": (median_ms(lambda: relu_sq_grad(g2 @ proj_w.T, pre), n, repeats),
                        median_ms(lambda: g2 @ proj_w.T, n, repeats))}
    calls = {"forward": (lambda tile: tg.relu_square_mm(x2, fc_w, None, tile), post),
             "backward": (lambda tile: tg.relu_square_mm(g2, proj_w, post, tile), dpre)}
    default = {direction: call(tile) for (direction, (call, _)), tile in zip(calls.items(), tg.MLP_HOPPER_TILES)}
    rows = {direction: [] for direction in calls}
    for tile in tiles:
        for direction, (call, want) in calls.items():
            try:
                got = call(tile)
                ms = median_ms(lambda: call(tile), n, repeats)
            except Exception as e:  # a launch that does not fit: shared memory, registers
                print(f"{direction} {tile}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            rows[direction].append((tile, ms, dist(got, want), torch.equal(got, default[direction])))
    return rows, ref


def module_part(tiles_list, n, repeats, tokens):
    """Part 2: ms per compiled forward + backward of MLP(norm(x)) for each mlp_tiles (None: plain)."""
    torch.manual_seed(0)
    x = torch.randn(1, tokens, 768, device="cuda").bfloat16().requires_grad_()
    g = torch.randn(1, tokens, 768, device="cuda").bfloat16()
    kernels = tg.KernelSettings()
    mlp = tg.MLP(768, kernels).cuda()
    with torch.no_grad():
        mlp.proj_w.normal_(0, 0.02)
    out = []
    for tiles in tiles_list:
        kernels.mlp_tiles = tiles
        torch._dynamo.reset()
        f = torch.compile(lambda t: mlp(tg.norm(t)), dynamic=False)
        out.append((tiles, median_ms(lambda: f(x), n, repeats), median_ms(lambda: f(x).backward(g), n, repeats)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", help="save the fastest (forward, backward) launch here, as JSON")
    parser.add_argument("--tiles", help="JSON: the launches to time (MLP_TILE each) instead of TILES")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x2, g2 = (torch.randn(args.tokens, 768, device="cuda", generator=gen).bfloat16() for _ in range(2))
    fc_w, proj_w = ((torch.randn(3072, 768, device="cuda", generator=gen) * 0.03).bfloat16() for _ in range(2))
    tiles = [tuple(t) for t in json.loads(args.tiles)] if args.tiles else TILES
    rows, ref = kernels_part(x2, g2, fc_w, proj_w, tiles, args.n, args.repeats)
    flops = 2 * args.tokens * 3072 * 768
    print(f"{torch.cuda.get_device_name()}, {args.tokens} tokens, median of {args.repeats} x {args.n} calls")
    best = {}
    for direction, found in rows.items():
        both, mm_only = ref[direction]
        print(f"\n{direction}: cuBLAS matmul {mm_only:.4f} ms ({flops / mm_only / 1e9:.0f} TFLOP/s), "
              f"+ compiled ReLU^2 pass: {both:.4f} ms")
        print(f"  {'tile':<34} {'ms':>8} {'TFLOP/s':>8} {'vs cuBLAS + pass':>17} {'distance':>9} "
              f"{'bits of the default':>20}")
        for tile, ms, d, same in sorted(found, key=lambda r: r[1]):
            print(f"  {str(tile):<34} {ms:8.4f} {flops / ms / 1e9:8.0f} {both / ms:16.3f}x {d:9.2e} "
                  f"{'same' if same else 'differ':>20}")
        best[direction] = min(found, key=lambda r: r[1])[0]
    chosen = (best["forward"], best["backward"])
    print(f"\nfastest: forward {chosen[0]}, backward {chosen[1]}")
    if args.write:
        Path(args.write).write_text(json.dumps(chosen))
    print("\nthe MLP compiled with its norm, forward and forward + backward (ms):")
    for tiles, fwd, both in module_part([None, tg.MLP_HOPPER_TILES, chosen], args.n, args.repeats, args.tokens):
        print(f"  {str(tiles) if tiles else 'plain (cuBLAS + inductor)':<70} {fwd:8.4f} {both:8.4f}")


if __name__ == "__main__":
    main()
