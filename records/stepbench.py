"""Time train steps A..B of the one-GPU proxy bench without running the whole bench: the same shards, flags
and windows as records/seeds.sh, compiled and warmed up as train_gpt.py does, then each step synchronized
and timed; optionally a profile of two steps. About a minute per variant, so one device call compares
several. Writes its log (with the source) and profile to --out. Used by the records 2026-12-03_speed-h200
(before the step's kernel tally and the not-learning switch-off were added), 2026-12-03_speed2-h200 and
2026-12-03_speed3-h200.

    python records/stepbench.py --out DIR --name NAME [--script train_gpt.py]
        [--steps 21,45] [--profile 30,31] [--gaps 33] [--set NAME=VALUE] [-- TRAIN_GPT_FLAGS...]
"""
import argparse
import ast
import collections
import contextlib
import importlib.util
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def trace(out: str, name: str):
    """Host and device activity of one step: the GPU's idle gaps over 50 us, largest first, each with the
    kernels around it and the host calls that ran during it; and the host calls that took longest."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    with prof:
        yield
    try:
        summarize_trace(prof, out, name)
    except Exception as e:  # a diagnostic: never the end of the bench
        print(f"trace summary failed: {type(e).__name__}: {e}", flush=True)


def summarize_trace(prof, out: str, name: str):
    from torch.autograd import DeviceType
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 50:
            during = sorted({e.name for e in host if e.time_range.start < b.time_range.start
                             and e.time_range.end > a.time_range.end and e.cpu_parent is None})
            gaps.append((gap, a.name[:60], b.name[:60], during[:6]))
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(k.time_range.end - k.time_range.start for k in kernels)
    lines = [f"{name}: {len(kernels)} kernels, {span / 1000:.1f} ms from first to last, {busy / 1000:.1f} ms busy; "
             f"{len(gaps)} gaps > 50 us, {sum(g[0] for g in gaps) / 1000:.1f} ms in all"]
    lines += [f"{g / 1000:7.2f} ms after {a} before {b}; host: {', '.join(d)}" for g, a, b, d in sorted(gaps)[::-1][:30]]
    count, ms = collections.Counter(), collections.Counter()
    for k in kernels:
        count[k.name[:90]] += 1
        ms[k.name[:90]] += (k.time_range.end - k.time_range.start) / 1000
    lines += ["", "kernels by count: count, ms in all, name"]
    lines += [f"{n:6d} {ms[name]:8.2f}  {name}" for name, n in count.most_common(40)]
    lines += ["", "kernels by time: count, ms in all, name (every kernel over 0.2 ms in the step)"]
    lines += [f"{count[name]:6d} {t:8.2f}  {name}" for name, t in ms.most_common() if t > 0.2]
    lines += ["", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    (Path(out) / f"{name}_gaps.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]), flush=True)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--script", default=str(REPO / "train_gpt.py"))
    parser.add_argument("--data", default="/tmp/proxy")
    parser.add_argument("--steps", default="21,45")
    parser.add_argument("--profile", default="")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a module constant of the script, e.g. CE_TILES=(64,128,8)")
    parser.add_argument("--gaps", type=int, default=-1, help="a step to trace with host and device activity: "
                        "where the GPU waits, and on what")
    args, extra = parser.parse_known_args()
    spec = importlib.util.spec_from_file_location("bench_train_gpt", args.script)
    tg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tg)
    # the bench's steps start from the initial weights, whose zero head gives exactly ln(vocab) at any step:
    # not the diverged run that the check at LEARNING_BY_STEP is there to stop
    tg.LEARNING_BY_STEP = float("inf")
    for assignment in args.set:
        name, value = assignment.split("=", 1)
        setattr(tg, name, ast.literal_eval(value))
    first, last = map(int, args.steps.split(","))
    prof_first, prof_last = map(int, args.profile.split(",")) if args.profile else (-1, -1)
    flags = ["--train_files", f"{args.data}/proxy_train_*.bin", "--val_files", f"{args.data}/proxy_val_*.bin",
             "--val_tokens", "1572864", "--num_steps", "125", "--val_every", "0", "--warmup_steps", "3",
             "--log_dir", args.out, "--run_id", args.name, *(["--profile_steps", args.profile] if args.profile else []),
             *[f for f in extra if f != "--"]]
    t = tg.build(tg.parse_args(flags))
    tg.warm_up(t)
    t.train_loader.load_state({"shard": 0, "pos": 0})
    t.clock.start()
    times = []
    for step in range(first, last + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with tg.profiled(t, step), (trace(args.out, args.name) if step == args.gaps else contextlib.nullcontext()):
            loss = tg.train_step(t, step)
        torch.cuda.synchronize()
        if not prof_first <= step <= prof_last:  # the profiler slows the steps it records
            times.append((time.perf_counter() - t0) * 1000)
    print("step ms:", " ".join(f"{ms:.0f}" for ms in times))
    warm = next((l for l in t.log_path.read_text().splitlines() if l.startswith("warmup_steps:")), "")
    line = (f"{args.name}: median {statistics.median(times):.1f} ms/step, mean {statistics.mean(times):.1f}, min "
            f"{min(times):.1f} over steps {first}..{last} (unprofiled: {len(times)}); last train loss {loss:.3f}; "
            f"{warm}; peak {torch.cuda.max_memory_allocated() // 2**20} MiB")
    print(line, flush=True)
    with open(Path(args.out) / "stepbench.txt", "a") as f:
        f.write(line + "\n")
