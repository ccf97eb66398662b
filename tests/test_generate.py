"""Sampling from a checkpoint: python train_gpt.py --generate CKPT --prompt "..." (CPU here)."""
import pytest

from conftest import tiny_run  # first: repo on sys.path
import train_gpt as tg  # noqa: E402


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
