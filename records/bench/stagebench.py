"""Time the default recipe's train steps stage by stage and project its whole training time: the default's
flags on the proxy shards, compiled and warmed up as train_gpt.py does, then at each batch stage and in the
extension N steps with that stage's real schedule (batch, windows, YaRN, multi-token weights, Adam's every
second step, the embedding tied or untied), each synchronized and timed, and two more profiled. Prints each
stage's median, peak memory and allocator retries (if any), the warm-up's peak, and the projection, sum over
stages of (its steps in the run x its median); appends them to OUT/stagebench.txt and writes
OUT/NAME_<stage>_profile.txt, and the warm-up's compile time by phase to OUT/NAME_compile_times.txt, where the
warm-up's host time went (sampled stacks) to OUT/NAME_warmup_host.txt, and each hand-written Triton kernel's
compile (thread, seconds) to OUT/NAME_kernel_compiles.txt.

    python records/bench/stagebench.py --out DIR --name NAME [--script train_gpt.py] [--n 20]
        [--mlp_tiles JSON] [--warm_only] [--inductor KEY=VALUE ...] [-- FLAGS...]

--script times another version of the trainer (e.g. `git show COMMIT:train_gpt.py > old.py`): the bench uses
only names every version since 2026-12-04 has. --mlp_tiles sets KernelSettings.mlp_tiles (the fused ReLU^2
matmul's forward and backward launches, as mlpbench.py --write saves them) before the warm-up. Run one bench per
process, one process on the GPU at a time. --warm_only stops after the warm-up (to time compiles: give the
process fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR folders for a cold one); --inductor sets
torch._inductor.config.KEY (dots for its sub-configs) to a Python literal first.
"""
import argparse
import ast
import collections
import dataclasses
import importlib.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch._dynamo.utils
import torch._inductor.config

REPO = Path(__file__).resolve().parents[2]
STAGE_OFFSET = 200  # timed steps start this far into a stage: away from its first step


def load_trainer(script: str):
    spec = importlib.util.spec_from_file_location("train_gpt", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module
    spec.loader.exec_module(module)
    return module


class StackSampler:
    """Where the process's wall time goes, sampled: every `every` seconds a second thread reads each other
    thread's Python stack (the autograd engine runs backward, and compiles it, on a thread of its own). A sample
    weighs the wall time since the last one (a C call that holds the GIL delays the sample and lands in it); a
    function's cumulative time is the weight of the samples with it anywhere on a thread's stack. Names are
    cached per code object: the sampler must not slow what it measures."""

    def __init__(self, every: float = 0.02):
        self.every, self.names = every, {}
        self.cumulative, self.leaf = collections.Counter(), collections.Counter()
        self.total, self._stop = 0.0, threading.Event()

    def _name(self, code) -> str:
        name = self.names.get(code)
        if name is None:
            name = self.names[code] = f"{'/'.join(Path(code.co_filename).parts[-2:])}:{code.co_name}"
        return name

    def _run(self):
        me, last = threading.get_ident(), time.perf_counter()
        while not self._stop.wait(self.every):
            now = time.perf_counter()
            weight, last = now - last, now
            for thread, frame in sys._current_frames().items():
                if thread == me:
                    continue
                seen = set()
                self.leaf[self._name(frame.f_code)] += weight
                while frame is not None:
                    seen.add(self._name(frame.f_code))
                    frame = frame.f_back
                for name in seen:
                    self.cumulative[name] += weight
            self.total += weight

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def report(self, share: float = 0.005) -> str:
        """Every function with at least `share` of the sampled time, cumulative (all threads) and innermost. A
        thread that waits (the main thread while the engine's thread runs backward) counts too: read the tree."""
        at_least = share * self.total
        lines = [f"{self.total:.1f} s sampled; cumulative (anywhere on a thread's stack) and leaf (innermost) s"]
        lines += [f"  cum {s:7.2f}  {name}" for name, s in self.cumulative.most_common() if s >= at_least]
        lines += [f"  leaf {s:6.2f}  {name}" for name, s in self.leaf.most_common() if s >= at_least]
        return "\n".join(lines) + "\n"


class KernelCompiles:
    """Each compile of a hand-written @triton.jit kernel, at its first launch (Inductor builds its own kernels
    another way): the thread it ran on, the kernel, the seconds. Where no triton is installed, none."""

    def __init__(self):
        self.done, self.jit = [], None

    def __enter__(self):
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return self
        self.jit, original, done = JITFunction, JITFunction._do_compile, self.done

        def timed(fn, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(fn, *args, **kwargs)
            finally:
                done.append((threading.current_thread().name, fn.__name__, time.perf_counter() - start))
        self.original, JITFunction._do_compile = original, timed
        return self

    def __exit__(self, *exc):
        if self.jit is not None:
            self.jit._do_compile = self.original

    def summary(self) -> str:
        """Per thread: how many kernels compiled there, and their seconds."""
        by = collections.defaultdict(list)
        for thread, _, seconds in self.done:
            by[thread].append(seconds)
        return ", ".join(f"{thread} {len(s)} ({sum(s):.1f} s)" for thread, s in sorted(by.items())) or "none"

    def report(self) -> str:
        return "".join(f"{thread:<20} {seconds:6.2f} s  {kernel}\n" for thread, kernel, seconds in self.done)


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


def retries_now(cuda: bool) -> int:
    """The caching allocator's retries so far (it ran out, freed its cache and asked again, waiting for the GPU
    each time): where a stage has any, its times hold those waits (a capped GPU's, e.g. capped.py's). Read here,
    not by train_gpt.alloc_retries: --script may time a version that has no such function."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--script", default=str(REPO / "train_gpt.py"))
    parser.add_argument("--data", default="/tmp/proxy", help="folder of the unpacked proxy shards")
    parser.add_argument("--n", type=int, default=20, help="timed steps per stage")
    parser.add_argument("--mlp_tiles", help="JSON: the fused ReLU^2 matmul's (forward, backward) launches")
    parser.add_argument("--warm_only", action="store_true", help="stop after the warm-up")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="set torch._inductor.config.KEY to VALUE (a Python literal) before compiling")
    args, extra = parser.parse_known_args(argv)
    settings = []
    for setting in args.inductor:
        key, _, value = setting.partition("=")
        *outer, last = key.split(".")
        config = torch._inductor.config
        try:
            for part in outer:
                config = getattr(config, part)
            getattr(config, last)  # an unknown key fails here, not silently
            setattr(config, last, ast.literal_eval(value))
        except (AttributeError, ValueError, SyntaxError) as e:
            parser.error(f"--inductor {setting}: {type(e).__name__}: {e}")
        settings.append(f"{key}={getattr(config, last)!r}")  # as the config holds it
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
    with StackSampler() as sampler, KernelCompiles() as compiles:
        tg.warm_up(t)
    warm_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    warm_peak = peak()  # the warm-up also holds its snapshot of the weights and states
    described = " ".join(settings + extra)  # what this bench ran with, on each line it appends
    (Path(args.out) / f"{args.name}_warmup_host.txt").write_text(sampler.report())
    (Path(args.out) / f"{args.name}_kernel_compiles.txt").write_text(compiles.report())
    # where the warm-up's compile time went, by phase (tracing, AOT autograd, inductor's lowering, codegen, ...)
    (Path(args.out) / f"{args.name}_compile_times.txt").write_text(
        torch._dynamo.utils.compile_times(repr="str", aggregate=True) + "\n")
    if args.warm_only:
        line = (f"{args.name}: {Path(args.script).name}, warm-up {warm_s:.1f} s (kernels compiled at first launch: "
                f"{compiles.summary()}), " + (f"peak {warm_peak // 2**20} MiB, " if cuda else "") + described)
        print(line, flush=True)
        with open(Path(args.out) / "warmups.txt", "a") as f:
            f.write(line + "\n")
        return
    t.clock.start()
    rows, n = [], args.n
    for name, count, first in stages(tg, t.cfg):
        if t.opt.tied and first > tg.split_step(t.cfg):
            t.opt.untie()
        prof = (first + n, first + n + 1)
        t.cfg = dataclasses.replace(t.cfg, profile_steps=prof)
        t.run_id = f"{args.name}_{name}"
        times, retries = [], retries_now(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(first, first + n + 2):
            sync()
            t0 = time.perf_counter()
            with tg.profiled(t, step):
                tg.train_step(t, step)
            sync()
            if step < prof[0]:
                times.append((time.perf_counter() - t0) * 1000)
        rows.append((name, count, tg.batch_seqs_at(first, t.cfg), first, statistics.median(times),
                     statistics.mean(times), min(times), retries_now(cuda) - retries, peak()))
        print(f"{name}: steps {first}..{first + n - 1}, median {rows[-1][4]:.1f} ms", flush=True)
    projected = sum(count * median for _, count, _, _, median, *_ in rows) / 1000
    highest = max([warm_peak] + [row[-1] for row in rows])
    where = (f"{torch.cuda.get_device_name()}, peak {highest // 2**20} MiB (warm-up {warm_peak // 2**20})" if cuda
             else "CPU")
    lines = [f"{args.name}: {Path(args.script).name}, {where}, warm-up {warm_s:.1f} s, {n} timed steps per stage; "
             f"projected {t.cfg.num_steps}-step training time {projected:.1f} s; {described}"]
    lines += [f"  {name:<10} {count:5d} steps x {batch:2d} seqs  median {median:7.1f} ms  mean {mean:7.1f}  min "
              f"{low:7.1f}  (steps {first}..{first + n - 1})" + (f"  peak {high // 2**20} MiB" if cuda else "")
              + (f"  allocator retries {retried}" if retried else "")
              for name, count, batch, first, median, mean, low, retried, high in rows]
    print("\n".join(lines), flush=True)
    with open(Path(args.out) / "stagebench.txt", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
