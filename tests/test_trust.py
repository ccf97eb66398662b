"""Runs you can trust: resume that appends and refuses a changed run, divergence and bad-token stops, durable
checkpoints, one-line errors for what users get wrong."""
import errno
import io
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import GOLDEN_TOL, REPO, load_script, losses, tiny_args, tiny_run, write_shard  # first: repo on sys.path
import train_gpt as tg  # noqa: E402

tool = load_script("records_tool", "records/tool.py")


@pytest.fixture(scope="module")
def run6(sample_shards, tmp_path_factory):
    """A 6-step run with checkpoints at 3 and 6: (folder, log text)."""
    d = tmp_path_factory.mktemp("run6")
    log = tiny_run(sample_shards, d, "--num_steps", "6", "--save_every", "3", "--val_every", "3", "--run_id", "r")
    return d, log


def resume_args(sample_shards, d, *extra):
    return tiny_args(sample_shards, d, "--num_steps", "6", "--save_every", "3", "--val_every", "3", *extra)


# ---- resume

def test_resume_appends_to_its_log_and_continues_bitwise(sample_shards, run6, tmp_path):
    """Warm-up steps on resume, too: after step 3 (odd) the optimizer's states are not zero and Adam's grads of
    step 3 wait for step 4, and warm-up must put both back as they were."""
    d, full = run6
    shutil.copytree(d, tmp_path / "r")
    log_path = tmp_path / "r" / "r.txt"
    tg.main(resume_args(sample_shards, tmp_path / "r", "--run_id", "r", "--val_every", "2", "--warmup_steps", "2",
                        "--resume", str(tmp_path / "r" / "r_step000003.pt")))
    log = log_path.read_text()
    assert log.startswith(full), "the log before the resume must stay as it was"
    resumed = log[len(full):]
    assert resumed.startswith("resumed_from:") and '"val_every":2,"warmup_steps":2}' in resumed
    assert "warmup_step:2/2" in resumed
    assert losses(resumed) == {s: v for s, v in losses(full).items() if s > 3}  # bitwise: 4 decimals, equal
    # the records tool reads it as one run: each step once, the resumed values
    run = tool.parse_log(log_path)
    assert [s for s, *_ in run.train] == [1, 2, 3, 4, 5, 6] and run.final[0] == 6
    # step_avg divides all timed ms by all steps done, as in an uninterrupted run
    for line in resumed.splitlines():
        kv = dict(tool.PAIR.findall(line))
        if "train_loss" in kv:
            step = int(kv["step"].split("/")[0])
            assert float(kv["step_avg"].removesuffix("ms")) == pytest.approx(
                float(kv["train_time"].removesuffix("ms")) / step, abs=0.6), line
    end_a = torch.load(d / "r_step000006.pt", weights_only=True)
    end_b = torch.load(tmp_path / "r" / "r_step000006.pt", weights_only=True)
    for name, p in end_a["model"].items():
        assert torch.equal(p, end_b["model"][name]), name
    assert end_a["loader"] == end_b["loader"]
    # its validations, before the resume and after, go on into the next checkpoint (and the summary)
    assert [(s, round(v, 4)) for s, v in end_b["vals"]] == [(s, v) for s, v, _ in run.val]


def test_fp8_down_scales_resume_bitwise(sample_shards, tmp_path, monkeypatch):
    """--fp8_down's delayed scales are state: a run paused at step 3 and resumed (warm-up steps on resume, too)
    ends as the uninterrupted run, loss for loss and scale for scale, with the weights' scales delayed from step
    1 on (FP8_DOWN_EXACT_STEPS made 1) so that both kinds of scale carry over."""
    monkeypatch.setattr(tg, "FP8_DOWN_EXACT_STEPS", 1)
    fp8 = ("--fp8_mlp", "1", "--num_steps", "6", "--val_every", "3")
    full = tiny_run(sample_shards, tmp_path / "full", *fp8, "--save_every", "6", "--run_id", "f")
    tg.main(tiny_args(sample_shards, tmp_path / "paused", *fp8, "--stop_at", "3", "--run_id", "p"))
    tg.main(["--resume", str(tmp_path / "paused" / "p_step000003.pt"), "--warmup_steps", "2", "--save_every", "6"])
    assert losses((tmp_path / "paused" / "p.txt").read_text()) == losses(full)
    end_a = torch.load(tmp_path / "full" / "f_step000006.pt", weights_only=True)["model"]
    end_b = torch.load(tmp_path / "paused" / "p_step000006.pt", weights_only=True)["model"]
    assert end_a.keys() == end_b.keys() and "fp8_down_scales" in end_a
    assert (end_a["fp8_down_scales"][:, 1] != end_a["fp8_down_scales"][:, 2]).all()  # delayed: the last step moved
    for name, p in end_a.items():
        assert torch.equal(p, end_b[name]), name


@pytest.mark.parametrize("change,says", [
    (["--num_steps", "8"], "num_steps: 6 in the checkpoint, 8 now. A resume keeps its run's settings: leave out "
                           "--num_steps (only"),
    (["--batch_seqs", "8", "--muon_beta2", "0.8"], "batch_seqs: [2, 4] in the checkpoint, [8] now; muon_beta2: 0.9"),
    (["--model_dim", "128", "--head_dim", "64"], "head_dim: 32 in the checkpoint, 64 now; model_dim: 64"),
])
def test_resume_refuses_a_changed_run(sample_shards, run6, tmp_path, change, says):
    """Flags beside --resume that change the run are refused, named; given alone beside --resume, each one (the
    run's other settings coming from the checkpoint), or with all the run's flags."""
    d, _ = run6
    for args in (["--resume", str(d / "r_step000003.pt"), "--log_dir", str(tmp_path)],
                 resume_args(sample_shards, tmp_path, "--resume", str(d / "r_step000003.pt"))):
        with pytest.raises(SystemExit, match="belongs to another run") as e:
            tg.main(args + change)
        assert says in str(e.value) and "only log_dir, run_id, val_every" in str(e.value)
        assert not list(tmp_path.glob("*.txt")), "a refused run leaves no log"


def test_the_same_shards_at_another_path_resume_with_a_note(sample_shards, run6, tmp_path):
    """The shards are compared by their fingerprints, not by the glob: a copy of the same shards in another folder
    resumes (a note names both paths) and trains as run6 did; a val shard of other content at the same path is
    refused, naming it."""
    d, full = run6
    shutil.copytree(sample_shards, tmp_path / "moved")
    shutil.copytree(d, tmp_path / "r")
    ckpt = tmp_path / "r" / "r_step000003.pt"
    moved = ["--train_files", str(tmp_path / "moved" / "sample_train_*.bin"), "--val_files",
             str(tmp_path / "moved" / "sample_val_*.bin")]
    val = tmp_path / "moved" / "sample_val_000000.bin"
    tokens = tg.load_shard(str(val)).copy()
    tokens[10] = (tokens[10] + 1) % 50000
    original = val.read_bytes()
    write_shard(val, tokens)
    with pytest.raises(SystemExit, match="shard sample_val_000000.bin \\(--val_files\\) is not the one the "
                                         "checkpoint read: the same size, other content"):
        tg.main(["--resume", str(ckpt), *moved])
    val.write_bytes(original)
    log = tg.main(["--resume", str(ckpt), *moved]).read_text()
    note = next(line for line in log.splitlines() if line.startswith("note:same_shards_at_another_path"))
    assert f"train_files:{sample_shards / 'sample_train_*.bin'}->{moved[1]}" in note
    assert losses(log[len(full):]) == {s: v for s, v in losses(full).items() if s > 3}


def test_resume_refuses_a_finished_run(sample_shards, run6, tmp_path):
    d, _ = run6
    with pytest.raises(SystemExit, match="at step 6, the run's last .* nothing left to train"):
        tg.main(resume_args(sample_shards, tmp_path, "--resume", str(d / "r_step000006.pt")))



def test_stop_at_pauses_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(sample_shards, run6, tmp_path,
                                                                                       capsys):
    """--stop_at 4 (not a val or save step): a validation and a checkpoint at step 4, no summary, and the command
    that goes on; resumed with --resume alone (the settings, the log and the run_id from the checkpoint), the same
    losses and final weights as run6, which never paused, and a summary of the whole run (a target of 20 is
    reached by step 0's validation, before the pause)."""
    d, full = run6
    target = ("--target_val_loss", "20")
    log = tg.main(resume_args(sample_shards, tmp_path, "--run_id", "r", "--save_every", "0", "--stop_at", "4", *target))
    paused = log.read_text()
    assert re.search(r"^step:4/6 val_loss:\S+", paused, re.M) and not re.search("^summary:", paused, re.M)
    assert paused.rstrip().splitlines()[-1] == f"stopped_at:4/6 resume_with:{tmp_path / 'r_step000004.pt'}"
    assert tool.parse_log(log).status == "incomplete"  # the tool counts it unfinished
    for step in (2, 4):  # a resume that would stop at once, or before its checkpoint
        with pytest.raises(SystemExit, match=f"--stop_at {step} is not after checkpoint .*'s step 4"):
            tg.main(resume_args(sample_shards, tmp_path, "--run_id", "r", "--stop_at", str(step),
                                "--resume", str(tmp_path / "r_step000004.pt")))
    with pytest.raises(SystemExit, match="--stop_at 6 is not before the last step"):
        tg.main(resume_args(sample_shards, tmp_path, "--stop_at", "6"))
    out = capsys.readouterr().out  # the paused launch said how to go on, as a command that works as printed
    assert f"go on with: python {os.path.relpath(REPO / 'train_gpt.py')} --resume {tmp_path / 'r_step000004.pt'}" in out
    # alone but for a checkpoint at the end (save_every may change on resume): the run's settings, its log and its
    # run_id come from the checkpoint
    tg.main(["--resume", str(tmp_path / "r_step000004.pt"), "--save_every", "3"])
    text = log.read_text()
    assert losses(text) == losses(full)
    summary = dict(tool.PAIR.findall(text.rstrip().splitlines()[-1]))
    best, best_step = min((v, s) for s, v in losses(text, "val").items())
    assert (float(summary["best_val"]), int(summary["best_at_step"])) == (best, best_step)
    assert summary["target"] == "20.0_at_0.0s" and len(re.findall("^reached_target:", text, re.M)) == 1
    end_a = torch.load(d / "r_step000006.pt", weights_only=True)
    end_b = torch.load(tmp_path / "r_step000006.pt", weights_only=True)
    assert all(torch.equal(p, end_b["model"][name]) for name, p in end_a["model"].items())
    assert tool.parse_log(log).status == "done"

def test_unreadable_checkpoints_are_refused_in_one_line(sample_shards, run6, tmp_path):
    d, _ = run6
    good = (d / "r_step000003.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(good[:len(good) // 2])
    (tmp_path / "text.pt").write_text("not a checkpoint")
    torch.save({"model": {}}, tmp_path / "other.pt")
    for name, says in [("cut.pt", "cannot read checkpoint"), ("text.pt", "cannot read checkpoint"),
                       ("missing.pt", "no such file"), ("other.pt", "not a checkpoint written by train_gpt.py")]:
        with pytest.raises(SystemExit, match=says) as e:
            tg.main(resume_args(sample_shards, tmp_path, "--resume", str(tmp_path / name)))
        assert "\n" not in str(e.value) and str(e.value).startswith("error: ")


def test_the_memory_line_counts_the_allocators_retries_and_notes_them():
    """The GPU run's memory line: peak and reserved MiB and how often the allocator ran out during training; a
    note, which records/tool.py reads as a note, only where it did."""
    ok = tg.memory_lines(1024 * 2**20, 2048 * 2**20 + 5, 0)
    assert ok == ["peak_memory:1024MiB reserved_memory:2048MiB alloc_retries:0"]
    at_limit = tg.memory_lines(21365 * 2**20, 24000 * 2**20, 7)
    assert len(at_limit) == 2 and at_limit[0].endswith("alloc_retries:7")
    fields = dict(tool.PAIR.findall(at_limit[1]))
    assert fields["note"] == "memory_at_the_limit" and "ran_out_7_times" in fields["why"]
    assert fields["why"].endswith("may_train_faster")  # one field: no space cuts it short
    assert tg.alloc_retries(torch.device("cpu")) == 0


def test_a_missing_checkpoint_is_named_before_the_gpu(tmp_path, monkeypatch):
    """--resume alone takes its settings, --device among them, from the checkpoint: a path that names no file is
    the error, on a machine with or without a GPU, not the GPU check of the defaults it fell back to; a folder
    is answered with its newest checkpoints."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="cannot read checkpoint missing.pt: no such file") as e:
        tg.main(["--resume", "missing.pt"])
    assert "\n" not in str(e.value) and "GPU" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no log folder left behind
    (tmp_path / "runs").mkdir()  # a folder given for a checkpoint: its newest checkpoints named, newest first
    for i, step in enumerate((3, 6, 9, 12)):
        (tmp_path / "runs" / f"r_step{step:06d}.pt").write_bytes(b"")
        os.utime(tmp_path / "runs" / f"r_step{step:06d}.pt", (1e9 + i, 1e9 + i))
    with pytest.raises(SystemExit, match="runs: a folder; its newest checkpoints: r_step000012.pt, r_step000009.pt, "
                                         "r_step000006.pt\\. A run writes"):
        tg.main(["--resume", "runs"])


class _RunsCode:
    """A pickled object whose unpickling would create a folder: what a malicious checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_checkpoint_cannot_run_code(sample_shards, tmp_path):
    marker = str(tmp_path / "pwned")
    torch.save({"model": _RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(SystemExit, match="cannot read checkpoint"):
        tg.main(resume_args(sample_shards, tmp_path, "--resume", str(tmp_path / "evil.pt")))
    assert not os.path.exists(marker)


def test_every_rank_must_read_the_checkpoint(sample_shards, run6, tmp_path, monkeypatch):
    """If another rank cannot read the file (another node, no shared file system), all stop at once."""
    d, _ = run6
    real = tg.Comm.all_ok

    def other_rank_failed(self, ok):
        return False if sys._getframe(1).f_code.co_name == "read_checkpoint" else real(self, ok)

    monkeypatch.setattr(tg.Comm, "all_ok", other_rank_failed)
    with pytest.raises(SystemExit, match="another rank could not read it.*every rank can read"):
        tg.main(resume_args(sample_shards, tmp_path, "--resume", str(d / "r_step000003.pt")))


# ---- divergence and data

def test_divergence_stops_the_run_without_a_bad_checkpoint(sample_shards, tmp_path):
    with pytest.raises(SystemExit) as e:
        tiny_run(sample_shards, tmp_path, "--num_steps", "6", "--save_every", "1", "--adam_lr", "1e30",
                 "--keep_last", "0", "--run_id", "nan")
    msg = str(e.value)
    assert "non-finite at step" in msg and "diverged" in msg
    bad_step = int(msg.split("non-finite at step ")[1].split(":")[0])
    saved = sorted(tmp_path.glob("nan_step*.pt"))
    assert [int(p.stem[-6:]) for p in saved] == list(range(1, bad_step))  # every finite step, none after
    assert f"Newest good checkpoint: {saved[-1]}" in msg
    for p in saved:
        assert all(torch.isfinite(t).all() for t in torch.load(p, weights_only=True)["model"].values())
    assert (tmp_path / "nan.txt").read_text().splitlines()[-1].startswith("error: ")


def test_token_ids_beyond_the_vocab_are_named(sample_shards, tmp_path):
    tokens = tg.load_shard(str(sample_shards / "sample_train_000001.bin")).copy()
    tokens[1000] = 50300
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "bad_train_000001.bin", tokens)
    args = tiny_args(sample_shards, tmp_path, "--num_steps", "2")
    args[args.index("--train_files") + 1] = str(tmp_path / "data" / "bad_train_*.bin")
    with pytest.raises(SystemExit) as e:
        tg.main(args)
    assert "bad_train_000001.bin: token 50300 at position 1,000" in str(e.value)
    assert "data/check.py" in str(e.value)


# ---- checkpoints

def test_checkpoints_are_durable_and_pruned(sample_shards, tmp_path, monkeypatch):
    """fsync the file, rename it into place, fsync the folder; stale .tmp files go at start; keep_last."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(tg.os, "fsync", lambda fd: events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(tg.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    (tmp_path / "k_step000002.tmp").write_bytes(b"half a checkpoint")
    tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--save_every", "1", "--keep_last", "2", "--run_id", "k")
    assert events[:3] == [("fsync", False), ("replace", str(tmp_path / "k_step000001.pt")), ("fsync", True)]
    assert sorted(p.name for p in tmp_path.glob("k_step*")) == ["k_step000002.pt", "k_step000003.pt"]


def test_a_failed_write_keeps_the_previous_checkpoint(sample_shards, tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def disk_full(obj, f):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)

    monkeypatch.setattr(tg.torch, "save", disk_full)
    with pytest.raises(SystemExit, match="No space left on device.*k_step000001.pt, is intact"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--save_every", "1", "--run_id", "k")
    assert sorted(p.name for p in tmp_path.glob("k_step*")) == ["k_step000001.pt"]
    assert torch.load(tmp_path / "k_step000001.pt", weights_only=True)["step"] == 1


# ---- errors a user makes: one line, what to do, non-zero exit, no log left behind

@pytest.mark.parametrize("flags,says", [
    (["--num_steps", "0"], "--num_steps must be positive"),
    (["--seq_len", "-128"], "--seq_len must be positive"),
    (["--batch_seqs", "0"], "--batch_seqs takes positive numbers, one per part of the schedule"),
    (["--momentum_warmup_steps", "0"], "--momentum_warmup_steps must be positive"),
    (["--num_heads", "3"], "--num_heads 3 x --head_dim 32 = 96, but --model_dim is 64"),
    (["--seq_len", "100"], "--seq_len 100 must be a multiple of 128"),
    (["--seed", str(2**63)], "--seed must be at least 0 and below 2\\^63"),
    (["--val_tokens", "100"], "--val_tokens 100 is not a whole number of --val_seq_len 1024 sequences: make it 1024"),
    (["--val_tokens", "30720", "--num_steps", "2"], "val shards .* hold 28,231 tokens; --val_tokens asks for 30,720"),
    (["--long_window_layers", "0,9"], "--long_window_layers names layers \\[9\\], which do not exist"),
    (["--paired_head_layers", "1"], "layers \\[1\\] have no attention \\(--no_attn_layers\\) but paired heads"),
    (["--backout_layer", "2", "--num_steps", "4"], "--mudd needs --backout_layer before layer 2; or pass --mudd 0"),
    (["--no_attn_layers", "1,3", "--value_embeds=1,-1,0,-1", "--num_steps", "4"],
     "--mudd needs attention on the last layer \\(3\\); or pass --mudd 0"),
    (["--value_embeds", "0,1"], "--value_embeds takes one table number \\(or -1\\) per layer, 4 in all"),
    (["--skip", "2,1"], "--skip takes two layers FROM,TO with FROM before TO"),
    (["--extension_steps", "5", "--num_steps", "5"], "--extension_steps 5 leaves no scheduled steps"),
    (["--train_files", "/nowhere/x_*.bin"], "no shards match '/nowhere/x_\\*.bin'"),
    (["--flex_tiles", "tiny"], "--flex_tiles must be auto, default or small"),
    # values that cannot be right (issue 19: these trained, or were reported as a divergence)
    (["--muon_lr", "-1"], "--muon_lr must be a finite number, 0 or more \\(it is -1.0\\)"),
    (["--muon_lr", "nan"], "--muon_lr must be a finite number"),
    (["--adam_lr", "inf"], "--adam_lr must be a finite number"),
    (["--adam_wd", "-1"], "--adam_wd must be a finite number, 0 or more"),
    (["--muon_beta2", "1.5"], "--muon_beta2 must be at least 0 and below 1"),
    (["--adam_eps", "0"], "--adam_eps must be a finite number above 0"),
    (["--device", "bogus"], "--device must be cuda or cpu \\(it is 'bogus'\\)"),
    # round four (issue 37)
    (["--target_val_loss", "nan"], "--target_val_loss must be a finite number above 0 \\(it is nan\\)"),
    (["--target_val_loss", "inf", "--stop_at_target", "1"], "--target_val_loss must be a finite number above 0"),
    (["--target_val_loss", "-1"], "--target_val_loss must be a finite number above 0"),
    (["--log_dir", ""], "--log_dir is empty"),
    (["--micro_batch", "3"], "--micro_batch 3 does not divide the 2/4 sequences per process"),
    (["--micro_batch", "-1"], "--micro_batch must be 0 or more"),
    (["--vocab_size", "1000000000"], "need [0-9,.]+ GiB, and this machine has [0-9,.]+ GiB free: lower --vocab_size"),
    (["--bigram_vocab", "10000000000"], "need [0-9,.]+ GiB, and this machine has [0-9,.]+ GiB free"),
])
def test_bad_settings_are_refused_in_one_line(sample_shards, tmp_path, flags, says):
    with pytest.raises(SystemExit, match=says) as e:
        tg.main(tiny_args(sample_shards, tmp_path, *flags))
    assert "\n" not in str(e.value) and str(e.value).startswith("error: ")
    assert list(tmp_path.iterdir()) == [], "a run that fails before its first step leaves nothing behind"


def test_bad_flag_values_get_one_line(capsys):
    for argv, says in [(["--lr", "0.1"], "unrecognized arguments: --lr 0.1"),  # not --lr_stage_scales 0.1
                       (["--val_tok", "1024"], "unrecognized arguments: --val_tok"),
                       (["--fp8_head", "yes"], "argument --fp8_head: expected 1, 0, true or false, not 'yes'"),
                       (["--num_steps", "ten"], "argument --num_steps: invalid int value: 'ten'"),
                       (["--no_attn_layers", "a,b"], "expected comma-separated integers")]:
        with pytest.raises(SystemExit) as e:
            tg.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_corrupt_shards_and_unwritable_log_dirs(sample_shards, tmp_path):
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "x_train_000001.bin", [1, 2, 3], count=9)
    args = tiny_args(sample_shards, tmp_path / "logs")
    args[args.index("--train_files") + 1] = str(tmp_path / "data" / "x_train_*.bin")
    with pytest.raises(SystemExit, match="x_train_000001.bin: header says 9 tokens.*truncated or corrupt"):
        tg.main(args)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match="cannot write to --log_dir .*a_file/logs.*pick a writable folder"):
        tg.main(tiny_args(sample_shards, tmp_path / "a_file" / "logs"))


def test_an_existing_log_is_never_overwritten(sample_shards, run6):
    d, full = run6
    with pytest.raises(SystemExit, match="r.txt exists: pass another --run_id, or --resume"):
        tg.main(resume_args(sample_shards, d, "--run_id", "r"))
    assert (d / "r.txt").read_text() == full


@pytest.mark.parametrize("world,batch,counts", [(3, "8,16,24", "1, 2, 4, 8"), (4, "2", "1, 2"),
                                                (5, "12", "1, 2, 3, 4, 6, 12"), (4, "6,12", "1, 2, 3, 6")])
def test_world_size_message_lists_the_counts_that_run(monkeypatch, world, batch, counts):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit, match=f"launch with --nproc_per_node \\(x nodes\\) in {counts}, the common "
                                         f"divisors"):
        tg.main(["--device", "cpu", "--batch_seqs", batch])


def test_help_lists_every_flag():
    """--help through the real entry point: exit 0 and every hyperparameter listed. Help strings are plain text:
    a % in one (once '2% faster', which crashed --help) must print as itself."""
    out = subprocess.run([sys.executable, str(REPO / "train_gpt.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    for f in tg.dataclasses.fields(tg.Hyperparameters):
        assert f"--{f.name} " in out.stdout, f.name
    assert "--preset {books,smoke}" in out.stdout
    parser = tg.argparse.ArgumentParser()
    f = tg.dataclasses.field(default=2, metadata={"help": "2% faster, 100 %s"})
    f.name = "x"
    parser.add_argument("--x", help=tg.help_text(f))
    assert "2% faster, 100 %s (default: 2)" in " ".join(parser.format_help().split())


def test_refuses_to_run_without_gpu_unless_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        tg.main([])


def test_the_command_line_prints_one_line_and_exits_non_zero(tmp_path):
    """Through the real entry point: no traceback, one line on stderr, exit 1."""
    out = subprocess.run([sys.executable, str(REPO / "train_gpt.py"), "--device", "cpu", "--train_files",
                          str(tmp_path / "none_*.bin"), "--log_dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: no shards match")


# ---- GPU failures a flag fixes

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.21 GiB")


@pytest.mark.parametrize("error,flags,says", [
    # the tiny run's auto micro-batch is 2 of its 2 and 4 sequences: 1 is the smaller one to offer
    (OOM, [], "out of GPU memory with --seq_len 128: run fewer sequences per pass than its 2 \\(--micro_batch 1\\), "
              "or .* e.g. --seq_len 64 --batch_seqs 4,8 "),
    (OOM, ["--micro_batch", "1"], "--seq_len 128: it ran one sequence per pass: keep the tokens per step in shorter "
                                  "micro-batches, e.g. --seq_len 64"),
    # how Inductor reports a Flex backward that does not fit a 99 KiB GPU (pytorch/pytorch#133254)
    (RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_"
                  "backward_1 Required: 114688 Hardware limit:101376"), [], "run with --flex_tiles small$")])
def test_gpu_failures_that_a_flag_fixes_name_the_flag(sample_shards, tmp_path, monkeypatch, error, flags, says):
    """The line names a flag that fixes it; for memory, a smaller micro-batch than the run's where there is one."""
    def fail(t, step):
        raise error
    monkeypatch.setattr(tg, "train_step", fail)
    with pytest.raises(SystemExit, match=says):
        tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--run_id", "oom", *flags)
    assert (tmp_path / "oom.txt").read_text().splitlines()[-1].startswith("error: ")


def test_other_errors_keep_their_traceback(sample_shards, tmp_path, monkeypatch):
    def fail(t, step):
        raise RuntimeError("a bug")
    monkeypatch.setattr(tg, "train_step", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "2")


def test_flex_tiles_fit_the_gpus_shared_memory():
    """Shared memory per block (opt-in) of an RTX 3090/4090 (sm_86/89), an A100 and an H100/H200."""
    consumer, a100, hopper = 101_376, 166_912, 232_448
    assert tg.choose_flex_tiles("auto", consumer, (8, 6)) == tg.FLEX_SMALL_TILES
    assert tg.choose_flex_tiles("auto", a100, (8, 0)) is None
    assert tg.choose_flex_tiles("auto", hopper, (9, 0)) == tg.FLEX_HOPPER_TILES  # forward tiles only
    assert not [k for k in tg.FLEX_HOPPER_TILES if not k.startswith("fwd_")]
    assert tg.choose_flex_tiles("default", hopper, (9, 0)) is None
    assert tg.choose_flex_tiles("small", hopper, (9, 0)) == tg.FLEX_SMALL_TILES
    assert tg.choose_flex_tiles("default", consumer, (8, 6)) is None
    # the tiles must tile the BlockMask's 128-token blocks
    for tiles in (tg.FLEX_SMALL_TILES, tg.FLEX_HOPPER_TILES):
        assert all(tg.MASK_BLOCK % v == 0 for k, v in tiles.items() if "BLOCK" in k)


# ---- round two (issue 19): no run deletes or corrupts another's files, no wrecked run exits 0

def test_run_ids_are_plain_file_names_and_pruning_matches_them_exactly(sample_shards, tmp_path):
    """A run_id was a glob pattern: `--run_id 'r?' --keep_last 1` deleted run rX's checkpoint."""
    other = tmp_path / "rX_step000002.pt"
    other.write_bytes(b"run rX's checkpoint")
    for run_id, says in [("r?", "--run_id 'r\\?' is not a plain file name"), ("sub/x", "is not a plain file name"),
                         ("x" * 300, "--run_id 'x{60}'... is not a plain file name")]:
        with pytest.raises(SystemExit, match=says) as e:
            tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--save_every", "1", "--keep_last", "1",
                     "--run_id", run_id)
        assert "--log_dir" not in str(e.value)
    assert other.read_bytes() == b"run rX's checkpoint"
    # a run's own checkpoints are the ones named exactly <run_id>_stepNNNNNN.pt
    (tmp_path / "r_step9.pt").write_bytes(b"not a checkpoint of r's")
    tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--save_every", "1", "--keep_last", "1", "--run_id", "r")
    assert sorted(p.name for p in tmp_path.glob("r*.pt")) == ["rX_step000002.pt", "r_step000002.pt", "r_step9.pt"]


def test_resume_under_a_new_run_id_starts_a_log_of_its_own(sample_shards, run6, tmp_path):
    d, full = run6
    tg.main(resume_args(sample_shards, tmp_path, "--run_id", "again", "--resume", str(d / "r_step000003.pt")))
    log = (tmp_path / "again.txt").read_text()
    assert log.startswith(open(tg.__file__).read()) and "\nconfig:{" in log and "\nresumed_from:" in log
    run = tool.parse_log(tmp_path / "again.txt")
    assert run.config["num_steps"] == 6 and run.final[0] == 6 and [s for s, *_ in run.train] == [4, 5, 6]
    assert losses(log) == {s: v for s, v in losses(full).items() if s > 3}


def test_resume_without_a_run_id_continues_its_own_log(sample_shards, run6, tmp_path):
    d, full = run6
    shutil.copytree(d, tmp_path / "r")
    tg.main(resume_args(sample_shards, tmp_path / "r", "--resume", str(tmp_path / "r" / "r_step000003.pt")))
    assert [p.name for p in (tmp_path / "r").glob("*.txt")] == ["r.txt"]
    assert (tmp_path / "r" / "r.txt").read_text().startswith(full)


def test_resume_never_continues_another_runs_log(sample_shards, run6, tmp_path):
    d, full = run6
    shutil.copytree(d, tmp_path / "r")
    ckpt = torch.load(d / "r_step000003.pt", weights_only=True)
    ckpt["run_id"] = "q"  # the same settings, another run
    torch.save(ckpt, tmp_path / "q_step000003.pt")
    with pytest.raises(SystemExit, match="r.txt is the log of run r, and .*q_step000003.pt is a checkpoint of "
                                         "run q: pass --run_id q"):
        tg.main(resume_args(sample_shards, tmp_path / "r", "--run_id", "r", "--resume",
                            str(tmp_path / "q_step000003.pt")))
    assert (tmp_path / "r" / "r.txt").read_text() == full


def test_resume_refuses_data_that_changed(sample_shards, tmp_path):
    tokens = tg.load_shard(str(sample_shards / "sample_train_000001.bin"))
    data = tmp_path / "data"
    data.mkdir()
    half = len(tokens) // 2
    write_shard(data / "t_000001.bin", tokens[:half])
    write_shard(data / "t_000002.bin", tokens[half:])
    args = tiny_args(sample_shards, tmp_path, "--num_steps", "4", "--save_every", "2", "--run_id", "d")
    args[args.index("--train_files") + 1] = str(data / "t_*.bin")
    tg.main(args + ["--keep_last", "0"])
    resume = args + ["--resume", str(tmp_path / "d_step000002.pt"), "--run_id", "d2"]
    changed = tokens[:half].copy()
    changed[5000] = (changed[5000] + 1) % 50000
    write_shard(data / "t_000001.bin", changed)
    with pytest.raises(SystemExit, match="shard t_000001.bin \\(--train_files\\) is not the one the checkpoint "
                                         "read: the same size, other content"):
        tg.main(resume)
    write_shard(data / "t_000001.bin", tokens[:half])
    (data / "t_000002.bin").unlink()
    with pytest.raises(SystemExit, match="matches 1 shards, and 2 when the checkpoint was written \\(missing now: "
                                         "t_000002.bin\\)"):
        tg.main(resume)
    assert not (tmp_path / "d2.txt").exists()


def test_a_shard_changed_near_either_end_is_caught_by_its_fingerprint(tmp_path):
    """Real shards are 200 MB, larger than any prefix a shortcut could read: a 3 MB shard whose first or last
    tokens change (the same size) no longer has the fingerprint a checkpoint recorded of it."""
    tokens = np.random.default_rng(0).integers(0, 50000, 1_500_000)
    path = tmp_path / "big_000001.bin"
    write_shard(path, tokens)
    then = [tg.shard_fingerprint(str(path))]
    for at in (10, len(tokens) - 100):
        changed = tokens.copy()
        changed[at] += 1
        write_shard(path, changed)
        assert tg.data_changes("--train_files", "x", then, [tg.shard_fingerprint(str(path))]) == (
            "shard big_000001.bin (--train_files) is not the one the checkpoint read: the same size, other content"), at
    write_shard(path, tokens)
    assert tg.data_changes("--train_files", "x", then, [tg.shard_fingerprint(str(path))]) == ""


def test_a_full_disk_gets_one_line_and_leaves_no_log_or_half_file(sample_shards, tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def zip_writer_fails(obj, f):  # how torch.save reports a write that ran out of space
        calls.append(1)
        if len(calls) == 2:
            f.write(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 2112 vs 2034")
        real_save(obj, f)

    monkeypatch.setattr(tg.torch, "save", zip_writer_fails)
    with pytest.raises(SystemExit, match="could not write checkpoint .*k_step000002.pt \\(torch.save: .*unexpected "
                                         "pos.* MiB free on that disk\\); the newest complete one, .*k_step000001.pt"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--save_every", "1", "--run_id", "k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.txt", "k_step000001.pt"]
    monkeypatch.undo()
    real_write = tg.Path.write_text

    def header_fails(self, text, *args, **kwargs):
        if self.name.startswith(".full.txt"):
            real_write(self, text[:100], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(tg.Path, "write_text", header_fails)
    with pytest.raises(SystemExit, match="cannot write the log .*full.txt \\(No space left on device\\)"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "1", "--extension_steps", "0", "--run_id", "full")
    assert not [p for p in tmp_path.iterdir() if "full" in p.name], "no empty log to block a re-run"
    monkeypatch.undo()
    tiny_run(sample_shards, tmp_path, "--num_steps", "1", "--extension_steps", "0", "--run_id", "full")


def test_two_launches_with_one_run_id_share_no_file(sample_shards, tmp_path, monkeypatch):
    real = tg.check_log_dir

    def the_other_launch_starts_meanwhile(cfg, log_path, comm, *rest):
        real(cfg, log_path, comm, *rest)
        log_path.write_text("the other launch's log\n")

    monkeypatch.setattr(tg, "check_log_dir", the_other_launch_starts_meanwhile)
    with pytest.raises(SystemExit, match="twin.txt exists: another launch with this --run_id took it first"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "1", "--extension_steps", "0", "--run_id", "twin")
    assert (tmp_path / "twin.txt").read_text() == "the other launch's log\n"
    # and each checkpoint write goes through a .tmp file of its own
    names = []
    monkeypatch.setattr(tg.os, "replace", lambda a, b: names.append(a.name) or shutil.move(a, b))
    for _ in range(2):
        tg.write_durably({"x": 1}, tmp_path / "twin_step000001.pt")
    assert len(set(names)) == 2 and "twin_step000001.tmp" not in names


def test_shard_globs_that_name_folders_or_broken_links(sample_shards, tmp_path):
    data = tmp_path / "data"
    (data / "x_train_dir.bin").mkdir(parents=True)
    os.symlink(tmp_path / "gone.bin", data / "y_train_000001.bin")
    for pattern, says in [(str(data), "--train_files '.*data' is a folder: pass a glob of its shards, e.g. "
                                      "'.*data/\\*.bin'"),
                          (str(data / "x_*.bin"), "matches the folder .*x_train_dir.bin"),
                          (str(data / "y_*.bin"),
                           "y_train_000001.bin is a link to '.*gone.bin', which does not exist")]:
        args = tiny_args(sample_shards, tmp_path / "logs", "--num_steps", "1", "--extension_steps", "0")
        args[args.index("--train_files") + 1] = pattern
        with pytest.raises(SystemExit, match=says) as e:
            tg.main(args)
        assert "\n" not in str(e.value)


def test_every_shard_is_checked_before_the_log(sample_shards, tmp_path):
    """A later shard without a document start, or with a token beyond GPT-2's, is refused before step 0 (it was
    skipped, or found an hour in); so is a train glob that also matches the val shard."""
    tokens = tg.load_shard(str(sample_shards / "sample_train_000001.bin"))
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "n_000001.bin", tokens)
    write_shard(data / "n_000002.bin", np.arange(5000) % 50000)
    args = tiny_args(sample_shards, tmp_path / "logs", "--num_steps", "1", "--extension_steps", "0")
    args[args.index("--train_files") + 1] = str(data / "n_*.bin")
    with pytest.raises(SystemExit, match="n_000002.bin holds no document start"):
        tg.main(args)
    bad = tokens.copy()
    bad[-3] = 50300
    write_shard(data / "n_000002.bin", bad)
    with pytest.raises(SystemExit, match="n_000002.bin: token 50300 at position"):
        tg.main(args)
    assert not (tmp_path / "logs").exists() or [p.name for p in (tmp_path / "logs").iterdir()] == []
    args[args.index("--train_files") + 1] = str(sample_shards / "sample_*.bin")
    with pytest.raises(SystemExit, match="--train_files also matches .*sample_val_000000.bin, a shard --val_files "
                                         "scores"):
        tg.main(args)


def test_checkpoints_with_the_right_keys_and_wrong_contents(sample_shards, run6, tmp_path):
    d, _ = run6
    good = torch.load(d / "r_step000003.pt", weights_only=True)
    for name, change, says in [("config", "text", "config is a str"), ("step", "3", "step is a str")]:
        torch.save({**good, name: change}, tmp_path / "bad.pt")
        for argv in (resume_args(sample_shards, tmp_path / "logs", "--resume", str(tmp_path / "bad.pt")),
                     ["--generate", str(tmp_path / "bad.pt"), "--prompt", "hi", "--device", "cpu"]):
            with pytest.raises(SystemExit, match=says) as e:
                tg.main(argv)
            assert "\n" not in str(e.value)
    torch.save({**good, "config": {**good["config"], "old_flag": 1}}, tmp_path / "older.pt")
    with pytest.raises(SystemExit, match="another version of train_gpt.py, with settings this one does not know: "
                                         "old_flag"):
        tg.main(resume_args(sample_shards, tmp_path / "logs", "--resume", str(tmp_path / "older.pt")))
    # an older version's checkpoint, resumed alone: it lacks settings of this one (here those of 2026-05-27's
    # port), whose defaults would build another model (and do not fit its layout): which version to run, first
    before = {k: v for k, v in good["config"].items() if k not in ("mudd_gate", "xsa_layers")}
    torch.save({**good, "config": before}, tmp_path / "before_gate.pt")
    with pytest.raises(SystemExit, match="another version of train_gpt.py, with none of this one's settings "
                                         "mudd_gate, xsa_layers\\. .*records/tool.py source LOG") as e:
        tg.main(["--resume", str(tmp_path / "before_gate.pt")])
    assert "\n" not in str(e.value)
    torch.save({**good, "config": {**good["config"], "model_dim": 128, "head_dim": 64}}, tmp_path / "misfit.pt")
    with pytest.raises(SystemExit, match="its weights do not fit the model its settings describe") as e:
        tg.main(["--generate", str(tmp_path / "misfit.pt"), "--prompt", "hi", "--device", "cpu"])
    assert "another version" not in str(e.value)  # this version wrote it: its settings are what is wrong
    # an older version's checkpoint (before --mudd, its backout layer where MUDD cannot work): which version to run
    older = {**good, "source_sha256": "0" * 64, "config": {k: v for k, v in good["config"].items() if k != "mudd"}}
    torch.save({**older, "config": {**older["config"], "backout_layer": 2}}, tmp_path / "older_gen.pt")
    with pytest.raises(SystemExit, match="cannot build a model from .*another version of train_gpt.py wrote it "
                                         "\\(its source sha256 starts 0000000000000000\\): sample with that "
                                         "version.*records/tool.py source LOG") as e:
        tg.main(["--generate", str(tmp_path / "older_gen.pt"), "--prompt", "hi", "--device", "cpu"])
    assert "\n" not in str(e.value)
    torch.save({**older, "config": {**older["config"], "model_dim": 128, "head_dim": 64}}, tmp_path / "older_misfit.pt")
    with pytest.raises(SystemExit, match="do not fit the model .*another version of train_gpt.py wrote it"):
        tg.main(["--generate", str(tmp_path / "older_misfit.pt"), "--prompt", "hi", "--device", "cpu"])


def test_generate_on_a_cuda_device_without_one(run6, monkeypatch):
    d, _ = run6
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA GPU is visible; pass --device cpu"):
        tg.main(["--generate", str(d / "r_step000003.pt"), "--prompt", "hi", "--device", "cuda"])


def test_ctrl_c_during_a_save_is_one_line(sample_shards, tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def interrupted(obj, f):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(obj, f)

    monkeypatch.setattr(tg.torch, "save", interrupted)
    with pytest.raises((SystemExit, KeyboardInterrupt)) as e:
        tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--save_every", "1", "--run_id", "c")
    assert e.type is SystemExit and "\n" not in str(e.value)
    newest = tmp_path / "c_step000001.pt"
    # step 2's checkpoint is written once step 3 has judged its weights: that write was interrupted
    assert str(e.value) == f"error: interrupted at step 3; the newest complete checkpoint is {newest}"
    assert (tmp_path / "c.txt").read_text().splitlines()[-1] == str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "c_step000001.pt"]


def test_readme_lists_the_settings_that_may_change_on_resume():
    readme = (REPO / "README.md").read_text()
    listed = readme.split("These may change on resume:")[1].split("(logged")[0]
    names = set(re.findall(r"[a-z_0-9]+", " ".join(re.findall(r"`([^`]*)`", listed))))
    assert names == set(tg.RESUME_FREE + tg.RESUME_ADJUSTABLE) - {"resume"}


def test_logs_are_created_exclusively_without_hard_links_too(tmp_path, monkeypatch):
    """File systems without hard links (some network and FAT ones) get an exclusive, if not atomic, create."""
    def no_hard_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(tg.os, "link", no_hard_links)
    tg.start_log(tmp_path / "a.txt", tg.__file__)
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    assert (tmp_path / "a.txt").read_text().startswith(open(tg.__file__).read())
    with pytest.raises(tg.UserError, match="a.txt exists: another launch"):
        tg.start_log(tmp_path / "a.txt", tg.__file__)


# ---- round three (issue 31): recovery from divergence, checked checkpoints, one process per run, interrupts

def test_a_run_that_does_not_learn_stops_naming_a_healthy_checkpoint_that_pruning_kept(sample_shards, tmp_path):
    """Weights blown up by a huge Adam lr keep a finite loss above a uniform guess's: not a run to exit 0. The
    checkpoints written after the loss rose above a uniform guess's are marked unhealthy; the error names the
    newest healthy one, which --keep_last 1 has not deleted. (Without MUDD and the MUDD gate: their per-token
    products of weights at such rates overflow bf16 within 3 steps: a divergence,
    test_divergence_stops_the_run_without_a_bad_checkpoint.)"""
    with pytest.raises(SystemExit) as e:
        tiny_run(sample_shards, tmp_path, "--num_steps", "10", "--batch_seqs", "1", "--adam_lr", "100", "--mudd", "0",
                 "--mudd_gate", "0", "--dc_layers=", "--save_every", "1", "--keep_last", "1", "--run_id", "blown")
    assert "at step 10" in str(e.value) and "no better than guessing uniformly among 50,304 tokens (ln 50304 = " \
           "10.8258)" in str(e.value) and "lower learning rates (--muon_lr" in str(e.value)
    log = (tmp_path / "blown.txt").read_text()
    assert log.splitlines()[-1].startswith("error: ") and "healthy:no" in log
    named = re.search(r"Newest good checkpoint: (\S+)\.", str(e.value)).group(1)
    good = torch.load(named, weights_only=True)
    assert good["healthy"] and good["step"] < 10
    newest = max(tmp_path.glob("blown_step*.pt"))
    assert newest != Path(named) and not torch.load(newest, weights_only=True)["healthy"]


@pytest.mark.parametrize("rates,says", [
    (("0", "0"), "the learning rates are 0 (--muon_lr 0 --adam_lr 0; the record's: 0.023 and 0.008), so nothing trains"),
    (("1e-9", "1e-9"), "the run is not learning, not diverging. Its learning rates are too low to move it "
                       "(--muon_lr 1e-09 --adam_lr 1e-09; the record's: 0.023 and 0.008): raise them"),
])
def test_learning_rates_too_low_to_learn_are_not_called_a_divergence(sample_shards, tmp_path, rates, says):
    """A loss that stays at a uniform guess's with weights that stayed in range (here: rates of 0, or a millionth
    of the record's) is not a divergence, and lower rates would not help: the message says what it is."""
    with pytest.raises(SystemExit) as e:
        tiny_run(sample_shards, tmp_path, "--num_steps", "10", "--batch_seqs", "1", "--muon_lr", rates[0],
                 "--adam_lr", rates[1])
    assert says in str(e.value)
    assert "diverged" not in str(e.value) and "lower learning rates" not in str(e.value)


def test_checkpoints_are_checked_when_read(sample_shards, run6, tmp_path):
    """A flipped byte in the tensors (torch's zip reader does not check), non-finite weights, a step or data
    position below 0 or an infinite time: --resume and --generate refuse each in one line."""
    d, _ = run6
    good_path = d / "r_step000003.pt"
    raw = bytearray(good_path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    good = torch.load(good_path, weights_only=True)

    def rewritten(name, **changes):
        ckpt = {**good, **changes}
        ckpt["content_sha256"] = tg.content_digest(ckpt["model"], ckpt["optimizer"])
        torch.save(ckpt, tmp_path / name)
        return tmp_path / name

    nan_model = {k: v.clone() for k, v in good["model"].items()}
    nan_model["head_w"][0, 0] = float("nan")
    cases = [(tmp_path / "flipped.pt", "do not match the hash written with them: the file is corrupt"),
             (rewritten("nan.pt", model=nan_model), "its weights are not finite \\(head_w"),
             (rewritten("negative.pt", step=-3), "step -3 and train_ms"),
             (rewritten("doc.pt", loader={"shard": 0, "doc": -1}), "data position is not two integers of 0 or more"),
             (rewritten("time.pt", train_ms=float("inf")), "the step and time must be 0 or more")]
    for path, says in cases:
        for argv in (resume_args(sample_shards, tmp_path / "logs", "--resume", str(path)),
                     ["--generate", str(path), "--prompt", "hi", "--device", "cpu"]):
            with pytest.raises(SystemExit, match=says) as e:
                tg.main(argv)
            assert "\n" not in str(e.value), argv
    assert not list((tmp_path / "logs").glob("*.txt")) if (tmp_path / "logs").exists() else True


def test_a_foreign_pickle_is_called_what_it_is(sample_shards, tmp_path):
    torch.save({"model": _RunsCode(str(tmp_path / "pwned"))}, tmp_path / "evil.pt")
    for argv in (resume_args(sample_shards, tmp_path, "--resume", str(tmp_path / "evil.pt")),
                 ["--generate", str(tmp_path / "evil.pt"), "--prompt", "hi", "--device", "cpu"]):
        with pytest.raises(SystemExit, match="not a checkpoint of this trainer: it holds objects other than") as e:
            tg.main(argv)
        assert "weights_only" not in str(e.value)
    assert not (tmp_path / "pwned").exists()


def test_a_second_launch_of_a_live_run_is_refused(sample_shards, tmp_path):
    """Another process holds the run's lock: refused in one line, leaving its files alone; once that process is
    gone (however it ended), the run_id is free."""
    lock = tmp_path / ".live.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a+')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nf.write('pid 4242 on elsewhere'); f.flush()\n"
                               "print('held', flush=True)\ntime.sleep(60)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match="run live is running already \\(pid 4242 on elsewhere holds .*live.lock\\)"):
            tiny_run(sample_shards, tmp_path, "--num_steps", "1", "--extension_steps", "0", "--run_id", "live")
        assert sorted(p.name for p in tmp_path.iterdir()) == [".live.lock"]
    finally:
        holder.kill()
        holder.wait()
    tiny_run(sample_shards, tmp_path, "--num_steps", "1", "--extension_steps", "0", "--run_id", "live")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.txt"]  # the lock file goes with the run


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside(sample_shards, run6, tmp_path):
    d, _ = run6
    shutil.copytree(d, tmp_path / "r")
    log = tg.main(resume_args(sample_shards, tmp_path / "r", "--keep_last", "2", "--resume",
                              str(tmp_path / "r" / "r_step000003.pt"))).read_text()
    assert "note:later_checkpoints_set_aside steps:6" in log
    names = sorted(p.name for p in (tmp_path / "r").glob("r_step*"))
    assert names == ["r_step000003.pt", "r_step000006.abandoned.pt", "r_step000006.pt"]


def test_a_full_disk_while_appending_to_the_log_is_one_line_and_no_half_line(tmp_path, monkeypatch):
    """A write that stops part-way (the disk filled): the part is cut off again, one UserError names the cause and
    the checkpoint to resume from; a close that fails too (where a buffered file reported the full disk, a
    traceback once came from) changes nothing."""
    real_write, real_close = os.write, os.close

    def full(fd, data):
        real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failing_close(fd):
        real_close(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    (tmp_path / "x.txt").write_text("first line\n")
    monkeypatch.setattr(tg.os, "write", full)
    monkeypatch.setattr(tg.os, "close", failing_close)
    with pytest.raises(tg.UserError, match="cannot append to the log .*x.txt \\(No space left on device\\): free disk "
                                           "space, then resume from the newest checkpoint, c.pt$"):
        tg.append_line(tmp_path / "x.txt", "step:2/3 train_loss:1.0", "c.pt")
    with pytest.raises(tg.UserError, match="then start the run again \\(no checkpoint was written yet\\)$"):
        tg.append_line(tmp_path / "x.txt", "step:2/3 train_loss:1.0")
    monkeypatch.undo()
    assert (tmp_path / "x.txt").read_text() == "first line\n"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (a real file system that fills up), or a skip where this machine cannot mount one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()[:100]}")
    yield mnt
    subprocess.run(["umount", str(mnt)])


def test_a_disk_that_fills_during_a_run_is_one_line(sample_shards, small_disk):
    """A real full disk under a running trainer: once its log cannot grow, the run ends with one error line (no
    traceback), the log's last line is whole, and no lock file is left."""
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(sample_shards, small_disk),
                             "--num_steps", "500", "--val_every", "0", "--run_id", "full"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = small_disk / "full.txt"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not log.exists() or log.read_text().count("\nstep:") < 3):
            time.sleep(0.05)
        with open(small_disk / "filler", "wb", buffering=0) as f:  # take every byte left
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 4096)
        err = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: cannot append to the log")
    assert log.read_text().endswith("\n") and not (small_disk / ".full.lock").exists()


def test_an_unreadable_shard_is_one_line(sample_shards, tmp_path, monkeypatch):
    """A shard the user may not read (mode 000 for a non-root user): one line naming it, from the header check
    and from the token read."""
    for target in ("getsize", "fromfile"):
        real = getattr(tg.os.path if target == "getsize" else tg.np, target)

        def denied(path, *a, real=real, **k):
            if str(path).endswith("sample_train_000001.bin"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(tg.os.path if target == "getsize" else tg.np, target, denied)
        with pytest.raises(tg.ShardFormatError,
                           match="sample_train_000001.bin: cannot read it \\(Permission denied\\)"):
            tg.load_shard(str(sample_shards / "sample_train_000001.bin"))
        monkeypatch.undo()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_shard_without_read_permission_is_one_line(sample_shards, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(sample_shards, shards)
    (shards / "sample_train_000001.bin").chmod(0)
    out = subprocess.run([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(shards, tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "cannot read it (Permission denied)" in out.stderr.strip().splitlines()[-1]


def test_interrupts_and_sigterm_are_one_line(sample_shards, tmp_path, monkeypatch):
    """Ctrl-C while compiling: no step was trained, and the new run leaves no log. SIGTERM while a checkpoint is
    written: one line naming the newest complete checkpoint, no .tmp left."""
    def ctrl_c(trainer):
        raise KeyboardInterrupt
    monkeypatch.setattr(tg, "warm_up", ctrl_c)
    with pytest.raises(SystemExit, match="^error: interrupted before the first step \\(while starting or compiling\\): "
                                         "no step was trained$"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--run_id", "w")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    real_save, calls = torch.save, []

    def sigterm(obj, f):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        real_save(obj, f)

    monkeypatch.setattr(tg.torch, "save", sigterm)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--save_every", "1", "--run_id", "s")
    # step 2's checkpoint is written once step 3 has judged its weights: that write was cut off
    assert str(e.value) == f"error: terminated (SIGTERM) at step 3; the newest complete checkpoint is " \
                           f"{tmp_path / 's_step000001.pt'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.txt", "s_step000001.pt"]
    assert signal.getsignal(signal.SIGTERM) == handler  # main() puts the handler back


@pytest.mark.parametrize("sig,how", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated (SIGTERM)")])
def test_ctrl_c_or_sigterm_while_torch_imports_is_one_line(sample_shards, tmp_path, sig, how):
    """Ctrl-C or SIGTERM half a second after launch, while torch imports: one line, exit 1, and no log folder,
    log or lock left behind (SIGTERM used to end the process silently with 143)."""
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(sample_shards, logs)],
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # importing torch takes seconds
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    # where the 0.5 s fell (importing torch takes 1-2 s here) decides which of the two lines it is
    assert proc.returncode == 1 and err in (f"error: {how} while starting (importing torch): nothing was trained or "
                                            f"written\n",
                                            f"error: {how} before the first step (while starting or compiling): "
                                            f"no step was trained\n"), err
    assert not logs.exists()


@pytest.mark.parametrize("argv,says", [
    (["--temperature", "nan"], "--temperature must be a finite number, 0 or more \\(it is nan\\)$"),
    (["--temperature", "-1"], "--temperature must be a finite number, 0 or more \\(it is -1.0\\)$"),
    (["--temperature", "inf"], "--temperature must be a finite number, 0 or more \\(it is inf\\)$"),
    (["--top_k", "-5"], "--top_k must be 0 or more \\(it is -5\\)$"),
    (["--seed", str(2**70)], "--seed must be at least 0 and below 2\\^63 \\(it is 1180591620717411303424\\)$"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be positive \\(it is 0\\)$"),
])
def test_generate_refuses_values_that_cannot_be_right(run6, argv, says):
    """One line naming the flag that is wrong and its value, and no other flag."""
    d, _ = run6
    with pytest.raises(SystemExit, match=says) as e:
        tg.main(["--generate", str(d / "r_step000003.pt"), "--prompt", "hi", "--device", "cpu", *argv])
    assert "\n" not in str(e.value) and str(e.value).count("--") == 1


def test_a_wrong_shape_says_which_weight(sample_shards, run6, tmp_path):
    d, _ = run6
    good = torch.load(d / "r_step000003.pt", weights_only=True)
    model = {**good["model"], "x0_lambdas": torch.zeros(5)}
    torch.save({**good, "model": model, "content_sha256": tg.content_digest(model, good["optimizer"])},
               tmp_path / "shape.pt")
    with pytest.raises(SystemExit, match="does not fit this model: Error\\(s\\) in loading state_dict for GPT: .*"
                                         "x0_lambdas"):
        tg.main(resume_args(sample_shards, tmp_path / "logs", "--resume", str(tmp_path / "shape.pt")))


def test_presets_build_and_flags_beside_them_win():
    for name in tg.PRESETS:
        cfg = tg.parse_args(["--preset", name])
        tg.check_config(cfg)
        # the shipped books under the script's folder, wherever the run is launched from
        assert cfg.device == "cpu" and cfg.train_files == str(REPO / "data/sample_shards/sample_train_*.bin")
    assert tg.parse_args(["--preset", "smoke", "--num_steps", "7"]).num_steps == 7
    assert tg.parse_args(["--num_steps", "7", "--preset", "smoke"]).num_steps == 7


def quick_start_block() -> str:
    readme = (REPO / "README.md").read_text()
    return readme.split("## Quick start on a CPU")[1].split("```bash")[1].split("```")[0]


def test_the_readme_sections_the_messages_point_to_exist():
    """A message that sends the user to a README section ("README: Resume", "README.md, Quick start") names a
    heading the README has: the source's one-line references and the out-of-memory line, built as a run
    would."""
    headings = [line.lstrip("#").strip() for line in (REPO / "README.md").read_text().splitlines()
                if line.startswith("## ") or line.startswith("### ")]
    oom = tg.gpu_error_message(torch.OutOfMemoryError("x"), tg.Hyperparameters(), 4)
    named = re.findall(r"README(?:\.md)?[:,] ([A-Z][A-Za-z ]*[a-z])", (REPO / "train_gpt.py").read_text() + oom)
    assert len(named) >= 3 and "GPUs and memory" in named, named
    for section in named:
        assert any(h.startswith(section) for h in headings), (section, headings)


def test_the_readmes_commands_name_what_exists():
    """The quick start's commands: every script and flag it names exists, and its CPU block reruns (a fresh
    run_id each time)."""
    block = quick_start_block()
    for script in re.findall(r"python (\S+\.py)", block):
        assert (REPO / script).exists(), script
    flags = {f"--{f.name}" for f in tg.dataclasses.fields(tg.Hyperparameters)} | {
        "--preset", "--generate", "--prompt", "--max_new_tokens"}
    for line in block.splitlines():
        if "train_gpt.py" in line:
            assert set(re.findall(r"--[a-z_]+", line)) <= flags, line
    assert "--run_id smoke_$(date +%s)" in block
    assert "-r records/requirements.txt" in block.strip().splitlines()[0]  # it installs what its last line runs


def test_the_quick_start_runs_on_a_fresh_copy(tmp_path):
    """The README's CPU block, line by line as written, in a copy of the repo's files (no ../shared, no shards,
    no logs): every line exits 0 and says what the README says it does. The install line is the one left out
    (the suite runs where it is done)."""
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout: no list of the repo's files")
    for f in files:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, repo / f)
    out = []
    for line in quick_start_block().strip().splitlines()[1:]:
        run = subprocess.run(["bash", "-c", line.replace("python ", f"{sys.executable} ", 1)], cwd=repo,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (line, run.stderr[-2000:])
        out.append(run.stdout)
    tokenize, smoke, sample, plot = out
    assert "sample_val_000000.bin: 16,384 tokens" in tokenize and "summary:20/20_steps" in smoke
    assert sample.startswith("It was a dark night") and len(sample.split()) > 6
    assert re.search(r"wrote logs/curve.png \(1 run\(s\); val loss axis 8\.\d+\.\.10\.\d+", plot), plot
    assert not (repo / "curve.png").exists()  # the plot goes under logs/, which git ignores
    # the README's figures are this code's: its val losses and final val within the golden curve's tolerance
    readme = (REPO / "README.md").read_text()
    said = [float(v) for v in re.search(r"val lines at steps 0, 10 and 20 \(([\d.]+), ([\d.]+), ([\d.]+)\)",
                                        readme).groups()]
    got = [float(v) for v in re.findall(r"^step:(?:0|10|20)/20 val_loss:(\S+)", smoke, re.M)]
    assert len(got) == 3 and all(abs(a - b) <= 0.005 + GOLDEN_TOL for a, b in zip(said, got)), (said, got)
    final = float(re.search(r"summary:20/20_steps final_val:([\d.]+)", readme).group(1))
    assert abs(final - float(re.search(r"final_val:(\S+)", smoke).group(1))) <= GOLDEN_TOL


def test_a_micro_batch_longer_than_every_shard_says_so(sample_shards, tmp_path):
    with pytest.raises(SystemExit, match="no shard of .* holds --seq_len 262144 \\+ 1 tokens of documents .*lower "
                                         "--seq_len or use larger shards") as e:
        tiny_run(sample_shards, tmp_path, "--seq_len", "262144", "--num_steps", "1", "--extension_steps", "0")
    assert "must begin with" not in str(e.value)


# ---- round four (issue 37): healthy means the saved weights, one-line crashes, nothing silently accepted

@pytest.mark.parametrize("flags,bad_from", [
    (["--num_steps", "16", "--lr_stage_scales", "1,1e4", "--save_every", "3"], 9),  # stage 2's rates, at step 9
    (["--num_steps", "14", "--muon_lr", "1e3", "--adam_lr", "1e3", "--save_every", "1"], 1),  # the first update
])
def test_a_checkpoint_is_healthy_only_if_its_weights_are(sample_shards, tmp_path, flags, bad_from):
    """Round four's two silent cases: a checkpoint whose own weights were blown up by its step's update was
    marked healthy, judged by the loss before that update. Now each is judged by the loss its weights give (the
    next step's) and by its largest weight against the initial ones: the blown ones are healthy:no, the error
    names the newest checkpoint whose weights are still sane, or says there is none."""
    with pytest.raises(SystemExit) as e:
        tiny_run(sample_shards, tmp_path, *flags, "--keep_last", "1", "--run_id", "b")
    init = max(t.float().abs().max().item() for t in tg.GPT(tg.parse_args(tiny_args(sample_shards, tmp_path)))
               .state_dict().values())
    saved = {int(p.stem[-6:]): torch.load(p, weights_only=True) for p in tmp_path.glob("b_step*.pt")}
    for step, ckpt in saved.items():
        largest = max(t.float().abs().max().item() for t in ckpt["model"].values())
        assert ckpt["healthy"] == (step < bad_from), (step, largest / init)
        assert (largest < 10 * init) == ckpt["healthy"], (step, largest / init)  # blown means 1000s of times
    if bad_from > 1:
        assert f"Newest good checkpoint: {tmp_path / f'b_step{max(s for s in saved if s < bad_from):06d}.pt'}." \
            in str(e.value)
    else:
        assert "no healthy checkpoint was written. Start again with lower learning rates" in str(e.value)
    assert "--lr_stage_scales" in str(e.value)


def test_a_val_shard_copied_among_the_train_shards_is_refused(sample_shards, tmp_path):
    """Paths differ, bytes do not: the run would train on its validation data."""
    shards = tmp_path / "shards"
    shutil.copytree(sample_shards, shards)
    shutil.copy(shards / "sample_val_000000.bin", shards / "sample_train_000002.bin")
    with pytest.raises(SystemExit, match="sample_train_000002.bin holds the same bytes as the val shard "
                                         ".*sample_val_000000.bin"):
        tg.main(tiny_args(shards, tmp_path / "logs"))
    assert not (tmp_path / "logs").exists() or list((tmp_path / "logs").iterdir()) == []


def test_ctrl_c_inside_torch_save_is_called_an_interrupt(sample_shards, tmp_path, monkeypatch):
    """A signal that lands inside torch.save's C++ writer comes out as its RuntimeError ("unexpected pos"),
    with the KeyboardInterrupt as its context: an interrupt, not a disk to free."""
    real_save, calls = torch.save, []

    class Interrupting(io.RawIOBase):
        def __init__(self, f):
            self.f, self.n = f, 0

        def writable(self):
            return True

        def write(self, b):
            self.n += 1
            if self.n == 3:
                raise KeyboardInterrupt
            return self.f.write(b)

    def save(obj, f):
        calls.append(1)
        real_save(obj, Interrupting(f) if len(calls) == 2 else f)

    monkeypatch.setattr(tg.torch, "save", save)
    with pytest.raises(SystemExit) as e:
        tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--save_every", "1", "--run_id", "c")
    assert str(e.value) == f"error: interrupted at step 3; the newest complete checkpoint is " \
                           f"{tmp_path / 'c_step000001.pt'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "c_step000001.pt"]


def test_ctrl_c_before_any_checkpoint_says_there_is_none_yet(sample_shards, tmp_path, monkeypatch):
    real = tg.train_step

    def interrupted_at_2(trainer, step):
        if step == 1:
            raise KeyboardInterrupt
        return real(trainer, step)

    monkeypatch.setattr(tg, "train_step", interrupted_at_2)
    with pytest.raises(SystemExit, match="^error: interrupted at step 1; no checkpoint was written yet "
                                         "\\(--save_every K writes them\\)$"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "3", "--run_id", "i")


def test_a_refused_resume_leaves_no_lock(sample_shards, run6, tmp_path):
    d, _ = run6
    shutil.copytree(d, tmp_path / "r")
    ckpt = torch.load(d / "r_step000003.pt", weights_only=True)
    ckpt["run_id"] = "q"
    torch.save(ckpt, tmp_path / "q_step000003.pt")
    with pytest.raises(SystemExit, match="is the log of run r"):
        tg.main(resume_args(sample_shards, tmp_path / "r", "--run_id", "r", "--resume",
                            str(tmp_path / "q_step000003.pt")))
    assert not list((tmp_path / "r").glob(".*.lock"))


def test_a_torn_last_log_line_is_cut_and_lr_stage_scales_may_change_on_resume(sample_shards, run6, tmp_path):
    """A run killed mid-write leaves half a line; the resume's first line must not be glued onto it. And the flag
    that blew up the first case above is a learning rate: a resume may lower it, logged."""
    d, _ = run6
    shutil.copytree(d, tmp_path / "r")
    with open(tmp_path / "r" / "r.txt", "a") as f:
        f.write("step:7/30 train_loss:10.4")
    log = tg.main(resume_args(sample_shards, tmp_path / "r", "--lr_stage_scales", "1,1.2,1.4", "--adam_lr", "0.004",
                              "--resume", str(tmp_path / "r" / "r_step000003.pt")))
    text = log.read_text()
    assert "step:7/30" not in text and "\nnote:torn_last_line_removed bytes:25\nresumed_from:" in text
    assert "note:resumed_with_changed_learning_rates adam_lr:0.008->0.004 lr_stage_scales:1.0,1.52,1.73->1.0,1.2,1.4" \
        in text


def test_setup_does_not_grow_with_the_step_count(sample_shards, tmp_path):
    """--num_steps 10^8 once spent a minute before its first step (a table of every step's weights) and summed
    10^8 batch sizes for every log line's ETA: building, 3 steps and their log lines must take about what a
    20-step run's do."""
    times = []
    for n in (20, 10**8):
        t0 = time.time()
        flags = tiny_args(sample_shards, tmp_path, "--num_steps", str(n), "--run_id", f"n{n}")
        trainer = tg.build(tg.parse_args(flags))
        trainer.log_open = True
        for step in range(3):
            tg.log_train(trainer, tg.train_step(trainer, step))
        times.append(time.time() - t0)
        tg.release_lock(trainer.lock)
    assert times[1] < 2 * times[0] + 1, times


def test_tokens_before_equals_the_sum_over_steps():
    """The closed form by stages against the step-by-step sum, at step counts whose stages do not divide evenly."""
    for num_steps, ext, batch in [(1600, 40, (8, 16, 24)), (1001, 40, (8, 16, 24)), (17, 3, (1, 2, 3, 4)),
                                  (10, 9, (5, 7)), (100, 0, (3,))]:
        cfg = tg.Hyperparameters(num_steps=num_steps, extension_steps=ext, batch_seqs=batch)
        for step in range(num_steps + 1):
            assert tg.tokens_before(step, cfg) == sum(tg.batch_seqs_at(s, cfg) for s in range(step)) * cfg.seq_len


def test_a_non_finite_parameter_stops_the_run_at_that_step(sample_shards, tmp_path, monkeypatch):
    """An update that leaves a non-finite weight while the loss is still finite (it was computed before the
    update): the run stops at that step, logs no later step, writes no checkpoint of it, and says so. The third
    step's summed grads hold an inf, which its update spreads to the weights."""
    real_step = tg.ShardedOptimizer.step

    def step(opt, lr_factor, momentum):
        if opt.steps == 2:
            with torch.no_grad():
                opt.buckets[0].grad[0] = float("inf")
        real_step(opt, lr_factor, momentum)

    monkeypatch.setattr(tg.ShardedOptimizer, "step", step)
    with pytest.raises(SystemExit, match="the parameters became non-finite at step 3: the run diverged. Newest good "
                                         "checkpoint: .*i_step000002.pt"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "6", "--save_every", "1", "--run_id", "i")
    log = (tmp_path / "i.txt").read_text()
    assert "step:2/6 train_loss" in log and "step:3/6" not in log and "step:4/6" not in log
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["i_step000001.pt", "i_step000002.pt"]


@pytest.mark.parametrize("flags", [[], ["--preset", "books"], ["--value_embeds=-1,0,-1,1,2,-1,-1,-1,-1,-1,-1",
                                                              "--bigram_vocab", "0", "--no_attn_layers", "5,6"]])
def test_the_memory_check_counts_the_parameters_the_model_has(flags):
    """The analytic count the memory check uses (no second of meta-device imports at every launch) against the
    model itself built on the meta device, by dtype."""
    cfg = tg.parse_args(flags)
    with torch.device("meta"):
        model = tg.GPT(cfg)
    bf16, fp32 = (sum(p.numel() for p in model.parameters() if p.dtype == dt) for dt in (torch.bfloat16, torch.float32))
    assert tg.parameter_counts(cfg) == (bf16, fp32)


# ---- round five (issue 64)

def test_profile_steps_on_cpu_say_the_profile_needs_cuda(sample_shards, tmp_path):
    """--profile_steps on CPU used to be ignored without a word: the log says why there is no profile."""
    log = tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--profile_steps", "1,2", "--run_id", "p")
    assert "note:profile_steps_ignored why:the_profile_times_GPU_kernels:_it_needs_CUDA" in log.splitlines()
    assert not list(tmp_path.glob("*profile*"))


def test_a_failed_log_write_names_the_cause_the_system_gave(tmp_path, monkeypatch):
    """A log removed under a running run, and a file system turned read-only, are not a full disk: each failed
    append names its own cause and what to do, and only a full disk says to free space."""
    log = tmp_path / "r.txt"
    log.write_text("x\n")
    log.unlink()  # the log deleted mid-run
    with pytest.raises(tg.UserError, match="No such file or directory\\): the file or its folder was removed") as e:
        tg.append_line(log, "step:1", "ck.pt")
    assert "free disk space" not in str(e.value) and "resume from the newest checkpoint, ck.pt" in str(e.value)
    log.write_text("x\n")
    for code, says in ((errno.EROFS, "the file system is read-only: make it writable or point --log_dir at another"),
                       (errno.ENOSPC, "free disk space")):
        def refuse(*a, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(tg.os, "write", refuse)
        with pytest.raises(tg.UserError, match=re.escape(f"({os.strerror(code)}): {says}")):
            tg.append_line(log, "step:1")
    monkeypatch.undo()
    assert log.read_text() == "x\n"
