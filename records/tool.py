"""The record workflow: read timed logs written by train_gpt.py (or the baseline), summarize, plot, diff.

    python records/tool.py summary records/2026-12-02_proxy-h200        # table, mean +- std, one-sided t-test
    python records/tool.py compare records/A records/B                    # two arms: mean +- std, Welch's t-test
    python records/tool.py plot records/A records/B [-o curve.png]        # val loss vs time and vs step
    python records/tool.py diff LOG [--against train_gpt.py | OTHER_LOG]   # what code produced this log
    python records/tool.py source LOG -o FILE                              # write the script a log embeds
    python records/tool.py bench OURS_LOG BASELINE_LOG                     # tokens/s, MFU, time-to-loss speedup
    python records/tool.py readme                                          # rewrite records/README.md's table

Logs are parsed by `key:value` regex, never by column (train_gpt.log_line writes them). A resumed run's log
(a `resumed_from:` line, then the steps again from the checkpoint on) reads as one run. Statistics take only
runs that trained all their steps: an early-stopped set sits below the target by construction. The t-tests
need scipy and plot needs matplotlib (records/requirements.txt).
"""
import argparse
import difflib
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from train_gpt import (MASK_BLOCK, RESUME_FREE, SOURCE_END, batch_seqs_at, hyperparameters_from,  # noqa: E402
                       windows_at)

RECORDS = REPO / "records"
PAIR = re.compile(r"(\w+):(\S+)")
# records/baseline/train_gpt2.py's fixed GPT-2 small, for its logs whose config does not list the model
BASELINE_MODEL = {"num_layers": 12, "model_dim": 768, "vocab_size": 50304, "seq_len": 1024}
H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100/H200 SXM (datasheet); the H200 here measured ~780


class LogFormatError(ValueError):
    pass


class ToolError(Exception):
    """What the user can fix (a path, a folder without logs, a log that cannot be used): main() prints it as one
    `error:` line and exits 1."""


@dataclass
class Run:
    path: Path
    source: str
    config: dict
    val: list = field(default_factory=list)    # (step, val_loss, train_ms)
    train: list = field(default_factory=list)  # (step, train_loss, train_ms)
    num_steps: int = 0
    extra: dict = field(default_factory=dict)  # peak_memory, warmup_time, ...
    reached_target: int | None = None          # the step of the first val at or below the target
    resumed_at: list = field(default_factory=list)
    error: str = ""
    paused: bool = False                       # ends in --stop_at's stopped_at line: resumable, not finished

    def tokens_through(self, step: int) -> int:
        """Training tokens in the first `step` steps: train_gpt.py's batches grow by a schedule (batch_seqs a
        list); older logs and the baseline's have one batch size."""
        return tokens_through(self.config, step)

    @property
    def final(self):
        return self.val[-1]

    @property
    def status(self) -> str:
        """done (trained all num_steps), diverged (its last val loss not finite, wherever it ended), stopped_early
        (at the target), or incomplete (crashed, cut, error, paused)."""
        if not math.isfinite(self.final[1]):
            return "diverged"
        if self.final[0] == self.num_steps:
            return "done"
        stopped = self.reached_target is not None and not self.error and not self.paused
        return "stopped_early" if stopped else "incomplete"


def tokens_through(cfg: dict, step: int) -> int:
    if isinstance(cfg.get("batch_seqs"), list):
        hp = hyperparameters_from(cfg)
        return sum(batch_seqs_at(s, hp) for s in range(step)) * hp.seq_len
    return step * (cfg.get("tokens_per_step") or cfg["seq_len"] * cfg["batch_seqs"])


def parse_log(path) -> Run:
    text = Path(path).read_text(errors="replace")
    parts = text.split(f"\n{SOURCE_END}\n")
    if len(parts) < 3:
        raise LogFormatError(f"{path}: no embedded source: not a log written by train_gpt.py")
    run = Run(Path(path), parts[0], {})
    for line in parts[2].splitlines():
        if line.startswith("config:"):
            run.config = json.loads(line.split()[0].removeprefix("config:"))
            continue
        if line.startswith("error: "):
            run.error = line.removeprefix("error: ")
            continue
        kv = dict(PAIR.findall(line))
        if "resumed_from" in kv:  # what follows replaces everything logged after the checkpoint
            at = int(kv["step"])
            run.val = [v for v in run.val if v[0] < at]
            run.train = [t for t in run.train if t[0] <= at]
            run.resumed_at.append(at)
            run.error, run.paused = "", False
            if run.reached_target is not None and run.reached_target >= at:
                run.reached_target = None
        elif "stopped_at" in kv:
            run.paused = True
        elif "reached_target" in kv:  # also the older `step:S/N reached_target:X` form
            run.reached_target = int(kv.get("at_step") or kv["step"].split("/")[0])
        elif "step" in kv and "/" in kv["step"]:
            step, run.num_steps = map(int, kv["step"].split("/"))
            ms = float(kv.get("train_time", "nan").removesuffix("ms"))
            if "val_loss" in kv:
                run.val.append((step, float(kv["val_loss"]), ms))
            elif "train_loss" in kv:
                run.train.append((step, float(kv["train_loss"]), ms))
        else:
            run.extra.update(kv)
    if not run.val or not run.config:
        raise LogFormatError(f"{path}: no config line or no val_loss lines: the run did not get going"
                             + (f" ({run.error})" if run.error else ""))
    return run


def looks_like_log(path: Path) -> bool:
    """Whether a file could have been written by train_gpt.py or the baseline (it holds the source separator,
    a config line or step lines): other files in a record folder (bench outputs, tables) are passed over."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return True  # unreadable: say so
    return f"\n{SOURCE_END}\n" in text or re.search(r"^(config:|step:\d+/\d+ )", text, re.M) is not None


def find_logs(paths, descend: bool = True) -> list:
    """The logs among paths: files as given, a folder's logs; a folder with none of its own (a record whose arms
    are subfolders), with descend, its subfolders' logs."""
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise ToolError(f"{p}: no such file or folder")
        if not p.is_dir():
            out.append(p)
            continue
        own = [f for f in sorted(p.glob("*.txt")) if looks_like_log(f)]
        out += own or ([f for f in sorted(p.glob("*/*.txt")) if looks_like_log(f)] if descend else [])
    return out


def load_runs(paths, descend: bool = True) -> tuple[list, list]:
    """(runs, problems): the runs of the logs under paths, and why each log that cannot be read is not one."""
    runs, problems = [], []
    for path in find_logs(paths, descend):
        try:
            runs.append(parse_log(path))
        except (LogFormatError, OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(str(e) if str(path) in str(e) else f"{path}: {e}")
    return runs, problems


def usable_runs(paths) -> list:
    """The runs for a statistic: every log must be readable (a log that cannot be is refused, not skipped), and
    there must be one."""
    runs, problems = load_runs(paths)
    if problems:
        raise ToolError(f"refused: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                        + "; move such logs out of the folder")
    if not runs:
        raise ToolError(f"no logs of train_gpt.py or the baseline in {', '.join(map(str, paths))}")
    return runs


def mean_std(xs):
    xs = np.asarray(xs, dtype=float)  # numpy, so a diverged (NaN) run gives NaN, not an exception
    return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def mean_pm(xs, fmt: str = ".4f", unit: str = "") -> str:
    """'mean+-std' of several values; one value alone, without a spread it does not have."""
    m, sd = mean_std(xs)
    return f"{m:{fmt}}{unit}" + (f"+-{sd:{fmt}}{unit}" if len(xs) > 1 else " (one run)")


def optional(module: str):
    """scipy or matplotlib, the tool's optional extras, or one line saying how to get them."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ToolError(f"this needs {module.split('.')[0]}, which is not installed: pip install -r "
                        f"records/requirements.txt") from None


def t_test(losses, target: float):
    """One-sided one-sample t-test of mean(losses) < target. Returns p, or None with fewer than 2 runs."""
    if len(losses) < 2:
        return None
    return float(optional("scipy.stats").ttest_1samp(losses, target, alternative="less").pvalue)


def refusal(runs) -> str:
    """Why these runs cannot go into a statistic, or "" if they can: each must have trained all its steps."""
    early = [r.path.name for r in runs if r.status == "stopped_early"]
    cut = [r.path.name for r in runs if r.status == "incomplete"]
    diverged = [f"{r.path.name} ({r.final[1]} at step {r.final[0]})" for r in runs if r.status == "diverged"]
    if diverged:
        return (f"refused: {', '.join(diverged)} diverged: its last val loss is not a number to average. Move it "
                f"out of the folder (and rerun it with lower learning rates)")
    if early:
        return (f"refused: {', '.join(early)} stopped early at the target (--stop_at_target 1): runs that stop "
                f"as soon as they reach it sit at or below it by construction, which biases the mean. Rerun "
                f"without --stop_at_target (the default)")
    if cut:
        return (f"refused: {', '.join(cut)} did not train all their steps (an error, or cut off): finish them "
                f"with --resume, or move them out of the folder")
    return ""


def reads_fineweb(run: Run) -> bool:
    return "fineweb" in str(run.config.get("train_files", "")).lower() or "batch_tokens" in run.config


# settings that are a run's own, not its recipe: runs that differ only in these are the same experiment. Those a
# resume may change (train_gpt's RESUME_FREE) but the data, and the seed and how it compiles
RUN_OWN = (set(RESUME_FREE) - {"train_files", "val_files"}) | {"seed", "compile", "compile_scope"}


# of RUN_OWN, the settings of how a run computes, not what: runs that differ in them share a loss, not a time
SPEED_OWN = ("attn_kernel", "mlp_kernel", "flex_tiles", "micro_batch", "compile", "compile_scope", "profile_steps")


def speed_groups(runs) -> dict:
    """The runs by their SPEED_OWN settings, in order of first appearance: {the settings as JSON: runs}."""
    groups = {}
    for r in runs:
        groups.setdefault(json.dumps([r.config.get(k) for k in SPEED_OWN]), []).append(r)
    return groups


def train_times(done) -> str:
    """The runs' training time, mean +- std, one figure per setting of SPEED_OWN among them (named by what
    differs, with its count of runs): a time is never averaged over kernels or micro-batches."""
    groups = speed_groups(done)
    times = [[r.final[2] / 1000 for r in runs] for runs in groups.values()]
    if len(groups) == 1:
        return mean_pm(times[0], ".1f", "s")
    values = [json.loads(k) for k in groups]
    differ = [i for i in range(len(SPEED_OWN)) if len({json.dumps(v[i]) for v in values}) > 1]
    return "; ".join(f"{mean_pm(ts, '.1f', 's') if len(ts) > 1 else f'{ts[0]:.1f}s'} ("
                     + " ".join(f"{SPEED_OWN[i]}={json.dumps(v[i])}" for i in differ)
                     + f", {len(ts)} run{'s' * (len(ts) > 1)})" for ts, v in zip(times, values))


def settings_groups(runs) -> list:
    """The runs grouped by their recipe's settings (all but RUN_OWN), in order of first appearance: [(what sets
    the group apart, its runs)]. Runs of different settings are never averaged together."""
    keys = [json.dumps({k: v for k, v in r.config.items() if k not in RUN_OWN}, sort_keys=True) for r in runs]
    order = list(dict.fromkeys(keys))
    if len(order) == 1:
        return [("", runs)]
    configs = [json.loads(k) for k in order]
    first = ["num_steps", "model_dim", "num_layers", "train_files"]  # what tells a smoke run from a books one
    differ = sorted({k for c in configs for k in c if any(c.get(k) != d.get(k) for d in configs)},
                    key=lambda k: (first.index(k) if k in first else len(first), k))
    label = lambda c: " ".join(f"{k}={json.dumps(c.get(k), separators=(',', ':'))}" for k in differ[:4]) + (
        f" (+{len(differ) - 4} more)" if len(differ) > 4 else "")
    return [(label(c), [r for r, k in zip(runs, keys) if k == key]) for c, key in zip(configs, order)]


def summary(paths, target) -> str:
    """A table of the runs, mean +- std, and a one-sided t-test of val < target. The default target is FineWeb's
    3.28, for runs that read FineWeb; runs on other data (the proxy) get no test unless --target names one. Runs
    of different settings (a smoke and a books run) get a line each group, and no test."""
    runs = usable_runs(paths)
    groups = settings_groups(runs)
    if len(groups) > 1:
        lines = [f"{len(groups)} different settings among these runs: statistics per setting, no t-test (test "
                 f"one setting at a time, in a folder of its own)"]
        for what, group in groups:
            lines += [f"-- {what}"] + summary_lines(group)
        return "\n".join(lines)
    return "\n".join(summary_lines(runs, target, test=True))


def summary_lines(runs, target=None, test: bool = False) -> list:
    """summary()'s table and statistics of runs of one setting, and its t-test if test."""
    lines = [f"{'run':<40} {'steps':>9} {'val_loss':>9} {'time':>10} {'tokens':>14} {'peak_mem':>10}  status"]
    for r in runs:
        step, loss, ms = r.final
        status = r.status + (f" (reached {r.config.get('target_val_loss', 3.28)} at step {r.reached_target})"
                             if r.reached_target is not None else "")
        if r.extra.get("warning") == "resumed_with_changed_source":
            status += " (resumed with a changed train_gpt.py: see its log)"
        lines.append(f"{r.path.name:<40} {f'{step}/{r.num_steps}':>9} {loss:>9.4f} {ms / 1000:>9.1f}s "
                     f"{r.tokens_through(step):>14,} {r.extra.get('peak_memory', '-'):>10}  {status}")
    done = [r for r in runs if r.status == "done"]
    losses = [r.final[1] for r in done]
    if not done:
        lines.append(f"runs:0 finished of {len(runs)}: no statistics (they cover runs that trained all their steps)")
    else:
        diverged = sum(r.status == "diverged" for r in runs)
        unfinished = len(runs) - len(done) - diverged
        left_out = "".join(f" ({n} {what} left out)" for n, what in ((unfinished, "unfinished"), (diverged, "diverged"))
                           if n)
        lines.append(f"runs:{len(done)} val_loss:{mean_pm(losses)} train_time:{train_times(done)}{left_out}")
    if not test:
        return lines
    if target is None and not all(reads_fineweb(r) for r in runs):
        data = sorted({str(r.config.get("train_files")) for r in runs if not reads_fineweb(r)})
        lines.append(f"no t-test: these runs read {', '.join(data)}, not FineWeb, and 3.28 is FineWeb's target "
                     f"(pass --target LOSS to test against another, e.g. a proxy bench's before arm)")
        return lines
    target = 3.28 if target is None else target
    why_not = refusal(runs)
    p = None if why_not else t_test(losses, target)  # refusal(): every run finished, so losses are all of them
    if why_not:
        lines.append(f"t-test {why_not}")
    elif p is None:
        lines.append(f"t-test: needs at least 2 runs (have {len(runs)})")
    else:
        lines.append(f"t-test mean<{target}: p={p:.4g} {'meets' if p < 0.01 else 'does not meet'} the p<0.01 rule")
    return lines


def ratio_ci(a: list, b: list, level: float = 0.95):
    """mean(b) / mean(a) and its confidence interval by the delta method: the ratio's relative variance is the
    sum of the two means' (sample variance / n / mean^2), with Student's t at the smaller arm's n - 1 degrees of
    freedom (conservative for 3 runs an arm). None for the interval with fewer than 2 runs in an arm."""
    ma, mb = float(np.mean(a)), float(np.mean(b))
    r = mb / ma
    if min(len(a), len(b)) < 2:
        return r, None
    stats = optional("scipy.stats")
    rel = (np.var(a, ddof=1) / len(a) / ma**2 + np.var(b, ddof=1) / len(b) / mb**2) ** 0.5
    t = stats.t.ppf(0.5 + level / 2, min(len(a), len(b)) - 1)
    return r, (r * (1 - t * rel), r * (1 + t * rel))


def compare(a, b) -> str:
    """Two arms (folders of logs): final val loss mean +- std of each and Welch's two-sided t-test of the
    difference; then, against the first arm's mean final val loss, each run's training time to reach it (its
    first val at or below it) and the ratio of the arms' means with a 95% interval; and the ratio of their
    training ms per million tokens. Where an arm's runs differ in SPEED_OWN (kernels, micro-batch), only their
    losses are compared."""
    lines, arms, mixed = [], [], []
    for path in (a, b):
        runs = usable_runs([path])
        why_not = refusal(runs)
        if why_not:
            raise ToolError(f"{path}: {why_not}")
        groups = settings_groups(runs)
        if len(groups) > 1:
            raise ToolError(f"{path}: its runs have {len(groups)} different settings ({'; '.join(w for w, _ in groups)}):"
                            f" an arm is one setting, its seeds; put each setting in an arm of its own")
        losses = [r.final[1] for r in runs]
        step_avg = f" step_avg:{mean_std([r.final[2] / r.final[0] for r in runs])[0]:.1f}ms"
        if len(speed_groups(runs)) > 1:  # a time is one setting's, as in summary: none for this arm
            mixed.append(f"{Path(path).name}: {train_times(runs)}")
            step_avg = ""
        lines.append(f"{str(path):<50} runs:{len(runs)} val_loss:{mean_pm(losses)} "
                     f"({', '.join(f'{x:.4f}' for x in losses)}){step_avg}")
        arms.append(runs)
    finals = [[r.final[1] for r in runs] for runs in arms]
    diff = float(np.mean(finals[1]) - np.mean(finals[0]))
    if min(map(len, finals)) < 2:
        lines.append(f"difference (second - first): {diff:+.4f}; the t-test needs 2 runs per arm")
    else:
        p = float(optional("scipy.stats").ttest_ind(finals[1], finals[0], equal_var=False).pvalue)
        lines.append(f"difference (second - first): {diff:+.4f}, Welch's t-test p={p:.4g} (two-sided)")
    if mixed:
        lines.append(f"times not compared: an arm mixes kernel or micro-batch settings ({'; '.join(mixed)}); put "
                     f"each in an arm of its own")
        return "\n".join(lines)
    target = float(np.mean(finals[0]))
    reach = [[None if (t := first_val_at_or_below(r, target)) is None else t / 1000 for r in runs] for runs in arms]
    for path, times in zip((a, b), reach):
        shown = ", ".join("never" if t is None else f"{t:.1f}s" for t in times)
        lines.append(f"time to val {target:.4f} (the first arm's mean final): {Path(path).name}: {shown}")
    if all(t is not None for times in reach for t in times):
        r, ci = ratio_ci(*reach)
        lines.append(f"time-to-loss ratio (second / first): {r:.3f}" + (f" (95% interval {ci[0]:.3f}..{ci[1]:.3f})"
                                                                          if ci else ""))
    else:
        lines.append("time-to-loss ratio: not every run of both arms reached it")
    per_m = [[r.final[2] / (r.tokens_through(r.final[0]) / 1e6) for r in runs] for runs in arms]
    r, ci = ratio_ci(*per_m)
    lines.append(f"ms per 1M training tokens: {np.mean(per_m[0]):.1f} and {np.mean(per_m[1]):.1f}, ratio {r:.3f}"
                 + (f" (95% interval {ci[0]:.3f}..{ci[1]:.3f})" if ci else ""))
    return "\n".join(lines)


def first_val_at_or_below(run: Run, loss: float):
    """Training ms at the run's first validation at or below `loss`; None if none is."""
    return next((ms for _, val, ms in run.val if val <= loss), None)


def flops_per_token(cfg: dict) -> tuple[float, str]:
    """Training FLOPs per token: 6*N over the matmul weights (embedding lookups excluded, lm_head included)
    plus attention's 12*d*K per layer, K = keys a query sees on average, taken as half the layer's window
    (averaged over the training tokens): an upper bound, since document masking cuts it further. Paired heads
    attend over twice the positions with half the heads: the same count."""
    if "batch_tokens" in cfg:
        cfg = {**BASELINE_MODEL, **cfg}
    L, d, V = cfg["num_layers"], cfg["model_dim"], cfg["vocab_size"]
    attn_layers = [i for i in range(L) if i not in cfg.get("no_attn_layers", [])]
    n = len(attn_layers) * 4 * d * d + L * 8 * d * d + V * d
    if "windows" in cfg:  # train_gpt.py since the 2026-01-19 recipe: token windows, long and short, by stage
        hp = hyperparameters_from(cfg)
        steps = range(hp.num_steps)
        weights = [batch_seqs_at(s, hp) for s in steps]
        short, long = (sum(w * windows_at(s, hp)[j] * MASK_BLOCK for s, w in zip(steps, weights)) / sum(weights)
                       for j in (0, 1))
        keys = sum(long / 2 if i in cfg["long_window_layers"] else short / 2 for i in attn_layers)
        how = f"6*{n / 1e6:.1f}M + 12*{d}*(sum over layers of window/2; mean windows {short:.0f}, {long:.0f})"
    elif "max_window" in cfg:  # the Aug 2025 recipe: a window growing by 128-token blocks, half on most layers
        N = cfg["num_steps"]
        mean_w = statistics.mean(max(1, -(-(cfg["max_window"] - 64) * s // (128 * N))) * 128 for s in range(N))
        keys = sum(mean_w / 2 if i in cfg["long_window_layers"] else mean_w / 4 for i in attn_layers)
        how = f"6*{n / 1e6:.1f}M + 12*{d}*(sum over layers of window/2; mean window {mean_w:.0f})"
    else:  # dense causal attention over seq_len
        keys = len(attn_layers) * cfg["seq_len"] / 2
        how = f"6*{n / 1e6:.1f}M + 12*{d}*{len(attn_layers)}*{cfg['seq_len']}/2"
    return 6 * n + 12 * d * keys, how


def time_to_loss(run: Run, loss: float):
    """Train time (ms) at which val loss first reaches `loss`: (linear between val points, at the first val
    point at or below it); None if never. The second is an upper bound; the first is exact for a straight
    curve and an overestimate for a convex one, which falling loss curves are."""
    prev = None
    for step, val, ms in run.val:
        if val <= loss:
            if prev is None or prev[1] == val:
                return ms, ms
            frac = (prev[1] - loss) / (prev[1] - val)
            return prev[2] + frac * (ms - prev[2]), ms
        prev = (step, val, ms)
    return None


def bench(ours_path, base_path, peak_tflops: float) -> str:
    ours, base = parse_log(ours_path), parse_log(base_path)
    for r in (ours, base):
        if r.final[0] == 0:
            raise ToolError(f"{r.path}: the run logged no training step (its last val is at step 0): nothing to "
                            f"time. Finish it (--resume), or pass another log")
    lines = [f"{'':<10} {'steps':>6} {'tokens':>12} {'final_val':>9} {'step_avg':>10} {'tokens/s':>10} "
             f"{'MFU':>6} {'peak_mem':>10} {'compile':>9}"]
    for name, r in [("ours", ours), ("baseline", base)]:
        step, loss, ms = r.final
        step_avg = ms / step
        tps = r.tokens_through(step) / (ms / 1000)
        fpt, how = flops_per_token(r.config)
        mfu = fpt * tps / (peak_tflops * 1e12)
        lines.append(f"{name:<10} {step:>6} {r.tokens_through(step):>12,} {loss:>9.4f} {step_avg:>8.1f}ms "
                     f"{tps:>10,.0f} {mfu:>6.1%} {r.extra.get('peak_memory', '-'):>10} "
                     f"{r.extra.get('warmup_time', '-'):>9}")
        lines.append(f"{'':<10} FLOPs/token = {how} = {fpt / 1e9:.3f} GFLOP; MFU vs {peak_tflops:.0f} TFLOP/s")
    target = base.final[1]
    t_ours, t_base = time_to_loss(ours, target), time_to_loss(base, target)
    if t_ours is None:
        lines.append(f"speedup: ours never reached the baseline's final val loss {target:.4f}")
    else:
        lines.append(f"speedup to val {target:.4f} (baseline's final): baseline {t_base[0] / 1000:.1f}s / ours "
                     f"{t_ours[0] / 1000:.1f}s = {t_base[0] / t_ours[0]:.2f}x (linear between val points); "
                     f"ours' first val at or below it: {t_ours[1] / 1000:.1f}s = {t_base[0] / t_ours[1]:.2f}x")
    return "\n".join(lines)


def read_text(path) -> str:
    path = Path(path)
    if not path.exists():
        raise ToolError(f"{path}: no such file")
    if path.is_dir():
        raise ToolError(f"{path} is a folder: pass a log file")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not a text file: pass a log or a script") from None


def source_of(path, log: bool = False) -> str:
    """The script a log embeds; a script's own text (log=False only)."""
    text = read_text(path)
    if f"\n{SOURCE_END}\n" in text:
        return text.split(f"\n{SOURCE_END}\n")[0]
    if log:
        raise ToolError(f"{path}: no embedded source: not a log written by train_gpt.py or the baseline")
    return text


def diff(log, against) -> str:
    ours = source_of(log, log=True).splitlines(keepends=True)
    theirs = source_of(against).splitlines(keepends=True)
    return "".join(difflib.unified_diff(theirs, ours, fromfile=str(against), tofile=f"{log} (embedded source)"))


def default_plot(first: str) -> Path:
    """Where plot writes without -o: beside what it plots (the folder's curve.png, or LOG.png for a log)."""
    return Path(first) / "curve.png" if Path(first).is_dir() else Path(first).with_suffix(".png")


def plot(paths, out: Path) -> str:
    """Val loss against training time and against step, each run's whole curve, and a third panel zoomed into
    the last 40% of the finished runs' steps. Each run has its own colour; each folder its own line style; an
    unfinished run is marked so in the legend and ends in an x. Returns what it skipped and wrote."""
    matplotlib = optional("matplotlib")
    matplotlib.use("Agg")
    plt = optional("matplotlib.pyplot")
    out = Path(out)
    if out.is_dir():
        raise ToolError(f"{out} is a folder: pass the PNG file to write, e.g. {out / 'curve.png'}")
    runs, problems = load_runs(paths)
    if not runs:
        raise ToolError(f"no readable logs to plot in {', '.join(map(str, paths))}"
                        + (f" ({problems[0]})" if problems else ""))
    folders = sorted({r.path.parent for r in runs})
    fig, (by_time, by_step, end) = plt.subplots(1, 3, figsize=(17, 4.8))
    tail_losses = []
    for i, r in enumerate(runs):
        steps, losses, ms = zip(*r.val)
        done = r.status == "done"
        label = f"{r.path.parent.name}/{r.path.stem}" + ("" if done else f" (unfinished: {steps[-1]}/{r.num_steps})")
        kw = dict(color=f"C{i % 10}", linestyle=["-", "--", ":", "-."][folders.index(r.path.parent) % 4],
                  marker=".", label=label)
        by_time.plot([t / 1000 for t in ms], losses, **kw)
        by_step.plot(steps, losses, **kw)
        if not done:
            for ax, x in ((by_time, ms[-1] / 1000), (by_step, steps[-1])):
                ax.plot([x], [losses[-1]], marker="x", markersize=9, color=kw["color"], linestyle="none")
            continue
        tail = [(s, v) for s, v in zip(steps, losses) if s >= 0.6 * r.num_steps]
        tail = list(zip(steps, losses))[-2:] if len(tail) < 2 else tail  # a line, not a lone point
        if tail:
            end.plot(*zip(*tail), **kw)
            tail_losses += [v for _, v in tail]
    for ax, xlabel in [(by_time, "train time (s, validation excluded)"), (by_step, "step"),
                       (end, "step (the last 40% of each finished run)")]:
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    finals = [r.final[1] for r in runs if r.status == "done"]
    kinds = len(settings_groups([r for r in runs if r.status == "done"])) if finals else 0
    if kinds > 1:  # a smoke and a books run: their finals are not one population
        end.set_title(f"finished runs of {kinds} different settings (not comparable): finals "
                      f"{min(finals):.4f}..{max(finals):.4f}", fontsize=9)
    elif finals:
        end.set_title(f"finished runs: best final {min(finals):.4f}, worst {max(finals):.4f}", fontsize=9)
    else:
        end.set_title("no finished run to zoom into", fontsize=9)
    if tail_losses:
        pad = 0.05 * (max(tail_losses) - min(tail_losses)) + 1e-3
        end.set_ylim(min(tail_losses) - pad, max(tail_losses) + pad)
    by_time.legend(fontsize=7)
    fig.suptitle(f"val loss of {len(runs)} run(s) in {', '.join(f.name for f in folders)}")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise ToolError(f"cannot write {out}: {e.strerror or e}") from None
    lo, hi = by_step.get_ylim()
    axes = f"val loss axis {lo:.2f}..{hi:.2f}" + (f", zoom {end.get_ylim()[0]:.3f}..{end.get_ylim()[1]:.3f}"
                                                  if tail_losses else "")
    unfinished = sum(r.status != "done" for r in runs)
    plt.close(fig)
    return "\n".join([f"skipped {p}" for p in problems] + [
        f"wrote {out} ({len(runs)} run(s){f', {unfinished} unfinished' if unfinished else ''}; {axes})"])


README_HEAD = """# Records

Each folder `records/<YYYY-MM-DD>_<name>/` holds the logs of one submission (each log starts with the exact
source that produced it; arms of a comparison in subfolders) and a README saying what changed and what was
measured. Reproduce a number with `python records/tool.py summary <folder>` or `compare <arm> <arm>`; see what
code made a log with `python records/tool.py diff <log>`; write a log's script out with `tool.py source`.
Benchmarks live in `records/bench/`. The record marked **current default** is the one whose recipe
`train_gpt.py` runs now (named in `records/CURRENT`).

This table is generated by `python records/tool.py readme`; do not edit it by hand.

| record | what | runs | final val loss (mean) | train time (mean) | steps |
|---|---|---|---|---|---|
"""


def current_record(records_dir: Path = RECORDS) -> tuple[str, dict]:
    """records/CURRENT: its first line names the arm whose logs ran the default recipe; each later line that is
    not a comment, `SETTING RECORD`, a setting the default has changed since then by a ported record whose
    logs are still to come (a port is CPU work; its GPU runs come when a GPU is lent)."""
    path = records_dir / "CURRENT"
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()] if path.exists() else [""]
    pending = dict(line.split(None, 1) for line in lines[1:] if line)
    return lines[0], pending


def readme(records_dir: Path = RECORDS) -> str:
    current = current_record(records_dir)[0]
    rows = []
    for d in sorted(p for p in records_dir.iterdir() if p.is_dir() and re.match(r"\d{4}-\d\d-\d\d_", p.name)):
        about = (d / "README.md").read_text().splitlines()[0].lstrip("# ") if (d / "README.md").exists() else ""
        arms = [d] + sorted(p for p in d.iterdir() if p.is_dir() and find_logs([p], descend=False))
        for arm in arms:
            runs, _ = load_runs([arm], descend=False)
            if arm != d and not runs:
                continue
            name = str(arm.relative_to(records_dir))
            what = (about if arm == d else f"arm `{arm.name}`") + (" — **current default**" if name == current else "")
            if not runs:
                rows.append(f"| [{name}]({name}/) | {what} | 0 | - | - | - |")
                continue
            loss = statistics.mean(r.final[1] for r in runs)
            secs = statistics.mean(r.final[2] for r in runs) / 1000
            steps = "/".join(sorted({str(r.final[0]) for r in runs}))
            rows.append(f"| [{name}]({name}/) | {what} | {len(runs)} | {loss:.4f} | {secs:.1f}s | {steps} |")
    return README_HEAD + "\n".join(rows) + "\n"


BASELINE_SCRIPT = RECORDS / "baseline" / "train_gpt2.py"


def default_against(log) -> str:
    """The script a log should be diffed against: the baseline's for a baseline log, else train_gpt.py."""
    source, rest = source_of(log, log=True), read_text(log).split(f"\n{SOURCE_END}\n", 1)[1]
    baseline = source == BASELINE_SCRIPT.read_text() or re.search(r'^config:.*"batch_tokens"', rest, re.M)
    return str(BASELINE_SCRIPT if baseline else REPO / "train_gpt.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", allow_abbrev=False, help="table of runs, mean +- std, t-test against the target")
    s.add_argument("paths", nargs="+", help="record folders or log files")
    s.add_argument("--target", type=float, default=None, help="val loss the one-sided t-test tests against "
                   "(default: FineWeb's 3.28 for runs on FineWeb; none for runs on other data)")
    c = sub.add_parser("compare", allow_abbrev=False,
                       help="two arms (folders of logs): mean +- std each, Welch's t-test")
    c.add_argument("a", help="folder of the first arm's logs (e.g. the old recipe)")
    c.add_argument("b", help="folder of the second arm's logs (e.g. the new recipe)")
    pl = sub.add_parser("plot", allow_abbrev=False, help="val loss curves")
    pl.add_argument("paths", nargs="+", help="record folders or log files")
    pl.add_argument("-o", "--out", type=Path, default=None,
                    help="PNG to write (default: curve.png in the first folder given, or beside the first log as "
                         "LOG.png: never into the repository's root)")
    df = sub.add_parser("diff", allow_abbrev=False, help="unified diff of a log's embedded source")
    df.add_argument("log", help="a log written by train_gpt.py or the baseline")
    df.add_argument("--against", help="a script or another log (default: the script that wrote such a log: "
                                      "train_gpt.py, or records/baseline/train_gpt2.py for a baseline log)")
    so = sub.add_parser("source", allow_abbrev=False, help="write the script a log embeds (to re-run an older recipe)")
    so.add_argument("log", help="a log written by train_gpt.py or the baseline")
    so.add_argument("-o", "--out", type=Path, required=True, help="file to write (not an existing one)")
    so.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    b = sub.add_parser("bench", allow_abbrev=False, help="proxy benchmark: ours vs baseline")
    b.add_argument("ours", help="train_gpt.py's log")
    b.add_argument("baseline", help="records/baseline/train_gpt2.py's log")
    b.add_argument("--peak_tflops", type=float, default=H100_BF16_TFLOPS, help="dense bf16 peak for MFU")
    sub.add_parser("readme", allow_abbrev=False, help="rewrite records/README.md")
    args = parser.parse_args(argv)
    try:
        print(run_command(args), end="")
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run_command(args) -> str:
    if args.cmd == "summary":
        return summary(args.paths, args.target) + "\n"
    if args.cmd == "compare":
        return compare(args.a, args.b) + "\n"
    if args.cmd == "plot":
        return plot(args.paths, args.out or default_plot(args.paths[0])) + "\n"
    if args.cmd == "diff":
        return diff(args.log, args.against or default_against(args.log)) or "no difference\n"
    if args.cmd == "source":
        source = source_of(args.log, log=True)
        if args.out.is_dir():
            raise ToolError(f"{args.out} is a folder: pass a file name, e.g. {args.out / 'train_gpt_of_log.py'}")
        if args.out.exists() and not args.force:
            raise ToolError(f"{args.out} exists: pass another -o, or --force to overwrite it")
        try:
            args.out.write_text(source)
        except OSError as e:
            raise ToolError(f"cannot write {args.out}: {e.strerror or e}") from None
        return f"wrote {args.out}\n"
    if args.cmd == "bench":
        try:
            return bench(args.ours, args.baseline, args.peak_tflops) + "\n"
        except OSError as e:  # a path that is not a readable file: say which, without errno's prefix
            raise ToolError(f"{e.filename}: {'no such file' if isinstance(e, FileNotFoundError) else e.strerror}"
                            ) from None
        except LogFormatError as e:
            raise ToolError(str(e)) from None
    (RECORDS / "README.md").write_text(readme())
    return f"wrote {RECORDS / 'README.md'}\n"


if __name__ == "__main__":
    sys.exit(main())
