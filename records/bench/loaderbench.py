"""Host time of a training step's data: train_gpt.host_passes (TrainLoader.next_batch's documents walked,
clipped to the stage's max_doc_len and cut into micro-batches of seq_len + 1 tokens, then each pass's sequences
stacked), the trainer's own code, for each batch stage of the default recipe and each world size asked for.
train_step did this work right after the previous step's one host sync, so the GPU waited for it: in the stage
profiles, a gap before the step's first pinned copy that grows with the stage (records/2026-12-06_launches-h100,
section 4). It now runs before that sync (read_ahead). Pinning and the copy are not timed here (no GPU needed).

    python records/bench/loaderbench.py                          # a FineWeb-like shard, written to a temp folder
    python records/bench/loaderbench.py --train_files 'data/fineweb10B/fineweb_train_*.bin' --world 1,8

The made-up shard has documents of lognormal length (median e^6.3 = 545 tokens, mean about 900), each opened by
<|endoftext|>, as FineWeb's are; the Gutenberg proxy's books are far longer, so they are cut less often.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from data.tokenize_text import write_shard  # noqa: E402


def fineweb_like_shard(path: Path, num_tokens: int, seed: int = 0):
    """A shard in the trainer's format whose documents have lognormal lengths, as web pages do."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.3, 1.0, num_tokens // 400), 20, None).astype(np.int64)
    lengths = lengths[np.cumsum(lengths) <= num_tokens]
    tokens = rng.integers(0, tg.BOS_ID, int(lengths.sum()), dtype=np.uint16)
    tokens[np.cumsum(lengths) - lengths] = tg.BOS_ID
    write_shard(path, tokens)


def time_stage(trainer, step: int, reps: int) -> float:
    """Median ms of host_passes for step's stage, over reps batches read in order (trainer: what host_passes
    reads of a Trainer, on the CPU: nothing is pinned)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tg.host_passes(trainer, step)
        times.append((time.perf_counter() - t0) * 1000)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_files", help="glob of training shards (default: a made-up FineWeb-like shard)")
    parser.add_argument("--world", default="1,8", help="world sizes to time, comma-separated")
    parser.add_argument("--reps", type=int, default=50, help="steps timed per stage and world size")
    parser.add_argument("--shard_tokens", type=int, default=20_000_000, help="size of the made-up shard")
    args = parser.parse_args(argv)
    cfg = tg.parse_args([])
    with tempfile.TemporaryDirectory() as tmp:
        pattern = args.train_files
        if pattern is None:
            fineweb_like_shard(Path(tmp) / "like_train_000001.bin", args.shard_tokens)
            pattern = str(Path(tmp) / "like_train_*.bin")
        print(f"shards {pattern}; seq_len {cfg.seq_len}; median of {args.reps} steps; ms per step on the host")
        for world in [int(w) for w in args.world.split(",")]:
            per_pass = tg.micro_batch(cfg, world)
            trainer = SimpleNamespace(cfg=cfg, micro_batch=per_pass, device=torch.device("cpu"),
                                      train_loader=tg.TrainLoader(pattern, cfg.seq_len, min(cfg.max_doc_len), 0, world))
            for stage, step in enumerate(tg.stage_starts(len(cfg.batch_seqs), cfg), 1):
                num_seqs, max_doc_len = tg.batch_seqs_at(step, cfg), tg.max_doc_len_at(step, cfg)
                mine = len(range(0, num_seqs, world))  # rank 0's sequences
                ms = time_stage(trainer, step, args.reps)
                print(f"world {world}  stage {stage}: {num_seqs:2d} sequences, documents clipped to {max_doc_len:4d}, "
                      f"rank 0 keeps {mine:2d} in passes of {per_pass}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
