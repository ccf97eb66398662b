"""Time train steps A..B of the recipe bench without running the whole bench: the proxy shards and the
scaled flags of records/bench/recipe.sh's after arm, compiled and warmed up as train_gpt.py does, then each
step synchronized and timed; optionally a profile of two steps and a trace of one. About a minute per variant,
so one device call compares several. Writes its log (with the source), profile and trace to --out.

    python records/bench/stepbench.py --out DIR --name NAME [--steps 80,100] [--profile 90,91] [--gaps 95]
        [--set FIELD=VALUE ...] [-- TRAIN_GPT_FLAGS...]

--set changes a field of train_gpt.KernelSettings (how kernels launch), e.g. --set ce_tiles=(16,512,8). The
default steps lie in the last third (24 micro-batches a step). It imports train_gpt.py's public names only; for
an older script, use the stepbench of its commit (git show COMMIT:records/stepbench.py).
"""
import argparse
import ast
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch


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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train_gpt as tg  # noqa: E402

# the after arm of records/bench/recipe.sh: the record's FineWeb steps scaled by 125/1695
SCALED = ["--num_steps", "118", "--extension_steps", "3", "--momentum_warmup_steps", "22",
          "--momentum_cooldown_steps", "4"]


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--data", default="/tmp/proxy", help="folder of the unpacked proxy shards")
    parser.add_argument("--steps", default="80,100", help="first,last step to time")
    parser.add_argument("--profile", default="", help="A,B: profile these steps (train_gpt's --profile_steps)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a KernelSettings field, e.g. ce_tiles=(16,512,8)")
    parser.add_argument("--gaps", type=int, default=-1, help="a step to trace with host and device activity: "
                        "where the GPU waits, and on what")
    return parser.parse_known_args(argv)


def main(argv=None):
    args, extra = parse(argv)
    first, last = map(int, args.steps.split(","))
    prof_first, prof_last = map(int, args.profile.split(",")) if args.profile else (-1, -1)
    flags = ["--train_files", f"{args.data}/proxy_train_*.bin", "--val_files", f"{args.data}/proxy_val_*.bin",
             "--val_tokens", "1572864", *SCALED, "--val_every", "0", "--warmup_steps", "3", "--log_dir", args.out,
             "--run_id", args.name, *(["--profile_steps", args.profile] if args.profile else []),
             *[f for f in extra if f != "--"]]
    t = tg.build(tg.parse_args(flags))
    for assignment in args.set:  # before the first step: the compiled graphs read the settings when traced
        name, value = assignment.split("=", 1)
        setattr(t.kernels, name, ast.literal_eval(value))
    # the bench's steps start from the initial weights, whose loss stays near a uniform guess's: not the
    # diverged run that the not-learning check is there to stop
    t.learning_by_step = float("inf")
    tg.warm_up(t)
    t.train_loader.load_state({"shard": 0, "doc": 0})
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


if __name__ == "__main__":
    main()
