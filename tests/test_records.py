"""records/tool.py on logs in train_gpt.py's exact format: one real tiny run, the rest written with its own
log_line and SOURCE_END, so a change of the log format breaks these tests."""
import json

import pytest
from scipy import stats

import train_gpt as tg
from conftest import REPO, load_script
from test_train_gpt import tiny_run

tool = load_script("records_tool", "records/tool.py")


def fake_log(path, vals, source="print('hi')\n", config=None, extra=()):
    """A log as train_gpt.main writes it: source, environment, config, step lines."""
    config = config or json.loads(json.dumps(tg.dataclasses.asdict(tg.Hyperparameters())))
    lines = [tg.log_line(config=json.dumps(config, separators=(",", ":")), world_size=8, run_id=path.stem)]
    n = vals[-1][0]
    for step, loss, ms in vals:
        lines.append(tg.log_line(step=f"{step}/{n}", val_loss=f"{loss:.4f}", train_time=f"{ms:.0f}ms",
                                 step_avg=f"{ms / max(step, 1):.2f}ms"))
    lines += list(extra)
    path.write_text(f"{source}\n{tg.SOURCE_END}\nenv\n{tg.SOURCE_END}\n" + "\n".join(lines) + "\n")
    return path


def test_reads_a_real_train_gpt_log(proxy_dir, tmp_path):
    tiny_run(proxy_dir, tmp_path, "--num_steps", "2", "--val_every", "1", "--run_id", "real")
    run = tool.parse_log(tmp_path / "real.txt")
    assert [v[0] for v in run.val] == [0, 1, 2] and run.num_steps == 2
    assert [t[0] for t in run.train] == [1, 2] and run.tokens_per_step == 8 * 128
    assert run.source == open(tg.__file__).read()
    assert tool.diff(tmp_path / "real.txt", tg.__file__) == ""


def test_summary_statistics_and_a_malformed_log(tmp_path):
    finals = [3.2712, 3.2745, 3.2731, 3.2760]
    for i, loss in enumerate(finals):
        fake_log(tmp_path / f"run{i}.txt", [(0, 10.8, 0), (1695, loss, 170_000 + i * 1000)],
                 extra=[tg.log_line(peak_memory="40000MiB")])
    (tmp_path / "broken.txt").write_text("step:1/2 val_loss:3.0\n")  # no source: not a train_gpt.py log
    fake_log(tmp_path / "nostart.txt", [(0, 10.8, 0)])  # fine: a log of a run stopped at step 0
    out = tool.summary([tmp_path], target=3.28)
    assert "skipped" in out and "broken.txt" in out and "no embedded source" in out
    p = stats.ttest_1samp(finals + [10.8], 3.28, alternative="less").pvalue
    assert f"p={p:.4g}" in out and "does not meet" in out  # the stopped run ruins the mean
    (tmp_path / "nostart.txt").unlink()
    out = tool.summary([tmp_path], target=3.28)
    p = stats.ttest_1samp(finals, 3.28, alternative="less").pvalue
    assert p < 0.01 and f"p={p:.4g} meets" in out
    assert "runs:4 val_loss:3.2737+-0.0020" in out and "40000MiB" in out and "666,501,120" in out


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
    source = open(tg.__file__).read().replace("NS_COEFFS = (3.4445", "NS_COEFFS = (3.5")
    log = fake_log(tmp_path / "variant.txt", [(0, 10.8, 0)], source=source)
    d = tool.diff(log, tg.__file__)
    assert "-NS_COEFFS = (3.4445" in d and "+NS_COEFFS = (3.5" in d and d.count("\n@@") == 1
    assert tool.diff(log, log) == ""


def test_plot_writes_png(tmp_path):
    fake_log(tmp_path / "a.txt", [(0, 10.8, 0), (10, 5.0, 1000)])
    tool.plot([tmp_path], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


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


def test_baseline_log_is_read_and_its_flops_counted(proxy_dir, tmp_path):
    baseline = load_script("baseline_train_gpt2", "records/baseline/train_gpt2.py")
    log = baseline.main(["--device", "cpu", "--train_files", str(proxy_dir / "proxy_train_*.bin"),
                         "--val_files", str(proxy_dir / "proxy_val_*.bin"), "--val_tokens", "2048",
                         "--train_tokens", "1024", "--batch_tokens", "1024", "--micro_batch", "1",
                         "--log_dir", str(tmp_path), "--run_id", "base"])
    run = tool.parse_log(log)
    assert [v[0] for v in run.val] == [0, 1] and run.val[-1][1] < run.val[0][1] and run.tokens_per_step == 1024
    assert run.source == (REPO / "records" / "baseline" / "train_gpt2.py").read_text()
    matmul = sum(p.numel() for n, p in baseline.GPT2().named_parameters() if p.ndim == 2 and "wpe" not in n)
    fpt, _ = tool.flops_per_token(run.config)
    assert fpt == 6 * matmul + 12 * 768 * 12 * 1024 / 2  # wte counts once: it is the tied head's matmul
