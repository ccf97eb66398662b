"""FlexAttention's work in one training step, counted from the BlockMasks train_gpt.py builds for real sequences:
the matmul FLOPs of the tiles Flex computes (its partial and full blocks) and of the query-key pairs inside the
mask. Divide by a profile's FlexAttention time for Flex's rate. CPU only, about a second at the default.

    python records/bench/flexwork.py SHARD [--step N] [-- TRAIN_GPT_FLAGS]

SHARD: a token shard (.bin, or the proxy's .bin.xz); --step: the step whose batch size and windows count (by
default the first of the last batch stage). Flags after -- set the model as train_gpt.py would.
"""
import argparse
import lzma
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

FWD_MATMULS, BWD_MATMULS = 2, 5  # forward: q k^T, p v; backward: q k^T again, dv, dp, dq, dk


def shard_tokens(path: str) -> torch.Tensor:
    if path.endswith(".xz"):
        raw = lzma.open(path).read()
        return torch.from_numpy(np.frombuffer(raw[tg.HEADER_BYTES:], dtype="<u2").astype(np.int64))
    return torch.from_numpy(tg.load_shard(path).astype(np.int64))


def flex_work(cfg, seqs: torch.Tensor, step: int) -> dict:
    """Forward FLOPs of step's attention over seqs (one row per micro-batch sequence): 'computed' in the tiles
    Flex runs, 'inside' in the pairs the mask lets through. Paired-head layers attend with half the heads over a
    twice-as-long sequence."""
    short, long = tg.windows_at(step, cfg)
    work = {"computed": 0, "inside": 0}
    for seq in seqs:
        starts = tg.document_starts(seq[None])
        for i in range(cfg.num_layers):
            if i in cfg.no_attn_layers:
                continue
            paired = i in cfg.paired_head_layers
            window = (long if i in cfg.long_window_layers else short) * tg.MASK_BLOCK
            first = tg.first_visible(tg.interleaved_starts(starts) if paired else starts, torch.tensor(window))
            mask = tg.block_attention_mask(first)
            tiles = (mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item()
            pairs = (torch.arange(first.numel()) - first + 1).sum().item()
            per_pair = 2 * FWD_MATMULS * cfg.head_dim * (cfg.num_heads // 2 if paired else cfg.num_heads)
            work["computed"] += per_pair * tiles * tg.MASK_BLOCK ** 2
            work["inside"] += per_pair * pairs
    return work


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shard")
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(ours)
    cfg = tg.parse_args(flags)
    step = tg.stage_starts(len(cfg.batch_seqs), cfg)[-1] if args.step is None else args.step
    n, T = tg.batch_seqs_at(step, cfg), cfg.seq_len
    tokens = shard_tokens(args.shard)
    if tokens.numel() < n * T:
        raise SystemExit(f"{args.shard} holds {tokens.numel():,} tokens, fewer than step {step}'s {n} x {T:,}")
    work = flex_work(cfg, tokens[:n * T].view(n, T), step)
    total = (FWD_MATMULS + BWD_MATMULS) / FWD_MATMULS
    print(f"step {step}: {n} sequences of {T:,} tokens, windows {tg.windows_at(step, cfg)} blocks of "
          f"{tg.MASK_BLOCK}")
    print(f"forward TFLOP: {work['computed'] / 1e12:.2f} in computed tiles, {work['inside'] / 1e12:.2f} inside "
          f"the mask")
    print(f"forward + backward TFLOP: {total * work['computed'] / 1e12:.2f} computed, "
          f"{total * work['inside'] / 1e12:.2f} inside the mask")


if __name__ == "__main__":
    main()
