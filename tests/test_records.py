"""records/tool.py on logs in train_gpt.py's exact format: one real tiny run, the rest written with its own
log_line and SOURCE_END, so a change of the log format breaks these tests."""
import json

import numpy as np
import pytest
from scipy import stats

from conftest import REPO, load_script, tiny_run  # first: repo on sys.path
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
    assert [t[0] for t in run.train] == [1, 2] and run.tokens_through(2) == (2 + 4) * 128  # 2, then 4 x 128
    assert run.source == open(tg.__file__).read()
    assert tool.diff(tmp_path / "real.txt", tg.__file__) == ""


def test_summary_statistics_and_a_malformed_log(tmp_path):
    finals = [3.2712, 3.2745, 3.2731, 3.2760]
    for i, loss in enumerate(finals):
        fake_log(tmp_path / f"run{i}.txt", [(0, 10.8, 0), (1600, loss, 170_000 + i * 1000)],
                 extra=[tg.log_line(peak_memory="40000MiB")])
    (tmp_path / "broken.txt").write_text("step:1/2 val_loss:3.0\n")  # no source: not a train_gpt.py log
    fake_log(tmp_path / "nostart.txt", [], extra=["error: no shards match"])  # failed before its first step
    out = tool.summary([tmp_path], target=3.28)
    assert "skipped" in out and "broken.txt" in out and "no embedded source" in out
    assert "nostart.txt: no config line or no val_loss lines: the run did not get going (no shards match)" in out
    p = stats.ttest_1samp(finals, 3.28, alternative="less").pvalue
    assert p < 0.01 and f"p={p:.4g} meets" in out
    # the record's tokens: 520 steps each of 8, 16 and 24 micro-batches, then 40 of 24, x 16,384
    assert "runs:4 val_loss:3.2737+-0.0020" in out and "40000MiB" in out and f"{(520 * 48 + 40 * 24) * 16384:,}" in out


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
    assert "refused" in tool.compare(tmp_path, tmp_path)


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


def test_plot_draws_each_run(tmp_path):
    """Read the PNG back: each run's curve is drawn in its colour (matplotlib's C0, C1) on both panels."""
    import matplotlib.image as mpimg
    fake_log(tmp_path / "a.txt", [(0, 10.8, 0), (10, 5.0, 1000), (20, 4.0, 2000)])
    fake_log(tmp_path / "b.txt", [(0, 10.8, 0), (10, 6.0, 1500), (20, 4.5, 3000)])
    tool.plot([tmp_path], tmp_path / "curve.png")
    img = mpimg.imread(tmp_path / "curve.png")[..., :3]
    width = img.shape[1]
    for colour in ["#1f77b4", "#ff7f0e"]:
        rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        hit = np.abs(img - rgb).max(-1) < 0.05
        assert hit[:, :width // 2].sum() > 200 and hit[:, width // 2:].sum() > 200, colour


def test_records_readme_is_generated(tmp_path):
    rec = tmp_path / "2026-01-01_fast"
    rec.mkdir()
    (rec / "README.md").write_text("# Faster by a trick\n")
    fake_log(rec / "r0.txt", [(0, 10.8, 0), (1600, 3.27, 150_000)])
    (tmp_path / "notes").mkdir()  # not a record folder
    table = tool.readme(tmp_path)
    assert "| [2026-01-01_fast](2026-01-01_fast/) | Faster by a trick | 1 | 3.2700 | 150.0s | 1600 |" in table
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
