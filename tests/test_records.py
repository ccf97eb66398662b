"""records/tool.py on logs in train_gpt.py's exact format: one real tiny run, the rest written with its own
log_line and SOURCE_END, so a change of the log format breaks these tests."""
import json
import re
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import REPO, TINY, load_script, tiny_run  # first: repo on sys.path
import train_gpt as tg  # noqa: E402

tool = load_script("records_tool", "records/tool.py")


def fake_log(path, vals, source="print('hi')\n", config=None, extra=(), num_steps=None):
    """A log as train_gpt.main writes it: source, environment, config, step lines."""
    config = config or json.loads(json.dumps(tg.dataclasses.asdict(tg.Hyperparameters())))
    lines = [tg.log_line(config=json.dumps(config, separators=(",", ":")), world_size=8, run_id=path.stem)]
    n = num_steps or (vals[-1][0] if vals else 0)
    for step, loss, ms in vals:
        lines.append(tg.log_line(step=f"{step}/{n}", val_loss=f"{loss:.4f}", train_time=f"{ms:.0f}ms",
                                 step_avg=f"{ms / max(step, 1):.2f}ms"))
    lines += list(extra)
    path.write_text(f"{source}\n{tg.SOURCE_END}\nenv\n{tg.SOURCE_END}\n" + "\n".join(lines) + "\n")
    return path


def test_reads_a_real_train_gpt_log(sample_shards, tmp_path):
    tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--val_every", "1", "--run_id", "real")
    run = tool.parse_log(tmp_path / "real.txt")
    assert [v[0] for v in run.val] == [0, 1, 2] and run.num_steps == 2 and run.status == "done"
    # one scheduled step: the second stage starts at round(1 / 2) = 0 (the record's rounding), so 4 x 128 twice
    assert [t[0] for t in run.train] == [1, 2] and run.tokens_through(2) == (4 + 4) * 128
    assert run.source == open(tg.__file__).read()
    assert tool.diff(tmp_path / "real.txt", tg.__file__) == ""


def test_summary_statistics_and_what_is_not_a_log(tmp_path):
    finals = [3.2712, 3.2745, 3.2731, 3.2760]
    for i, loss in enumerate(finals):
        fake_log(tmp_path / f"run{i}.txt", [(0, 10.8, 0), (1600, loss, 170_000 + i * 1000)],
                 extra=[tg.log_line(peak_memory="40000MiB")],
                 config={**fineweb_config(), "num_steps": 1600, "extension_steps": 40})
    (tmp_path / "stepbench.txt").write_text("new: median 617.0 ms/step over steps 21..45\n")  # not a log: passed over
    out = tool.summary([tmp_path], target=None)
    assert "skipped" not in out and "stepbench" not in out
    p = stats.ttest_1samp(finals, 3.28, alternative="less").pvalue
    assert p < 0.01 and f"p={p:.4g} meets" in out
    # the 2026-01-19 record's tokens: 520 steps each of 8, 16 and 24 micro-batches, then 40 of 24, x 16,384
    assert "runs:4 val_loss:3.2737+-0.0020" in out and "40000MiB" in out and f"{(520 * 48 + 40 * 24) * 16384:,}" in out
    # runs on the proxy: 3.28 is FineWeb's target, so no test unless one is named
    proxy = tmp_path / "proxy"
    proxy.mkdir()
    for i, loss in enumerate([3.88, 3.89]):
        fake_log(proxy / f"p{i}.txt", [(0, 10.8, 0), (125, loss, 80_000)],
                 config={**fineweb_config(), "train_files": "/tmp/proxy/proxy_train_*.bin"})
    out = tool.summary([proxy], target=None)
    assert "no t-test: these runs read /tmp/proxy/proxy_train_*.bin, not FineWeb" in out and "p=" not in out
    assert "does not meet" in tool.summary([proxy], target=3.885)


def fineweb_config():
    return json.loads(json.dumps(tg.dataclasses.asdict(tg.Hyperparameters())))


def test_logs_that_cannot_be_used_are_refused_not_skipped(tmp_path, capsys, monkeypatch):
    """A log with a source but no val line, or step lines without a source, makes a statistic refuse in one line
    and exit non-zero; so do an empty, a missing or a garbage folder. plot says what it skipped, and refuses when
    nothing is left; diff, source and bench refuse what is not a log, naming the path."""
    fake_log(tmp_path / "good.txt", [(0, 10.8, 0), (125, 3.9, 80_000)])
    fake_log(tmp_path / "nostart.txt", [], extra=["error: no shards match"])  # failed before its first step
    for argv in (["summary", str(tmp_path)], ["compare", str(tmp_path), str(tmp_path)]):
        assert tool.main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refused: " in err and "nostart.txt: no config line or no val_loss lines" in err
    (tmp_path / "nostart.txt").unlink()
    (tmp_path / "broken.txt").write_text("step:1/2 val_loss:3.0\n")  # step lines, no source
    assert tool.main(["summary", str(tmp_path)]) == 1 and "broken.txt: no embedded source" in capsys.readouterr().err
    assert tool.main(["plot", str(tmp_path), "-o", str(tmp_path / "new" / "dir" / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "skipped " in out and "broken.txt" in out and (tmp_path / "new" / "dir" / "c.png").exists()
    # without -o: beside what it plots, never into the working directory (a user's repository root)
    monkeypatch.chdir(tmp_path / "new")
    assert tool.main(["plot", str(tmp_path)]) == 0 and (tmp_path / "curve.png").exists()
    assert tool.main(["plot", str(tmp_path / "good.txt")]) == 0 and (tmp_path / "good.png").exists()
    assert not (tmp_path / "new" / "curve.png").exists()
    capsys.readouterr()
    empty, garbage = tmp_path / "empty", tmp_path / "garbage"
    empty.mkdir()
    garbage.mkdir()
    (garbage / "x.txt").write_bytes(bytes(range(256)))
    for argv, says in [(["summary", str(empty)], "no logs of train_gpt.py"),
                       (["summary", str(tmp_path / "missing")], "missing: no such file or folder"),
                       (["compare", str(empty), str(tmp_path)], "no logs of train_gpt.py"),
                       (["plot", str(garbage), "-o", str(tmp_path / "g.png")], "no readable logs to plot"),
                       (["diff", str(garbage / "x.txt")], "is not a text file"),
                       (["diff", str(tmp_path / "missing.txt")], "no such file"),
                       (["diff", str(tmp_path)], "is a folder"),
                       (["diff", str(tmp_path / "good.txt"), "--against", str(garbage / "x.txt")], "not a text file"),
                       (["source", str(tmp_path / "broken.txt"), "-o", str(tmp_path / "s.py")], "no embedded source"),
                       (["bench", str(tmp_path / "missing.txt"), str(tmp_path / "good.txt")], "missing.txt: no such file"),
                       (["bench", str(tmp_path), str(tmp_path / "good.txt")], "Is a directory")]:
        assert tool.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err, (argv, err)
    assert not (tmp_path / "g.png").exists() and not (tmp_path / "s.py").exists()


def test_summary_refuses_early_stopped_and_unfinished_runs(tmp_path):
    """Runs that stop at the target all end at or below it: their t-test would pass by construction."""
    for i, loss in enumerate([3.2790, 3.2795, 3.2780]):
        fake_log(tmp_path / f"early{i}.txt", [(0, 10.8, 0), (1500, loss, 150_000)], num_steps=1695,
                 extra=[tg.log_line(reached_target=3.28, at_step=1500, train_time="150000ms")])
    out = tool.summary([tmp_path], target=3.28)
    assert "t-test refused: early0.txt, early1.txt, early2.txt stopped early at the target" in out
    assert "stopped_early (reached 3.28 at step 1500)" in out and "p=" not in out
    for f in tmp_path.glob("early*.txt"):
        f.unlink()
    fake_log(tmp_path / "done.txt", [(0, 10.8, 0), (1695, 3.27, 170_000)])
    fake_log(tmp_path / "crashed.txt", [(0, 10.8, 0), (1000, 3.4, 100_000)], num_steps=1695,
             extra=["error: the train loss (nan) became non-finite at step 1001"])
    out = tool.summary([tmp_path], target=3.28)
    assert "t-test refused: crashed.txt did not train all their steps" in out and "p=" not in out
    with pytest.raises(tool.ToolError, match="refused: crashed.txt did not train all their steps"):
        tool.compare(tmp_path, tmp_path)


def test_a_run_whose_final_val_is_not_finite_is_never_averaged(tmp_path):
    """A log that trained all its steps and ended at val nan (a divergence in the last steps) is set aside as
    diverged: not averaged into nan+-nan, no t-test of it, and compare refuses it, naming it."""
    for i, loss in enumerate([3.2790, 3.2795]):
        fake_log(tmp_path / f"ok{i}.txt", [(0, 10.8, 0), (1695, loss, 170_000)])
    fake_log(tmp_path / "nan.txt", [(0, 10.8, 0), (1695, float("nan"), 170_000)],
             extra=["error: val loss is nan at step 1695: the run diverged"])
    out = tool.summary([tmp_path], target=3.28)
    assert "nan+-nan" not in out and "p=nan" not in out, out
    assert "runs:2 val_loss:3.2793+-0.0004 train_time:170.0s+-0.0s (1 diverged left out)" in out, out
    assert re.search(r"^nan\.txt .* diverged$", out, re.M), out
    assert "t-test refused: nan.txt (nan at step 1695) diverged" in out
    with pytest.raises(tool.ToolError, match="nan.txt \\(nan at step 1695\\) diverged"):
        tool.compare(tmp_path, tmp_path)


def test_a_resumed_log_reads_as_one_run(tmp_path):
    """Steps logged after the checkpoint and before the crash are replaced by the resumed run's."""
    log = fake_log(tmp_path / "r.txt", [(0, 10.8, 0), (500, 4.0, 50_000), (1000, 3.6, 100_000)], num_steps=1695)
    with open(log, "a") as f:
        f.write("\n".join([tg.log_line(step="1001/1695", train_loss="3.5", train_time="100100ms"),
                           tg.log_line(resumed_from="logs/r_step000750.pt", step=750, world_size=8, changed="{}"),
                           tg.log_line(step="751/1695", train_loss="3.7", train_time="75100ms"),
                           tg.log_line(step="1000/1695", val_loss="3.6100", train_time="100050ms"),
                           tg.log_line(step="1695/1695", val_loss="3.2790", train_time="170000ms")]) + "\n")
    run = tool.parse_log(log)
    assert run.val == [(0, 10.8, 0), (500, 4.0, 50_000), (1000, 3.61, 100_050), (1695, 3.279, 170_000)]
    assert run.train == [(751, 3.7, 75_100)] and run.resumed_at == [750] and run.status == "done"


def test_compare_two_arms(tmp_path):
    a, b = [3.90, 3.91, 3.89], [3.85, 3.87, 3.86]
    for name, arm in [("old", a), ("new", b)]:
        (tmp_path / name).mkdir()
        for i, loss in enumerate(arm):
            fake_log(tmp_path / name / f"s{i}.txt", [(0, 10.8, 0), (125, loss, 100_000)])
    out = tool.compare(tmp_path / "old", tmp_path / "new")
    p = stats.ttest_ind(b, a, equal_var=False).pvalue
    assert "runs:3 val_loss:3.9000+-0.0100" in out and "runs:3 val_loss:3.8600+-0.0100" in out
    assert f"difference (second - first): -0.0400, Welch's t-test p={p:.4g}" in out and p < 0.01


def test_bench_speedup_and_flops(tmp_path):
    ours_cfg = json.loads(json.dumps(tg.dataclasses.asdict(tg.Hyperparameters(num_steps=100))))
    ours = fake_log(tmp_path / "ours.txt", [(0, 10.8, 0), (10, 7.0, 10_000), (20, 5.0, 20_000)], config=ours_cfg)
    base = fake_log(tmp_path / "base.txt", [(0, 10.9, 0), (50, 6.0, 60_000)],
                    config={"batch_tokens": 524288, "tokens_per_step": 524288})
    assert tool.time_to_loss(tool.parse_log(ours), 6.0) == pytest.approx((15_000, 20_000))  # 6 is halfway
    out = tool.bench(ours, base, 989.0)
    assert "baseline 60.0s / ours 15.0s = 4.00x" in out and "at or below it: 20.0s = 3.00x" in out
    fpt, _ = tool.flops_per_token({"batch_tokens": 1, **tool.BASELINE_MODEL})
    assert fpt == 6 * (12 * 12 * 768**2 + 50304 * 768) + 12 * 768 * 12 * 512


def test_diff_shows_what_changed(tmp_path):
    source = open(tg.__file__).read().replace("ATTN_SCALE = 0.1 ", "ATTN_SCALE = 0.12 ")
    log = fake_log(tmp_path / "variant.txt", [(0, 10.8, 0)], source=source)
    d = tool.diff(log, tg.__file__)
    assert "-ATTN_SCALE = 0.1 " in d and "+ATTN_SCALE = 0.12 " in d and d.count("\n@@") == 1
    assert tool.diff(log, log) == ""


def test_plot_draws_each_run_whole_in_its_own_colour(tmp_path):
    """Read the PNG back: each run in its own colour (matplotlib's C0..C3, two folders of two) on all three
    panels; the loss axis covers each run's whole curve, the start's 10.8 included; the zoom panel covers the
    finished runs' last 40%; an unfinished run is named so and left out of the zoom."""
    import matplotlib.image as mpimg
    for arm, (a, b) in [("old", (5.0, 4.0)), ("new", (6.0, 4.5))]:
        (tmp_path / arm).mkdir()
        for seed in range(2):
            fake_log(tmp_path / arm / f"s{seed}.txt", [(0, 10.8, 0), (10, a, 1000), (15, (a + b) / 2, 1500),
                                                       (20, b + 0.3 * seed, 2000)])
    out = tool.plot([tmp_path / "new", tmp_path / "old"], tmp_path / "curve.png")
    lo, hi, zlo, zhi = map(float, re.search(r"val loss axis (\S+)\.\.(\S+), zoom (\S+)\.\.(\S+)\)", out).groups())
    assert lo <= 4.0 and hi >= 10.8 and zlo <= 4.0 and 5.25 <= zhi < 6.0, out
    img = mpimg.imread(tmp_path / "curve.png")[..., :3]
    width = img.shape[1]
    for colour in ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]:
        rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        hit = np.abs(img - rgb).max(-1) < 0.05
        for third in range(3):
            assert hit[:, third * width // 3:(third + 1) * width // 3].sum() > 100, (colour, third)
    fake_log(tmp_path / "old" / "cut.txt", [(0, 10.8, 0), (10, 3.0, 1000)], num_steps=20)
    out = tool.plot([tmp_path / "old"], tmp_path / "curve2.png")
    assert "(3 run(s), 1 unfinished;" in out and re.search(r"zoom 3\.9\d\d\.\.", out), out  # 3.0 not in the zoom
    with pytest.raises(tool.ToolError, match="is a folder: pass the PNG file to write"):
        tool.plot([tmp_path / "old"], tmp_path)


def test_summary_counts_only_finished_runs(tmp_path):
    """Statistics over finished runs only, the others listed and counted as left out; one run has no spread."""
    fake_log(tmp_path / "a.txt", [(0, 10.8, 0), (120, 7.7, 60_000)])
    fake_log(tmp_path / "cut.txt", [(0, 10.8, 0), (30, 9.0, 20_000)], num_steps=120)
    fake_log(tmp_path / "zero.txt", [(0, 10.8, 0)], num_steps=20)
    out = tool.summary([tmp_path], target=None)
    assert "runs:1 val_loss:7.7000 (one run) train_time:60.0s (one run) (2 unfinished left out)" in out, out
    assert "cut.txt" in out and "incomplete" in out


def test_tool_refuses_to_overwrite_and_says_what_it_needs(tmp_path, capsys, monkeypatch):
    log = fake_log(tmp_path / "run.txt", [(0, 10.8, 0), (5, 9.0, 500)])
    (tmp_path / "old.py").write_text("mine\n")
    assert tool.main(["source", str(log), "-o", str(tmp_path / "old.py")]) == 1
    assert "old.py exists: pass another -o, or --force to overwrite it" in capsys.readouterr().err
    assert (tmp_path / "old.py").read_text() == "mine\n"
    assert tool.main(["source", str(log), "-o", str(tmp_path / "old.py"), "--force"]) == 0
    assert (tmp_path / "old.py").read_text() == "print('hi')\n" and "wrote" in capsys.readouterr().out
    unfinished = fake_log(tmp_path / "u.txt", [(0, 10.8, 0)], num_steps=20)
    assert tool.main(["bench", str(unfinished), str(log)]) == 1
    assert "logged no training step" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    assert tool.main(["plot", str(log), "-o", str(tmp_path / "c.png")]) == 1
    err = capsys.readouterr().err
    assert err == "error: this needs matplotlib, which is not installed: pip install -r records/requirements.txt\n"
    with pytest.raises(SystemExit):
        tool.main(["summary", str(log), "--targ", "3"])  # no abbreviations
    assert "unrecognized arguments: --targ" in capsys.readouterr().err


def test_current_record_runs_the_current_recipe():
    """records/CURRENT names the arm whose logs ran the default recipe: every setting of the recipe (all but
    the data, the step counts scaled to the proxy, and a run's own settings) equals train_gpt.py's default,
    but those CURRENT lists as changed since by a ported record not yet run on a GPU (each named in the recipe
    map): a default that moves silently fails here."""
    current, pending = tool.current_record()
    recipe_map = (REPO / "train_gpt.py").read_text().split("# Imports")[0]
    assert all(record in recipe_map for record in pending.values()), pending
    runs, problems = tool.load_runs([REPO / "records" / current])
    assert runs and not problems
    scaled = {"num_steps", "extension_steps", "momentum_warmup_steps", "momentum_cooldown_steps"}
    own = {"val_tokens", "seed", *tg.RESUME_FREE}  # RESUME_FREE: settings that change no training
    defaults = fineweb_config()
    for r in runs:
        differ = {k for k, v in defaults.items() if k not in scaled | own and r.config.get(k) != v}
        assert differ == set(pending), (r.path.name, differ)


def test_records_readme_is_generated(tmp_path):
    rec = tmp_path / "2026-01-01_fast"
    rec.mkdir()
    (rec / "README.md").write_text("# Faster by a trick\n")
    fake_log(rec / "r0.txt", [(0, 10.8, 0), (1600, 3.27, 150_000)])
    (rec / "ablation").mkdir()
    fake_log(rec / "ablation" / "a0.txt", [(0, 10.8, 0), (1600, 3.30, 140_000)])
    (tmp_path / "notes").mkdir()  # not a record folder
    (tmp_path / "CURRENT").write_text("2026-01-01_fast\n")
    table = tool.readme(tmp_path)
    assert ("| [2026-01-01_fast](2026-01-01_fast/) | Faster by a trick — **current default** | 1 | 3.2700 | 150.0s "
            "| 1600 |") in table
    assert "| [2026-01-01_fast/ablation](2026-01-01_fast/ablation/) | arm `ablation` | 1 | 3.3000 | 140.0s | 1600 |" in table
    assert "notes" not in table
    # the committed records/README.md is the tool's output, not hand-typed
    assert (REPO / "records" / "README.md").read_text() == tool.readme()


def test_baseline_log_is_read_and_its_flops_counted(sample_shards, tmp_path):
    baseline = load_script("baseline_train_gpt2", "records/baseline/train_gpt2.py")
    log = baseline.main(["--device", "cpu", "--train_files", str(sample_shards / "sample_train_*.bin"),
                         "--val_files", str(sample_shards / "sample_val_*.bin"), "--val_tokens", "1024", "--num_layers", "2",
                         "--train_tokens", "1024", "--batch_tokens", "1024", "--micro_batch", "1",
                         "--log_dir", str(tmp_path), "--run_id", "base"])
    run = tool.parse_log(log)
    assert [v[0] for v in run.val] == [0, 1] and run.val[-1][1] < run.val[0][1] and run.tokens_through(1) == 1024
    assert run.source == (REPO / "records" / "baseline" / "train_gpt2.py").read_text()
    assert tool.diff(log, tool.default_against(log)) == ""  # `diff LOG` compares a baseline log with its script
    matmul = sum(p.numel() for n, p in baseline.GPT2(layers=2).named_parameters() if p.ndim == 2 and "wpe" not in n)
    fpt, _ = tool.flops_per_token(run.config)
    assert fpt == 6 * matmul + 12 * 768 * 2 * 1024 / 2  # wte counts once: it is the tied head's matmul


def test_benches_import_run_their_parsers_and_agree_on_the_bench():
    """Every benchmark lives in records/bench/ and keeps working: the Python ones import (train_gpt's public
    names only) and parse their flags, the shell ones pass bash -n; stepbench times the recipe bench's after
    arm (the same scaled flags), and --set names KernelSettings fields. No script lies in a record folder."""
    import re
    import subprocess
    bench = REPO / "records" / "bench"
    stepbench = load_script("stepbench", "records/bench/stepbench.py")
    args, extra = stepbench.parse(["--out", "o", "--name", "n", "--set", "ce_tiles=(16,512,8)", "--", "--seq_len", "256"])
    assert args.steps == "80,100" and extra == ["--", "--seq_len", "256"]
    assert all(hasattr(tg.KernelSettings(), s.split("=")[0]) for s in args.set)
    recipe = (bench / "recipe.sh").read_text()
    assert " ".join(stepbench.SCALED) in recipe.replace("(", " ").replace(")", " ").replace("\n", " ") or \
        all(flag in recipe for flag in stepbench.SCALED)
    queue = " ".join((bench / "proxyqueue.sh").read_text().split())  # the device calls' proxy runs: the same steps
    assert " ".join(stepbench.SCALED) in queue
    for script in sorted(bench.glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    for script in sorted(bench.glob("*.py")):  # but sasscount.py, which compiles the (private) kernels themselves
        assert script.name == "sasscount.py" or not re.search(r"\btg\._", script.read_text()), \
            f"{script} uses a private name of train_gpt.py"
    assert not list((REPO / "records").glob("20*/**/*.py")), "record folders hold logs, READMEs and profiles"
    # the before arm's script is the Aug-2025 record's, out of its log
    before = re.search(r"records/tool.py source (\S+)", recipe).group(1)
    assert "class GPT" in tool.source_of(REPO / before, log=True)


def test_flexwork_counts_the_tiles_and_pairs_of_a_brute_force_mask():
    """records/bench/flexwork.py's FLOPs against every (query, key) pair walked by brute force for the tiny
    model's layers: a pair is inside when the key is at most the window before the query and not before the
    query's document; a tile of 128 x 128 is computed when any pair in it is inside. Paired-head layers run
    half the heads over the interleaved sequence (token t at 2t and 2t + 1)."""
    flexwork = load_script("flexwork", "records/bench/flexwork.py")
    cfg = tg.parse_args([*TINY, "--seq_len", "512"])
    gen = np.random.default_rng(0)
    seqs = gen.integers(0, 50257, (2, 512))
    seqs[0, [0, 100, 101]] = seqs[1, [170, 400]] = tg.BOS_ID
    short, long = tg.windows_at(0, cfg)
    computed = inside = full = 0
    for seq in seqs:
        start = np.maximum.accumulate(np.where(seq == tg.BOS_ID, np.arange(512), 0))  # each token's document
        for i in set(range(cfg.num_layers)) - set(cfg.no_attn_layers):
            paired = i in cfg.paired_head_layers
            window = (long if i in cfg.long_window_layers else short) * 128
            pos = np.arange(1024 if paired else 512)
            doc_start = 2 * start[pos // 2] if paired else start[pos]
            q, k = pos[:, None], pos[None, :]
            seen = (k <= q) & (k >= q - window) & (k >= doc_start[:, None])
            n = pos.size // 128
            tiles = seen.reshape(n, 128, n, 128).any(axis=(1, 3)).sum()
            full += seen.reshape(n, 128, n, 128).all(axis=(1, 3)).sum()
            per_pair = 4 * cfg.head_dim * (cfg.num_heads // 2 if paired else cfg.num_heads)
            computed += per_pair * tiles * 128 * 128
            inside += per_pair * seen.sum()
    work = flexwork.flex_work(cfg, torch.from_numpy(seqs), 0)
    assert (short, long) == (1, 2) and 0 < inside < computed and full  # partial and full tiles
    assert work == {"computed": computed, "inside": inside}


def test_loaderbench_times_each_stage_on_a_shard_the_trainer_reads(tmp_path, capsys):
    """records/bench/loaderbench.py: its made-up shard is one the trainer reads (a header it accepts, each
    document opened by <|endoftext|>, lengths as drawn), and it times each stage of the default recipe at each
    world size, saying how many of the step's sequences rank 0 keeps (every world-th one) and in passes of how
    many (2 and 8 worlds of 8 / 16 / 24 sequences: 4 / 8 / 12 and 1 / 2 / 3 per rank)."""
    loaderbench = load_script("loaderbench", "records/bench/loaderbench.py")
    path = tmp_path / "like_train_000001.bin"
    loaderbench.fineweb_like_shard(path, 200_000)
    tokens = tg.load_shard(str(path))
    starts = np.flatnonzero(tokens == tg.BOS_ID)
    assert starts[0] == 0 and 150 < len(starts) < 400 and 190_000 < len(tokens) <= 200_000  # ~900 tokens each
    assert np.median(np.diff(starts)) == pytest.approx(545, rel=0.25)  # the lognormal's median, e^6.3
    loaderbench.main(["--train_files", str(tmp_path / "like_train_*.bin"), "--world", "2,8", "--reps", "2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("world")]
    cfg = tg.parse_args([])
    want = [(w, k + 1, n, clip, n // w) for w in (2, 8)
            for k, (n, clip) in enumerate(zip(cfg.batch_seqs, cfg.max_doc_len))]
    got = [tuple(int(x) for x in re.match(r"world (\d+)  stage (\d+): +(\d+) sequences, documents clipped to +(\d+), "
                                          r"rank 0 keeps +(\d+) in passes of (\d+): [\d.]+ ms", line).groups())
           for line in lines]
    assert [g[:5] for g in got] == want
    assert [g[5] for g in got] == [4, 4, 4, 1, 1, 1]


def test_gluebw_reads_a_real_profile_and_bounds_the_glue(tmp_path, monkeypatch, capsys):
    """records/bench/gluebw.py: a stage profile as the trainer wrote it (records/2026-12-06_full-main-h100) gives
    its categories and listed kernels; kernel modules with Inductor's harness are found by their kernel's name
    (one name in two graphs: both, averaged; one source in two files: once), others skipped (a graph's module,
    which holds its kernels' sources as strings, too); and the bound is worked by hand: a kernel taking
    2 ms per step and 0.5 ms alone runs 4 times, each moving (0.25 + 0.75) / 2 GB: 2 GB per step; one whose
    name the profile cut runs twice, 1 GB each: 2 more. A 4,000 GB/s copy moves the 4 GB in 1 ms; the two cover
    3 of the category's 5 ms, so the bound is 5/3 ms. A profile that counts launches (as
    train_gpt.costliest_kernels writes it) gives the calls instead: 8 launches of the first at 0.5 GB are 4 GB
    per step, the cut name's two kernels 2 GB; 6 GB at 4,000 GB/s take 1.5 ms, so the bound is 2.5 ms; the
    first's launches take 0.25 ms each in the run, half their time alone."""
    gluebw = load_script("gluebw", "records/bench/gluebw.py")
    real = REPO / "records/2026-12-06_full-main-h100/bench/main_stage3_profile.txt"
    categories, kernels, launches = gluebw.read_profile(real)
    assert launches == {}  # written before profiles counted them
    assert categories[gluebw.GLUE] == 110.13 and categories["FlexAttention"] == 119.99 and len(categories) == 10
    assert len(kernels) == 100 and kernels["_relu_square_mm_kernel"] == 75.46
    assert sum(ms for n, ms in kernels.items() if tg.kernel_category(n) == gluebw.GLUE) == pytest.approx(101.89)

    def kernel_module(path, name, gb=None):  # as Inductor writes one with benchmark_kernel on
        harness = "def get_args():\n    return torch.ones(8), torch.zeros(8)\n\n\ndef call(args):\n    " \
                  "args[1].copy_(args[0])\n"
        main = "" if gb is None else f"\n\nif __name__ == '__main__':\n    num_gb = {gb}\n"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"import torch\n\n\ndef {name}(in_ptr0, xnumel):\n    pass\n\n\n{harness}{main}")

    kernel_module(tmp_path / "ab" / "cab.py", "triton_poi_fused_add_0", 0.25)  # one name in two graphs
    kernel_module(tmp_path / "cd" / "ccd.py", "triton_poi_fused_add_0", 0.75)
    kernel_module(tmp_path / "ab" / "cother.py", "triton_per_fused_sum_1")  # no bytes counted: not found
    (tmp_path / "ab" / "wrapper.py").write_text("def call(args):\n    pass\n")  # a graph's module: no harness
    long = "triton_per_fused_" + "mul_" * 40 + "2"  # the profile cuts it at 150 characters
    kernel_module(tmp_path / "ef" / "clong.py", long, 1.0)
    kernel_module(tmp_path / "ef" / "ccopy.py", long, 1.0)  # the same source written twice: timed once
    graph = f"async_compile = AsyncCompile()\n{long} = async_compile.triton('{long}', '''\n"
    (tmp_path / "ef" / "cgraph.py").write_text(graph + (tmp_path / "ef" / "clong.py").read_text() + "''')\n")
    assert {n: len(p) for n, p in gluebw.find_kernels(tmp_path).items()} == {"triton_poi_fused_add_0": 2, long: 1}

    profile = tmp_path / "p.txt"
    profile.write_text(f"{gluebw.GLUE:<26} {5.0:9.2f} ms\n\ncostliest kernels (ms per step):\n"
                       f"{2.0:9.2f}  triton_poi_fused_add_0\n{1.0:9.2f}  {long[:150]}\n"
                       f"{1.0:9.2f}  triton_red_fused_mean_7\n{3.0:9.2f}  nvjet_sm90_tst_192x192\n")
    monkeypatch.setattr(gluebw, "time_ms", lambda fn: fn() or 0.5)
    monkeypatch.setattr(gluebw, "copy_gbps", lambda: 4000.0)
    gluebw.main([str(tmp_path), str(profile)])
    out = capsys.readouterr().out
    assert "the profile lists 4.00 ms of it, 3.00 ms timed here" in out
    assert "timed kernels: 4.0 GB per step at 1333 GB/s, 33% of the copy's rate; at the copy's rate 1.00 ms" in out
    assert "bound for the whole category (scaled by coverage): 1.67 ms per step, against 5.00 measured" in out
    assert re.search(r"2\.00 +1000 +25% +4\.0 +triton_poi_fused_add_0 \*", out)

    run = [("triton_poi_fused_add_0", 2.0, 8.0), (long, 0.6, 1.0), (long[:-1] + "3", 0.4, 1.0),
           ("triton_red_fused_mean_7", 1.0, 3.0), ("nvjet_sm90_tst_192x192", 3.0, 12.0)]
    profile.write_text("\n".join([f"{gluebw.GLUE:<26} {5.0:9.2f} ms", ""] + tg.costliest_kernels(run)) + "\n")
    _, kernels, launches = gluebw.read_profile(profile)
    assert kernels[long[:150]] == 1.0 and launches == {"triton_poi_fused_add_0": 8.0, long[:150]: 2.0,
                                                       "triton_red_fused_mean_7": 3.0, "nvjet_sm90_tst_192x192": 12.0}
    gluebw.main([str(tmp_path), str(profile)])
    out = capsys.readouterr().out
    assert "timed kernels: 6.0 GB per step at 2000 GB/s, 50% of the copy's rate; at the copy's rate 1.50 ms" in out
    assert "bound for the whole category (scaled by coverage): 2.50 ms per step, against 5.00 measured" in out
    assert re.search(r"2\.00 +2000 +50% +8\.0 +0\.50  triton_poi_fused_add_0 \*", out)
    assert re.search(r"1\.00 +2000 +50% +2\.0 +1\.00  triton_per_fused_mul", out)

def test_stack_sampler_times_every_thread():
    """The stage bench's sampler gives a function the wall time it spent on any thread's stack: the autograd
    engine runs (and compiles) backward on a thread of its own while the main thread waits for it."""
    import threading
    import time
    stagebench = load_script("stagebench", "records/bench/stagebench.py")

    def on_the_side():
        time.sleep(0.6)

    def waits_for(thread):
        thread.join()

    with stagebench.StackSampler(every=0.01) as sampler:
        side = threading.Thread(target=on_the_side)
        side.start()
        waits_for(side)
    seconds = {name.rsplit(":", 1)[-1]: s for name, s in sampler.cumulative.items()}
    assert seconds["on_the_side"] == pytest.approx(0.6, abs=0.15)
    assert seconds["waits_for"] == pytest.approx(0.6, abs=0.15)
    assert sampler.total == pytest.approx(0.6, abs=0.15)
    assert ":on_the_side" in sampler.report()


def test_kernel_compiles_times_each_threads_first_launches(monkeypatch):
    """The stage bench's KernelCompiles times each call of Triton's JITFunction._do_compile (a hand-written
    kernel's compile at its first launch) on whichever thread makes it, and puts the method back after."""
    import threading
    import time
    import types
    stagebench = load_script("stagebench", "records/bench/stagebench.py")

    class FakeJIT:  # triton's JITFunction as far as the bench reads it: __name__ and _do_compile
        def __init__(self, name):
            self.__name__ = name

        def _do_compile(self, seconds):
            time.sleep(seconds)
            return self.__name__
    for name in ("triton", "triton.runtime", "triton.runtime.jit"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["triton.runtime.jit"].JITFunction = FakeJIT
    original = FakeJIT._do_compile
    with stagebench.KernelCompiles() as compiles:
        side = threading.Thread(target=lambda: FakeJIT("slow")._do_compile(0.4), name="side")
        side.start()
        assert FakeJIT("fast")._do_compile(0.1) == "fast"
        side.join()
    assert FakeJIT._do_compile is original
    (t1, k1, s1), (t2, k2, s2) = compiles.done
    assert (t1, k1, t2, k2) == ("MainThread", "fast", "side", "slow")
    assert s1 == pytest.approx(0.1, abs=0.05) and s2 == pytest.approx(0.4, abs=0.05)
    assert re.fullmatch(r"MainThread 1 \(0\.1 s\), side 1 \(0\.4 s\)", compiles.summary())
    assert re.search(r"side +0\.4\d s  slow", compiles.report())


def test_stagebench_warm_only_writes_where_the_warm_up_went(sample_shards, tmp_path):
    """--warm_only stops after the warm-up and appends its time with the Inductor settings as the config then
    holds them (0x40 reads back as 64); the sampled stacks and compile phases are written. An unknown setting
    is refused in one line."""
    import subprocess

    def bench(*args):
        data = ["--train_files", str(sample_shards / "sample_train_*.bin"),
                "--val_files", str(sample_shards / "sample_val_*.bin")]
        return subprocess.run([sys.executable, str(REPO / "records" / "bench" / "stagebench.py"), "--out", str(tmp_path),
                               *args, "--", *TINY, *data, "--warmup_steps", "2"], capture_output=True, text=True)

    done = bench("--name", "w", "--warm_only", "--inductor", "max_fusion_size=0x40")
    assert done.returncode == 0, done.stderr[-2000:]
    line, = (tmp_path / "warmups.txt").read_text().splitlines()
    assert re.fullmatch(r"w: train_gpt.py, warm-up \d+\.\d s \(kernels compiled at first launch: none\), "
                        r"max_fusion_size=64 -- .*--warmup_steps 2", line)
    assert "train_gpt.py:warm_up" in (tmp_path / "w_warmup_host.txt").read_text()
    assert (tmp_path / "w_kernel_compiles.txt").read_text() == ""  # the CPU run launches no Triton kernel
    assert (tmp_path / "w_compile_times.txt").exists()
    assert not (tmp_path / "stagebench.txt").exists() or "w:" not in (tmp_path / "stagebench.txt").read_text()
    refused = bench("--name", "x", "--warm_only", "--inductor", "no_such_setting=1")
    assert refused.returncode == 2 and "no_such_setting" in refused.stderr.strip().splitlines()[-1]


def test_mutants_help_prints_its_usage_without_running_anything():
    import subprocess
    out = subprocess.run([sys.executable, str(REPO / "tests" / "mutants.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("Break the code on purpose") and "SURVIVED" in out.stdout


def test_runs_of_different_settings_are_never_averaged_together(tmp_path):
    """A smoke run and a books run in one folder (different widths and step counts): summary gives each setting
    its own line and no t-test; compare refuses an arm that mixes them; runs of one recipe through other
    kernels share a loss line but not a time (compare compares their losses only); a record whose logs sit in
    arm subfolders is summarized from them."""
    smoke = json.loads(json.dumps(tg.dataclasses.asdict(tg.parse_args(["--preset", "smoke"]))))
    books = json.loads(json.dumps(tg.dataclasses.asdict(tg.parse_args(["--preset", "books"]))))
    (tmp_path / "mixed").mkdir()
    for i, loss in enumerate([8.51, 8.52]):
        fake_log(tmp_path / "mixed" / f"smoke_{i}.txt", [(0, 10.8, 0), (20, loss, 9_000)], config={**smoke, "seed": i})
    fake_log(tmp_path / "mixed" / "books_0.txt", [(0, 10.8, 0), (120, 7.7, 180_000)], config=books)
    out = tool.summary([tmp_path / "mixed"], target=None)
    assert out.startswith("2 different settings among these runs") and "t-test" not in out.split("\n", 1)[1], out
    assert "runs:2 val_loss:8.5150+-0.0071" in out and "runs:1 val_loss:7.7000 (one run)" in out, out
    books_part = out.split("-- num_steps=120 model_dim=128")[1].split("\n-- ")[0]
    assert re.search(r"^-- num_steps=20 model_dim=64 ", out, re.M) and "8.5150" not in books_part
    assert "runs:1 val_loss:7.7000 (one run)" in books_part
    with pytest.raises(tool.ToolError, match="its runs have 2 different settings"):
        tool.compare(tmp_path / "mixed", tmp_path / "mixed")
    # the same recipe through other kernels: one loss, a training time per kernel setting
    (tmp_path / "kernels").mkdir()
    for i, (kernel, ms) in enumerate([(True, 53_200), (False, 90_500), (True, 53_400), (False, 90_600)]):
        fake_log(tmp_path / "kernels" / f"k{i}.txt", [(0, 10.8, 0), (20, 8.5 + i / 100, ms)],
                 config={**smoke, "seed": i, "mlp_kernel": kernel})
    out = tool.summary([tmp_path / "kernels"], target=None)
    assert ("runs:4 val_loss:8.5150+-0.0129 train_time:53.3s+-0.1s (mlp_kernel=true, 2 runs); 90.5s+-0.1s "
            "(mlp_kernel=false, 2 runs)") in out, out
    (tmp_path / "one").mkdir()
    for i in range(2):
        fake_log(tmp_path / "one" / f"o{i}.txt", [(0, 10.8, 0), (20, 8.52 + i / 100, 50_000)],
                 config={**smoke, "seed": i})
    out = tool.compare(tmp_path / "one", tmp_path / "kernels")  # the losses compared, the times not
    assert "Welch's t-test p=" in out and "ms per 1M" not in out and "time to val" not in out, out
    assert "times not compared: an arm mixes kernel or micro-batch settings (kernels: 53.3s" in out, out
    assert "step_avg:2500.0ms" in out and out.count("step_avg") == 1, out  # the mixed arm's line has none
    assert "ms per 1M" in tool.compare(tmp_path / "one", tmp_path / "one")
    record = tmp_path / "2026-01-01_rec"
    (record / "arm").mkdir(parents=True)
    fake_log(record / "arm" / "a.txt", [(0, 10.8, 0), (1695, 3.27, 170_000)])
    assert "runs:1 val_loss:3.2700" in tool.summary([record], target=None)
