"""Microbenchmarks of the pieces of a train step on one GPU, at the training shapes (49,152 tokens x 50,304
vocab for the head; 49,152 x 6 heads x 128 for attention). Seconds each, so one device call can try several
variants before a full run. Prints one table row per variant.

    python records/2026-12-03_speed-h200/bench_pieces.py [--old .gpu/old_train_gpt.py] [--docs SHARD] [ce] [flex]

--old: an earlier train_gpt.py whose softcap_ce_grad is timed as the baseline. --docs: a shard whose first
49,152 tokens give the document layout of the attention masks (real documents, as in training).
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

T, V = 49152, 50304


def median_ms(fn) -> float:
    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("old_train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ce(old_path: str):
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(T, V, device="cuda", generator=gen) * 8).bfloat16()
    targets = torch.randint(0, 50257, (T,), device="cuda", generator=gen)
    big = torch.empty(2 * T * V, device="cuda", dtype=torch.uint8)
    copy_ms = median_ms(lambda: big[T * V:].copy_(big[:T * V]))
    print(f"device copy of {T * V / 1e9:.2f} GB: {copy_ms:.3f} ms = {2 * T * V / copy_ms / 1e6:.0f} GB/s (read+write)")
    ref = None
    if old_path:
        old = load_module(old_path)
        ref = old.softcap_ce_grad(z, targets, tg.HEAD_GRAD_SCALE)
        print(f"old kernel + torch transpose: {median_ms(lambda: old.softcap_ce_grad(z, targets, tg.HEAD_GRAD_SCALE)):.3f} ms")
    nbytes = 2 * T * V * 2 + 3 * T * V  # z read twice (bf16); the fp8 grad written, read and written transposed
    print(f"{'variant':<34} {'ms':>7} {'GB/s':>6}  g_t==g.T  g vs old (frac differ)  loss vs old")
    variants = [((32, 128, 4), tt) for tt in [(64, 128), (128, 128), (64, 64), (128, 64)]]
    variants += [((64, 128, 8), (64, 128)), ((32, 128, 8), (64, 128))]
    for tiles, t_tiles in variants:
        tg.CE_TILES, tg.TRANSPOSE_TILE = tiles, t_tiles
        name = f"CE {tiles} + transpose {t_tiles}"
        try:
            loss, g, g_t = tg.softcap_ce_grad(z, targets, tg.HEAD_GRAD_SCALE)
            exact_t = torch.equal(g_t.view(torch.uint8), g.view(torch.uint8).T)
            vs_old = (g.view(torch.uint8) != ref[1].view(torch.uint8)).float().mean().item() if ref else float("nan")
            loss_d = (loss - ref[0]).abs().max().item() if ref else float("nan")
            del loss, g, g_t
            ms = median_ms(lambda: tg.softcap_ce_grad(z, targets, tg.HEAD_GRAD_SCALE))
            print(f"{name:<34} {ms:7.3f} {nbytes / ms / 1e6:6.0f}  {exact_t!s:8}  {vs_old:.2e}               "
                  f"{loss_d:.2e}", flush=True)
        except Exception as e:  # a tile that does not fit is a row, not the end of the bench
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
    g = torch.empty(T, V, device="cuda", dtype=torch.uint8)
    for tile in [(64, 128), (128, 128)]:
        tg.TRANSPOSE_TILE = tile
        ms = median_ms(lambda: tg.transposed(g))
        print(f"transpose alone {tile}: {ms:.3f} ms = {2 * T * V / ms / 1e6:.0f} GB/s", flush=True)


def flex(docs_path: str):
    if docs_path:
        tokens = torch.from_numpy(tg.load_shard(docs_path)[:T].astype(np.int64)).cuda()
    else:
        tokens = torch.randint(0, 50000, (T,), device="cuda")
        tokens[::700] = tg.BOS_ID
    starts = tg.document_starts(tokens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 6, T, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, 6, T, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    # (long, short) windows in blocks at steps 33 and 100 of the 125-step proxy bench
    masks = {w: (tg.attention_mask(starts, torch.tensor(w, device="cuda")),
                 tg.attention_mask(starts, torch.tensor(max(1, w // 2), device="cuda"))) for w in (4, 11)}
    variants = {
        "default": None,
        "tma": {"USE_TMA": True},
        "fwd 128x128 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
        "bwd 64x64 w4 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                            "bwd_num_warps": 4, "bwd_num_stages": 3},
        "bwd 32/128 w8 s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                             "bwd_num_warps": 8, "bwd_num_stages": 3},
    }
    print("flex fwd+bwd per micro-step (3 long-window + 8 short-window layers), ms:")
    print(f"{'variant':<22} {'fwd w=4':>8} {'f+b w=4':>8} {'f+b w=11':>9}")
    for name, opts in variants.items():
        try:
            fn = torch.compile(lambda q, k, v, m: tg.flex_attention(q, k, v, block_mask=m, scale=0.12,
                                                                    kernel_options=opts), dynamic=False)
            row = []
            for w, with_bwd in [(4, False), (4, True), (11, True)]:
                total = 0.0
                for mask, layers in zip(masks[w], (3, 8)):
                    if with_bwd:
                        step = lambda: torch.autograd.grad(fn(q, k, v, mask), (q, k, v), dout)
                    else:
                        step = lambda: fn(q.detach(), k.detach(), v.detach(), mask)
                    total += layers * median_ms(step)
                row.append(total)
            print(f"{name:<22} {row[0]:8.2f} {row[1]:8.2f} {row[2]:9.2f}", flush=True)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("parts", nargs="*", default=["ce", "flex"])
    parser.add_argument("--old", default="")
    parser.add_argument("--docs", default="")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if "ce" in args.parts:
        ce(args.old)
    if "flex" in args.parts:
        flex(args.docs)
