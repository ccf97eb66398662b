"""FlexAttention's work in one stage-3 training step of the default, from the BlockMasks train_gpt.py builds for
real proxy sequences: the tiles Flex computes (partial and full blocks) and the query-key pairs inside the mask,
as matmul FLOPs. CPU only; divide by a profile's Flex time for its rate.

    python records/2026-12-06_full-main-h100/count_flex_tiles.py ../shared/data/proxy_val_000000.bin.xz
"""
import lzma
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

FWD_MATMULS, BWD_MATMULS = 2, 5  # q k^T and p v; backward: s again, dv, dp, dq, dk


def tokens(path: str) -> torch.Tensor:
    raw = lzma.open(path).read() if path.endswith(".xz") else Path(path).read_bytes()
    return torch.from_numpy(np.frombuffer(raw[tg.HEADER_BYTES:], dtype=np.uint16).astype(np.int64))


def main(path: str):
    cfg = tg.parse_args([])
    step = tg.stage_starts(len(cfg.batch_seqs), cfg)[-1]  # the first step of the last batch stage
    seqs, (short, long) = tg.batch_seqs_at(step, cfg), tg.windows_at(step, cfg)
    toks, T = tokens(path), cfg.seq_len
    assert toks.numel() >= seqs * T, "the shard holds fewer tokens than one stage-3 step"
    layers = [i for i in range(cfg.num_layers) if i not in cfg.no_attn_layers]
    computed = inside = 0
    for s in range(seqs):
        starts = tg.document_starts(toks[s * T:(s + 1) * T][None])
        for i in layers:
            paired, window = i in cfg.paired_head_layers, long if i in cfg.long_window_layers else short
            st = tg.interleaved_starts(starts) if paired else starts
            first = tg.first_visible(st, torch.tensor(window * tg.MASK_BLOCK))
            mask = tg.block_attention_mask(first)
            heads = cfg.num_heads // 2 if paired else cfg.num_heads
            blocks = (mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item()
            pairs = (torch.arange(first.numel()) - first + 1).sum().item()
            computed += 2 * FWD_MATMULS * cfg.head_dim * heads * blocks * tg.MASK_BLOCK ** 2
            inside += 2 * FWD_MATMULS * cfg.head_dim * heads * pairs
    total = (FWD_MATMULS + BWD_MATMULS) / FWD_MATMULS
    print(f"step {step}: {seqs} sequences of {T} tokens, windows {short} / {long} blocks, {len(layers)} attention "
          f"layers")
    print(f"forward TFLOP per step: {computed / 1e12:.2f} in computed tiles, {inside / 1e12:.2f} inside the mask")
    print(f"forward + backward TFLOP per step: {total * computed / 1e12:.2f} computed, {total * inside / 1e12:.2f} "
          f"inside the mask")


if __name__ == "__main__":
    main(sys.argv[1])
