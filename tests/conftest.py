import gc
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_gpt as tg  # noqa: E402

# shipped with the repo, so the suite runs on a fresh clone with no network and nothing beside it
SAMPLE_TEXT = REPO / "data" / "sample"     # Project Gutenberg books (public domain), one document per line
BPE = REPO / "data" / "gpt2.tiktoken"      # GPT-2's BPE ranks

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module", autouse=True)
def freeze_what_earlier_modules_left():
    """What outlives a test module (compiled graphs' caches, imported modules) lives on: freeze it too, or every
    later test's collection walks it again (after the compiling tests, 0.3 s per test)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def free_memory_after_each_test():
    """A trainer's model and optimizer reference each other (grad hooks, row sinks): only the cycle collector frees
    them, and it counts objects, not bytes. Collect after every test, or a suite of tiny runs holds gigabytes."""
    yield
    gc.collect()
    if _libc is not None:  # glibc keeps freed heap pages for reuse: give them back, so the suite fits a laptop
        _libc.malloc_trim(0)


def _glibc():
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_libc = _glibc()
# glibc hands each allocation over its mmap threshold (at most 32 MB) fresh pages and unmaps them when freed, so
# the tiny models' 50,304-column heads fault in every page again at every step: up to 256 MB now comes from the
# heap and is reused, and the trim after each test gives it back
if _libc is not None and hasattr(_libc, "mallopt"):
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h's parameter numbers
    _libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)
    _libc.mallopt(M_TRIM_THRESHOLD, 512 << 20)  # free memory kept at the heap's top between trims


def load_script(name: str, relpath: str):
    """Import a script from the repo (data/*.py, records/*.py) by path; their folders are not packages."""
    import importlib.util
    if name in sys.modules:  # once per session: a second copy's functions would not pickle (Pool workers)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so worker processes can unpickle its functions
    spec.loader.exec_module(module)
    return module


def write_shard(path, tokens, magic=tg.SHARD_MAGIC, count=None):
    """A FineWeb-format shard written byte by byte from the format's description, not by the code under test."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, tg.SHARD_VERSION, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def make_sample_shards(dst: Path) -> Path:
    """Real text: the shipped books tokenized into sample_val_000000.bin (28,231 tokens, other books than
    train) and sample_train_000001.bin (110,256 tokens), each document led by <|endoftext|>."""
    tokenize_text = load_script("tokenize_text", "data/tokenize_text.py")
    enc = tokenize_text.gpt2_encoding(str(BPE))
    dst.mkdir(parents=True, exist_ok=True)
    for split, name in [("val", "sample_val_000000.bin"), ("train", "sample_train_000001.bin")]:
        docs = tokenize_text.documents([str(SAMPLE_TEXT / f"books_{split}.jsonl")])
        write_shard(dst / name, [t for d in docs for t in (tg.BOS_ID, *enc.encode_ordinary(d))])
    return dst


@pytest.fixture(scope="session")
def sample_shards(tmp_path_factory) -> Path:
    return make_sample_shards(tmp_path_factory.mktemp("sample"))


# a tiny model on real text in the record's shape: layer 1 has no attention, layers 0 and 3 see the long window
# (and shift their keys), layer 2's heads attend in pairs; value embeddings feed layers 0, 2, 3; layer 0's
# output skips to layer 2; the layers after layer 1 attend to its output; MUDD on layers 2 and 3; the MUDD gate's
# second MLP at layer 2, XSA on layer 0, output gates on 0 and 3, DC on 3; batches grow from 2 to 4 micro-batches
TINY = ("--device cpu --seq_len 128 --batch_seqs 2,4 --num_layers 4 --model_dim 64 --num_heads 2 --head_dim 32 "
        "--long_window_layers 0,3 --no_attn_layers 1 --paired_head_layers 2 --value_embeds 1,-1,0,1 --skip 0,2 "
        "--backout_layer 1 --xsa_layers 0 --mudd_gate_layer 2 --attn_gate_layers 0,3 --dc_layers 3 --windows 2,4 "
        "--final_window 4 --val_window 6 --extension_steps 1 --bigram_vocab 4096 --momentum_warmup_steps 3 "
        "--momentum_cooldown_steps 1 --warmup_steps 0 --val_tokens 1024 --val_seq_len 1024 --fp8_head 0 "
        "--fp8_mlp 0").split()


GOLDEN_TOL = 0.005  # a tiny run's losses on other CPUs: twice the largest difference measured (test_training.py)


def tiny_args(shards, tmp_path, *extra) -> list:
    return [*TINY, "--train_files", str(shards / "sample_train_*.bin"), "--val_files",
            str(shards / "sample_val_*.bin"), "--log_dir", str(tmp_path), *extra]


def tiny_run(shards, tmp_path, *extra) -> str:
    return tg.main(tiny_args(shards, tmp_path, *extra)).read_text()


def losses(log: str, kind: str = "train") -> dict:
    """{step: loss} of a log's train (or val) lines."""
    return {int(s): float(v) for s, v in re.findall(rf"^step:(\d+)/\d+ {kind}_loss:(\S+)", log, re.M)}
