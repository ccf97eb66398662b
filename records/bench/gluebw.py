"""How close the compiled glue runs to the GPU's memory bandwidth: the measured bound of a profile's "Triton
fused (compiled)" category. Each kernel Inductor generated for the training step is timed alone, on inputs of
its shapes, with the bytes Inductor counts it moving; a stage profile's launches per step of that kernel
then give its bytes per step (a profile written before the trainer counted launches: its time per step over
its time alone gives the calls). Prints each kernel's rate against a device copy's, its time per launch in
the run over its time alone (near 1 where the harness ran the run's shapes), and the glue's time per step at
the copy's rate: the category's bound.

One GPU, two steps (the first compiles into a fresh cache with a harness in each kernel's module, get_args()
and call(), and profiles as the stage bench always does):

    TORCHINDUCTOR_CACHE_DIR=DIR/inductor python records/bench/stagebench.py --out DIR --name glue \\
        --inductor benchmark_kernel=True
    python records/bench/gluebw.py DIR/inductor DIR/glue_stage3_profile.txt > DIR/gluebw.txt

A kernel's name is per compiled graph: where the forward's and the backward's graphs both have one, the
profile adds them up and the modules' mean rate is used (marked *).
"""
import argparse
import importlib.util
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

GLUE = "Triton fused (compiled)"  # the profile's category of Inductor's own kernels
NUM_GB = re.compile(r"num_gb = ([\d.][\d.eE+-]*)")  # the harness's bytes moved per call, as Inductor counts them


def find_kernels(cache: Path) -> dict:
    """{kernel name: [module paths]} of the generated kernel modules that carry the benchmark harness, one path
    per distinct source. A graph's own module holds its kernels' sources as strings (async_compile.triton):
    not a kernel module."""
    found, seen = {}, set()
    for path in sorted(cache.rglob("*.py")):
        text = path.read_text(errors="replace")
        name = re.search(r"^def (triton_\w+)\(", text, re.M)
        if (name and text.count("def get_args():") == 1 and NUM_GB.search(text)
                and "async_compile" not in text and text.strip() not in seen):
            seen.add(text.strip())
            found.setdefault(name.group(1), []).append(path)
    return found


def module_gb(path: Path) -> float:
    return float(NUM_GB.search(path.read_text()).group(1))


def read_profile(path: Path) -> tuple[dict, dict, dict]:
    """A profile file's ({category: ms per step}, {kernel name: ms per step}, {kernel name: launches per step})
    (train_gpt.profiled's format; profiles written before it counted launches give an empty third)."""
    text = path.read_text()
    categories = {name: float(ms) for name, ms in re.findall(r"^([A-Za-z][^:\n]*?)\s+([\d.]+) ms$", text, re.M)}
    listed = re.split(r"^costliest kernels \(ms per step.*\):$", text, flags=re.M)[1]
    kernels, launches = {}, {}
    for ms, n, name in re.findall(r"^\s*([\d.]+)(?: +([\d.]+))?  (\S.*)$", listed, re.M):
        kernels[name] = kernels.get(name, 0.0) + float(ms)  # names the profile cut at 150 characters add up
        if n:
            launches[name] = launches.get(name, 0.0) + float(n)
    return categories, kernels, launches


def time_ms(fn) -> float:
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    import time
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def copy_gbps() -> float:
    """A device copy's rate, bytes read plus written: what a pointwise kernel can at best reach (1 GiB on a GPU;
    a small copy on CPU, where only the tests run it)."""
    cuda = torch.cuda.is_available()
    x = torch.empty(2**28 if cuda else 2**20, device="cuda" if cuda else "cpu")
    y = torch.empty_like(x)
    return 2 * x.nbytes / 1e9 / (time_ms(lambda: y.copy_(x)) / 1e3)


def time_alone(paths: list) -> tuple[float, float]:
    """(ms per call, GB per call), averaged over the modules that share a kernel's name."""
    ms, gb = [], []
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"gluebw_{path.stem}_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        args = module.get_args()
        ms.append(time_ms(lambda: module.call(args)))
        gb.append(module_gb(path))
    return sum(ms) / len(ms), sum(gb) / len(gb)


def glue_bound(alone: dict, per_step: dict, glue_ms: float, copy_rate: float, launches: dict = None) -> dict:
    """alone: {name: (ms per call, GB per call)} of the profile's glue kernels found in the cache; per_step:
    {name: ms per step} of the glue kernels the profile lists; glue_ms: the category's whole ms per step;
    launches: {name: launches per step} where the profile counts them. Calls per step are those launches, else
    (ms per step) / (ms alone); GB per step are calls x GB per call; the bound is those bytes at the copy's
    rate, scaled up to the category from the part of it the timed kernels cover. Each row also gives the
    kernel's time per launch in the run over its time alone (None without launches): near 1 where the harness
    ran the run's shapes."""
    launches = launches or {}
    timed = {n: ms for n, ms in per_step.items() if n in alone}
    calls = {n: launches.get(n) or ms / alone[n][0] for n, ms in timed.items()}
    gb = {n: calls[n] * alone[n][1] for n in timed}
    covered = sum(timed.values())
    at_copy = sum(gb.values()) / copy_rate * 1e3
    run_over_alone = {n: timed[n] / launches[n] / alone[n][0] if launches.get(n) else None for n in timed}
    return {"covered_ms": covered, "listed_ms": sum(per_step.values()), "glue_ms": glue_ms,
            "gb_per_step": sum(gb.values()), "rate": sum(gb.values()) / (covered / 1e3) if covered else 0.0,
            "at_copy_ms": at_copy, "bound_ms": at_copy * glue_ms / covered if covered else 0.0,
            "rows": sorted(((ms, n, gb[n] / (ms / 1e3), calls[n], run_over_alone[n]) for n, ms in timed.items()),
                           reverse=True)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", help="the TORCHINDUCTOR_CACHE_DIR the stage bench compiled into")
    parser.add_argument("profile", help="a stage profile of that bench (NAME_stage3_profile.txt)")
    args = parser.parse_args(argv)
    categories, kernels, launches = read_profile(Path(args.profile))
    modules = find_kernels(Path(args.cache))
    glue = {n: ms for n, ms in kernels.items() if tg.kernel_category(n) == GLUE}
    # the profile cuts names at 150 characters: each listed name to the modules of the first kernel it begins
    matched = {name: next((paths for full, paths in modules.items() if full.startswith(name)), None) for name in glue}
    alone, failed = {}, []
    for name, paths in matched.items():
        if paths is None:
            continue
        try:
            alone[name] = time_alone(paths)
            print(f"{alone[name][0]:.4f} ms {alone[name][1]:.4f} GB  {name}", file=sys.stderr, flush=True)
        except Exception as e:  # a harness that cannot run on its random inputs: reported, skipped
            failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    rate = copy_gbps()
    b = glue_bound(alone, glue, categories.get(GLUE, 0.0), rate, launches)
    shared = {name for name, paths in matched.items() if paths is not None and len(paths) > 1}
    print(f"device copy: {rate:.0f} GB/s (read + write); {len(modules)} kernel modules with a harness in "
          f"{args.cache}")
    print(f"glue ({GLUE}): {b['glue_ms']:.2f} ms per step; the profile lists {b['listed_ms']:.2f} ms of it, "
          f"{b['covered_ms']:.2f} ms timed here")
    print(f"timed kernels: {b['gb_per_step']:.1f} GB per step at {b['rate']:.0f} GB/s, "
          f"{b['rate'] / rate:.0%} of the copy's rate; at the copy's rate {b['at_copy_ms']:.2f} ms")
    print(f"bound for the whole category (scaled by coverage): {b['bound_ms']:.2f} ms per step, against "
          f"{b['glue_ms']:.2f} measured")
    source = "the profile's launches" if launches else "ms per step / ms alone"
    print(f"\n  ms/step    GB/s  of copy  calls/step  run/alone  kernel (calls/step: {source})")
    for ms, name, gbps, n, ratio in b["rows"]:
        ratio = "" if ratio is None else f"{ratio:.2f}"
        print(f"{ms:9.2f} {gbps:7.0f} {gbps / rate:8.0%} {n:11.1f} {ratio:>10}  {name}{' *' if name in shared else ''}")
    for line in failed:
        print(f"not timed: {line}")


if __name__ == "__main__":
    main()
