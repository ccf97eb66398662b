"""Time the default recipe's train steps stage by stage and project its 1600-step training time: the default's
flags on the proxy shards, compiled and warmed up as train_gpt.py does, then at each batch stage and in the
extension N steps with that stage's real schedule (batch, windows, YaRN, multi-token weights, Adam's every
second step, the embedding tied or untied), each synchronized and timed, and two more profiled. Prints each
stage's median and the projection, sum over stages of (its steps in the run x its median); appends them to
OUT/stagebench.txt and writes OUT/NAME_<stage>_profile.txt, and the warm-up's compile time by phase to
OUT/NAME_compile_times.txt.

    python records/bench/stagebench.py --out DIR --name NAME [--script train_gpt.py] [--n 20]
        [--mlp_tiles JSON] [-- FLAGS...]

--script times another version of the trainer (e.g. `git show COMMIT:train_gpt.py > old.py`): the bench uses
only names every version since 2026-12-04 has. --mlp_tiles sets KernelSettings.mlp_tiles (the fused ReLU^2
matmul's forward and backward launches, as mlpbench.py --write saves them) before the warm-up. Run one bench per
process, one process on the GPU at a time.
"""
import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo.utils

REPO = Path(__file__).resolve().parents[2]
STAGE_OFFSET = 200  # timed steps start this far into a stage: away from its first step


def load_trainer(script: str):
    spec = importlib.util.spec_from_file_location("train_gpt", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module
    spec.loader.exec_module(module)
    return module


def stages(tg, cfg) -> list:
    """(name, steps of the run in it, first timed step) per batch stage and the extension."""
    S, parts = tg.scheduled_steps(cfg), len(cfg.batch_seqs)
    out = []
    for k in range(parts):
        steps = [s for s in range(S) if tg.part(s, parts, cfg) == k]
        out.append((f"stage{k + 1}", len(steps), steps[0] + min(STAGE_OFFSET, len(steps) // 3)))
    if cfg.num_steps > S:
        out.append(("extension", cfg.num_steps - S, S + min(10, (cfg.num_steps - S) // 4)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--script", default=str(REPO / "train_gpt.py"))
    parser.add_argument("--data", default="/tmp/proxy", help="folder of the unpacked proxy shards")
    parser.add_argument("--n", type=int, default=20, help="timed steps per stage")
    parser.add_argument("--mlp_tiles", help="JSON: the fused ReLU^2 matmul's (forward, backward) launches")
    args, extra = parser.parse_known_args(argv)
    tg = load_trainer(args.script)
    flags = ["--train_files", f"{args.data}/proxy_train_*.bin", "--val_files", f"{args.data}/proxy_val_*.bin",
             "--val_tokens", "1572864", "--val_every", "0", "--warmup_steps", "3", "--log_dir", args.out,
             "--run_id", args.name, *[f for f in extra if f != "--"]]
    t = tg.build(tg.parse_args(flags))
    if args.mlp_tiles:  # the model's MLPs read the trainer's KernelSettings at each call
        t.kernels.mlp_tiles = tuple(tuple(tile) for tile in json.loads(args.mlp_tiles))
    cuda = t.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # CPU: the suite runs it on a tiny model
    # the bench's steps start from fresh weights at late steps, whose loss stays near a uniform guess's: not
    # the diverged run that the not-learning check stops
    t.learning_by_step = float("inf")
    started = time.perf_counter()
    tg.warm_up(t)
    warm_s = time.perf_counter() - started
    # where the warm-up's compile time went, by phase (tracing, AOT autograd, inductor's lowering, codegen, ...)
    (Path(args.out) / f"{args.name}_compile_times.txt").write_text(
        torch._dynamo.utils.compile_times(repr="str", aggregate=True) + "\n")
    t.clock.start()
    rows, n = [], args.n
    for name, count, first in stages(tg, t.cfg):
        if t.opt.tied and first > tg.split_step(t.cfg):
            t.opt.untie()
        prof = (first + n, first + n + 1)
        t.cfg = dataclasses.replace(t.cfg, profile_steps=prof)
        t.run_id = f"{args.name}_{name}"
        times = []
        for step in range(first, first + n + 2):
            sync()
            t0 = time.perf_counter()
            with tg.profiled(t, step):
                tg.train_step(t, step)
            sync()
            if step < prof[0]:
                times.append((time.perf_counter() - t0) * 1000)
        rows.append((name, count, tg.batch_seqs_at(first, t.cfg), first, statistics.median(times),
                     statistics.mean(times), min(times)))
        print(f"{name}: steps {first}..{first + n - 1}, median {rows[-1][4]:.1f} ms", flush=True)
    projected = sum(count * median for _, count, _, _, median, _, _ in rows) / 1000
    where = f"{torch.cuda.get_device_name()}, peak {torch.cuda.max_memory_allocated() // 2**20} MiB" if cuda else "CPU"
    lines = [f"{args.name}: {Path(args.script).name}, {where}, warm-up {warm_s:.1f} s, {n} timed steps per stage; "
             f"projected {t.cfg.num_steps}-step training time {projected:.1f} s"]
    lines += [f"  {name:<10} {count:5d} steps x {batch:2d} seqs  median {median:7.1f} ms  mean {mean:7.1f}  min "
              f"{low:7.1f}  (steps {first}..{first + n - 1})" for name, count, batch, first, median, mean, low in rows]
    print("\n".join(lines), flush=True)
    with open(Path(args.out) / "stagebench.txt", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
