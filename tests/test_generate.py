"""Sampling and HellaSwag from a checkpoint: python train_gpt.py --generate CKPT --prompt "..." and --hellaswag CKPT
(CPU here)."""
import json
import re

import pytest
import torch

from conftest import REPO, tiny_run  # first: repo on sys.path
import train_gpt as tg  # noqa: E402

PAIR = re.compile(r"(\w+):(\S+)")


@pytest.fixture(scope="module")
def ckpt(sample_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    tiny_run(sample_shards, d, "--num_steps", "3", "--save_every", "3", "--run_id", "g")
    return str(d / "g_step000003.pt")


def generate(ckpt, *extra):
    return tg.main(["--generate", ckpt, "--device", "cpu", "--max_new_tokens", "6", *extra])


def test_same_seed_same_text(ckpt, capsys):
    a = generate(ckpt, "--prompt", "It was a dark", "--seed", "3")
    b = generate(ckpt, "--prompt", "It was a dark", "--seed", "3")
    assert a == b and a.startswith("It was a dark") and len(a) > len("It was a dark")
    assert a in capsys.readouterr().out
    greedy = {generate(ckpt, "--prompt", "It was a dark", "--temperature", "0", "--seed", str(s)) for s in (1, 2)}
    assert len(greedy) == 1  # temperature 0 ignores the seed
    enc = tg.gpt2_encoding()
    assert len(enc.encode_ordinary(a)) >= len(enc.encode_ordinary("It was a dark")) + 4  # new tokens were added


@pytest.mark.parametrize("extra,says", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "word " * 1100], "longer than the 1023 tokens this model has positions for"),
    (["--prompt", "x", "--max_new_tokens", "0"], "--max_new_tokens must be positive"),
])
def test_bad_prompts_get_a_clear_message(ckpt, extra, says):
    with pytest.raises(SystemExit, match=says):
        tg.main(["--generate", ckpt, "--device", "cpu", *extra])


def test_a_missing_checkpoint_gets_a_clear_message(tmp_path):
    with pytest.raises(SystemExit, match="cannot read checkpoint .*missing.pt"):
        tg.main(["--generate", str(tmp_path / "missing.pt"), "--prompt", "hi"])


def test_a_character_split_across_tokens_prints_whole_or_not_at_all():
    """GPT-2's BPE holds single bytes: a sample can end, or go on, after the first byte of a 3-byte character.
    Such bytes are left out; whole characters across tokens are kept."""
    enc = tg.gpt2_encoding()
    dash = "\u2014".encode()  # an em dash: 3 bytes
    first, rest = enc.encode_single_token(dash[:1]), enc.encode_single_token(dash[1:2])
    last = enc.encode_single_token(dash[2:])
    words = enc.encode_ordinary(" a dark night")
    assert tg.decode(enc, [first, *words]) == " a dark night"            # a lone first byte, mid-text
    assert tg.decode(enc, [*words, first, rest]) == " a dark night"      # a split at the end
    assert tg.decode(enc, [*words, first, rest, last, *words]) == " a dark night\u2014 a dark night"


# ---- HellaSwag: python train_gpt.py --hellaswag CKPT, and --eval_hellaswag after training

FIXTURE = REPO / "tests" / "hellaswag_fixture.jsonl"  # 8 items of our own in HellaSwag's format


def brute_force_hellaswag(ckpt_path: str) -> tuple:
    """Each ending alone, by a plain forward of [BOS, context, ending] padded to a whole block: the validation
    head's summed next-token loss (tg.eval_loss) over the rows that predict the ending's tokens. acc: the ending
    of the lowest sum; acc_norm: of the lowest mean per token. Returns (right, right_norm, every ending's sum)."""
    model, _, windows = tg.model_from_checkpoint(ckpt_path, torch.device("cpu"), "score it")
    enc = tg.gpt2_encoding()
    right = right_norm = 0
    sums = []
    for line in FIXTURE.read_text().splitlines():
        item = json.loads(line)
        context = [tg.BOS_ID, *enc.encode_ordinary(item["ctx"])]
        nll, lengths = [], []
        for ending in item["endings"]:
            tokens = context + enc.encode_ordinary(" " + ending)
            idx = torch.tensor(tokens + [0] * (-len(tokens) % 128), dtype=torch.int32)
            with torch.no_grad():
                x = model.hidden(idx, windows)[0]
            n = len(tokens) - len(context)
            rows = slice(len(context) - 1, len(tokens) - 1)
            nll.append(tg.eval_loss(x[rows], model.head_w, idx[1:len(tokens)].long()[-n:]).item())
            lengths.append(n)
        right += min(range(4), key=lambda j: nll[j]) == item["label"]
        right_norm += min(range(4), key=lambda j: nll[j] / lengths[j]) == item["label"]
        sums += nll
    return right, right_norm, sums


def test_hellaswag_scores_as_each_ending_alone_would(ckpt, capsys, tmp_path):
    """--hellaswag's acc and acc_norm on the fixture against brute_force_hellaswag; labels as the HF dataset writes
    them (strings) read the same; a missing file or a bad line is one line naming it."""
    out = tg.main(["--hellaswag", ckpt, "--hellaswag_file", str(FIXTURE), "--device", "cpu"])
    got = dict(PAIR.findall(out))
    right, right_norm, sums = brute_force_hellaswag(ckpt)
    # every ending's log-likelihood, as the batched passes make it (all 32 sequences side by side)
    model, _, windows = tg.model_from_checkpoint(ckpt, torch.device("cpu"), "score it")
    enc, seqs = tg.gpt2_encoding(), []
    for ctx, endings, _ in tg.hellaswag_items(str(FIXTURE)):
        seqs += [([tg.BOS_ID, *enc.encode_ordinary(ctx), *enc.encode_ordinary(" " + e)],
                  len(enc.encode_ordinary(" " + e))) for e in endings]
    batched = tg.ending_logprobs(model, seqs, windows, torch.device("cpu"))
    assert torch.allclose(-torch.tensor(batched), torch.tensor(sums), rtol=1e-4, atol=1e-4), (batched, sums)
    assert (got["hellaswag_acc"], got["acc_norm"], got["count"]) == (f"{right / 8:.4f}", f"{right_norm / 8:.4f}", "8")
    assert out in capsys.readouterr().out
    as_strings = tmp_path / "str.jsonl"
    as_strings.write_text("".join(json.dumps({**json.loads(x), "label": str(json.loads(x)["label"])}) + "\n"
                                  for x in FIXTURE.read_text().splitlines()))
    assert tg.main(["--hellaswag", ckpt, "--hellaswag_file", str(as_strings), "--device", "cpu"]) == out.replace(
        str(FIXTURE), str(as_strings))
    with pytest.raises(SystemExit, match="no such file: get HellaSwag's validation split with `python "
                                         "data/hellaswag.py`"):
        tg.main(["--hellaswag", ckpt, "--hellaswag_file", str(tmp_path / "none.jsonl"), "--device", "cpu"])
    (tmp_path / "bad.jsonl").write_text(FIXTURE.read_text().splitlines()[0] + "\n{\"ctx\": \"x\"}\n")
    with pytest.raises(SystemExit, match="bad.jsonl, line 2: not a HellaSwag item"):
        tg.main(["--hellaswag", ckpt, "--hellaswag_file", str(tmp_path / "bad.jsonl"), "--device", "cpu"])


def test_eval_hellaswag_after_training_logs_the_final_weights_score(sample_shards, tmp_path):
    """--eval_hellaswag FILE scores the final weights after the summary, one log line, as --hellaswag scores the
    run's last checkpoint; a missing file is refused before training."""
    with pytest.raises(SystemExit, match="none.jsonl: no such file"):
        tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--eval_hellaswag", str(tmp_path / "none.jsonl"))
    log = tiny_run(sample_shards, tmp_path, "--num_steps", "2", "--save_every", "2", "--run_id", "h",
                   "--eval_hellaswag", str(FIXTURE))
    last = log.rstrip().splitlines()[-1]
    assert last.startswith("hellaswag_acc:") and log.rstrip().splitlines()[-2].startswith("summary:")
    assert last == tg.main(["--hellaswag", str(tmp_path / "h_step000002.pt"), "--hellaswag_file", str(FIXTURE),
                            "--device", "cpu"])


@pytest.mark.parametrize("mode", ["--generate", "--hellaswag"])
def test_each_mode_has_its_help_and_the_main_help_names_them(mode, capsys):
    """MODE --help prints the mode's flags (argparse took --help for the missing CKPT); the training --help names
    both modes and their flags."""
    with pytest.raises(SystemExit) as e:
        tg.main([mode, "--help"])
    assert e.value.code == 0 and f"{mode} CKPT" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tg.main(["--help"])
    out = capsys.readouterr().out
    assert "--generate CKPT --prompt TEXT" in out and "--hellaswag CKPT" in out and "the map below" not in out


def test_a_log_given_for_a_checkpoint_is_called_a_log(ckpt):
    """--generate LOG (a run's log, not a checkpoint) says so and names the checkpoints beside it."""
    log = ckpt.replace("_step000003.pt", ".txt")
    with pytest.raises(SystemExit, match=f"is a run's log; its checkpoints: {ckpt}$"):
        tg.main(["--generate", log, "--prompt", "hi", "--device", "cpu"])
