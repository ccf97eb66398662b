"""data/: tokenizing text into shards, verifying shards, downloading FineWeb (with a local fake of the hub)."""
import json

import numpy as np
import pytest
import requests
import tiktoken

from conftest import BPE, REPO, load_script, write_shard as write  # first: repo on sys.path
import train_gpt as tg  # noqa: E402

tokenize_text = load_script("tokenize_text", "data/tokenize_text.py")
check = load_script("check", "data/check.py")
download = load_script("cached_fineweb10B", "data/cached_fineweb10B.py")
proxy = load_script("data_proxy", "data/proxy.py")
BPE = str(BPE)


def test_local_bpe_gives_gpt2_ids():
    enc = tokenize_text.gpt2_encoding(BPE)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]


def test_text_to_shards_round_trip(tmp_path):
    docs = ["Hello world", "Second document,\nwith a line break.", "Über café: 3.14 — naïve ☃", "x" * 50]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for d in docs[1:]:
            f.write(json.dumps({"text": d}) + "\n")
    paths = tokenize_text.tokenize([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tmp_path / "out",
                                   "t", shard_tokens=16, workers=2, bpe_path=BPE)
    assert paths[0].name == "t_val_000000.bin" and paths[1].name == "t_train_000001.bin"
    got = np.concatenate([tg.load_shard(str(p)) for p in paths])
    enc = tokenize_text.gpt2_encoding(BPE)
    want = [t for d in docs for t in [tg.BOS_ID, *enc.encode_ordinary(d)]]
    assert got.tolist() == want
    assert all(tg.read_header(str(p)) == 16 for p in paths[:-1])  # full shards but the last


def test_val_tokens_split_and_a_small_input_says_why_no_train_shard(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("Hello world, " * 20, encoding="utf-8")  # 62 tokens with the BOS
    paths = tokenize_text.tokenize([str(tmp_path / "a.txt")], tmp_path / "out", "t", shard_tokens=32, workers=1,
                                   bpe_path=BPE, val_tokens=20)
    assert [tg.read_header(str(p)) for p in paths] == [20, 32, 10] and "train" in paths[1].name
    paths = tokenize_text.tokenize([str(tmp_path / "a.txt")], tmp_path / "out2", "t", shard_tokens=100, workers=1,
                                   bpe_path=BPE, val_tokens=100)
    assert len(paths) == 1 and "all 62 tokens went to the val shard" in capsys.readouterr().out


def test_tokenizer_works_offline_and_says_what_to_do_without_ranks(monkeypatch, tmp_path):
    monkeypatch.delenv("TIKTOKEN_GPT2_BPE", raising=False)

    def offline(name):
        raise requests.exceptions.ConnectionError("no route")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    assert tokenize_text.gpt2_encoding(None).encode_ordinary("Hello world") == [15496, 995]  # the shipped copy
    monkeypatch.setattr(tokenize_text, "SHIPPED_BPE", tmp_path / "missing.tiktoken")
    with pytest.raises(SystemExit, match="--bpe PATH/gpt2.tiktoken"):
        tokenize_text.gpt2_encoding(None)
    monkeypatch.setenv("TIKTOKEN_GPT2_BPE", BPE)
    assert tokenize_text.gpt2_encoding(None).encode_ordinary("Hello world") == [15496, 995]


def test_check_reports_bad_shards(tmp_path, capsys):
    write(tmp_path / "good.bin", [tg.BOS_ID, 5, 6, tg.BOS_ID, 7])
    write(tmp_path / "big_id.bin", [tg.BOS_ID, 50300])
    write(tmp_path / "cut.bin", [1, 2, 3], count=5)
    stats = check.check_shard(str(tmp_path / "good.bin"))
    assert stats["tokens"] == 5 and stats["docs"] == 2
    with pytest.raises(tg.ShardFormatError, match="50300"):
        check.check_shard(str(tmp_path / "big_id.bin"))
    assert check.main([str(tmp_path / n) for n in ["good.bin", "big_id.bin", "cut.bin"]]) == 1
    out = capsys.readouterr().out
    assert out.count("BAD") == 2 and "truncated" in out and "ok   " in out
    # a shard without a document start: the trainer refuses it, and so does the checker, in the trainer's words
    write(tmp_path / "no_bos.bin", [5, 6, 7, 8])
    assert check.main([str(tmp_path / "no_bos.bin")]) == 1
    said = capsys.readouterr().out
    with pytest.raises(tg.ShardFormatError) as trainer_says:
        tg.TrainLoader(str(tmp_path / "no_bos.bin"), 2, 4, 0, 1)
    assert said == f"BAD  {trainer_says.value}\n"
    # a folder is its .bin shards (the four above); a folder with none is refused, not passed
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / "empty").mkdir()
    assert check.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("BAD") == 3 and out.count("ok   ") == 1 and "notes.txt" not in out
    assert check.main([str(tmp_path / "empty")]) == 1 and "no .bin shards" in capsys.readouterr().out


@pytest.fixture
def fake_hub(monkeypatch):
    """Stands in for huggingface_hub.hf_hub_download: writes a valid shard and records the call."""
    calls = []

    def fake(repo_id, filename, repo_type, local_dir):
        assert repo_id == "kjj0/fineweb10B-gpt2" and repo_type == "dataset"
        calls.append(filename)
        write(local_dir / filename, [tg.BOS_ID, 1, 2])

    monkeypatch.setattr(download, "hf_hub_download", fake)
    monkeypatch.setattr(download, "hub_unreachable", lambda: "")
    return calls


def test_download_names_skips_valid_and_replaces_corrupt(tmp_path, fake_hub):
    assert download.main(["3", "--dir", str(tmp_path)]) == 0
    assert fake_hub == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin",
                        "fineweb_train_000003.bin"]
    (tmp_path / "fineweb_train_000002.bin").write_bytes(b"garbage")
    fake_hub.clear()
    assert download.main(["3", "--dir", str(tmp_path)]) == 0
    assert fake_hub == ["fineweb_train_000002.bin"]
    assert tg.read_header(str(tmp_path / "fineweb_train_000002.bin")) == 3


def test_download_offline_fails_plainly_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Offline, one line at once (no download tried, no folder made); a download that fails midway (the hub
    library leaves its lock files inside --dir) is one line too, and leaves no folder, lock or partial file."""
    tried = []
    monkeypatch.setattr(download, "hub_unreachable", lambda: "URLError: Name or service not known")
    monkeypatch.setattr(download, "hf_hub_download", lambda **kw: tried.append(kw))
    dst = tmp_path / "new" / "fineweb"
    assert download.main(["1", "--dir", str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the Hugging Face hub") and err.count("\n") == 1 and not tried
    assert not (tmp_path / "new").exists()

    def fails_midway(local_dir, **kwargs):
        lock = local_dir / ".cache" / "huggingface" / "download" / "fineweb_val_000000.bin.lock"
        lock.parent.mkdir(parents=True)
        lock.touch()
        raise requests.exceptions.ConnectionError("Name or service not known")

    monkeypatch.setattr(download, "hub_unreachable", lambda: "")
    monkeypatch.setattr(download, "hf_hub_download", fails_midway)
    assert download.main(["1", "--dir", str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not download fineweb_val_000000.bin") and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()


def test_an_out_folder_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match="^error: --out .*: cannot make or write that folder \\(.*afile is a file, "
                                         "not a folder\\): pass another$"):
        tokenize_text.main(["--out", str(tmp_path / "afile" / "shards"), str(REPO / "data" / "sample" /
                                                                          "books_val.jsonl")])


def test_proxy_unpack_skips_valid_shards_and_replaces_bad_ones(tmp_path):
    import lzma
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for name, tokens in [("proxy_val_000000.bin", [tg.BOS_ID, 1, 2]), ("proxy_train_000001.bin", [tg.BOS_ID, 3]),
                         ("proxy_train_000002.bin", [tg.BOS_ID, 4, 5, 6])]:
        write(tmp_path / name, tokens)
        (src / f"{name}.xz").write_bytes(lzma.compress((tmp_path / name).read_bytes()))
    paths = proxy.unpack(src, dst, num_train=1)
    assert [p.name for p in paths] == ["proxy_val_000000.bin", "proxy_train_000001.bin"]
    assert tg.load_shard(str(dst / "proxy_train_000001.bin")).tolist() == [tg.BOS_ID, 3]
    (dst / "proxy_val_000000.bin").write_bytes(b"garbage")
    proxy.unpack(src, dst, num_train=1)
    assert tg.load_shard(str(dst / "proxy_val_000000.bin")).tolist() == [tg.BOS_ID, 1, 2]


def test_proxy_without_its_shards_says_where_they_are(tmp_path):
    """A fresh clone has no ../shared: one error line, no traceback."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(REPO / "data" / "proxy.py"), "--src", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: no proxy_val")


hellaswag = load_script("data_hellaswag", "data/hellaswag.py")


def test_hellaswag_download_is_whole_or_absent(tmp_path, monkeypatch, capsys):
    """data/hellaswag.py: offline, one line and nothing left (no folder, no partial file); a short file is
    refused the same way; the whole split (here the fixture's items repeated to 10,042 lines) is written and
    then kept; an --out that cannot be written is named as such before any download, not blamed on the network."""
    import io
    import urllib.error
    fixture = (REPO / "tests" / "hellaswag_fixture.jsonl").read_text().splitlines()
    served = {}

    def urlopen(url, timeout):
        if "body" not in served:
            raise urllib.error.URLError("[Errno -2] Name or service not known")
        return io.BytesIO(served["body"])

    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", urlopen)
    out = tmp_path / "new" / "hellaswag_val.jsonl"
    assert hellaswag.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not get HellaSwag's validation split") and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()
    served["body"] = ("\n".join(fixture[:5]) + "\n").encode()
    assert hellaswag.main(["--out", str(out)]) == 1
    assert "5 lines, not 10042" in capsys.readouterr().err and not (tmp_path / "new").exists()
    served["body"] = ("\n".join(fixture[i % len(fixture)] for i in range(10042)) + "\n").encode()
    assert hellaswag.main(["--out", str(out)]) == 0
    assert len(tg.hellaswag_items(str(out))) == 10042 and [p.name for p in out.parent.iterdir()] == [out.name]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert hellaswag.main(["--out", str(blocker / "sub" / "hellaswag_val.jsonl")]) == 1  # a folder that is a file
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {blocker}") and err.count("\n") == 1, err  # not the network's
    served.clear()  # offline now: the valid file is kept, nothing fetched
    assert hellaswag.main(["--out", str(out)]) == 0 and "present and valid" in capsys.readouterr().out
