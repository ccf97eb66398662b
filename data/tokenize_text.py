"""Tokenize your own text into FineWeb-format shards that train_gpt.py reads. (Not named tokenize.py: a
script of that name in data/ shadows the stdlib module and breaks every other script run from data/.)

    python data/tokenize_text.py --out data/mytext books/*.txt web.jsonl
    torchrun --standalone --nproc_per_node=8 train_gpt.py \\
        --train_files 'data/mytext/text_train_*.bin' --val_files 'data/mytext/text_val_*.bin'

Each .txt file is one document; each line of a .jsonl file is one document (its "text" field). Every document
gets GPT-2's <|endoftext|> (50256) in front, as in FineWeb. The first --val_tokens tokens go to the val shard,
the rest to train shards of --shard_tokens tokens (the last one fewer). GPT-2's BPE ranks (the file tiktoken
would download) ship as data/gpt2.tiktoken, so no network is needed; --bpe or $TIKTOKEN_GPT2_BPE names another.
"""
import argparse
import json
import os
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import BOS_ID, HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION  # noqa: E402

# GPT-2's pre-tokenizer split (tiktoken's "gpt2" encoding), needed to build the encoding from a local file
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


SHIPPED_BPE = Path(__file__).resolve().parent / "gpt2.tiktoken"  # GPT-2's ranks (from openai-whisper, MIT)


def gpt2_encoding(bpe_path: str | None = None) -> tiktoken.Encoding:
    """GPT-2's BPE from --bpe, $TIKTOKEN_GPT2_BPE or the copy shipped in data/ (no network needed); tiktoken's
    download only if none of them exists."""
    path = bpe_path or os.environ.get("TIKTOKEN_GPT2_BPE") or (str(SHIPPED_BPE) if SHIPPED_BPE.exists() else None)
    if path:
        return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=load_tiktoken_bpe(path),
                                 special_tokens={"<|endoftext|>": BOS_ID})
    try:
        return tiktoken.get_encoding("gpt2")
    except OSError as e:  # no network: requests' errors are OSErrors
        raise SystemExit(f"error: tiktoken could not fetch GPT-2's BPE ranks ({type(e).__name__}), and "
                         f"{SHIPPED_BPE} is missing. Offline, pass --bpe PATH/gpt2.tiktoken or set "
                         f"TIKTOKEN_GPT2_BPE.") from None


def documents(paths: list):
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)["text"]
        else:
            yield Path(path).read_text(encoding="utf-8")


_encoding = None


def _init_worker(bpe_path):
    global _encoding
    _encoding = gpt2_encoding(bpe_path)


def encode_document(text: str) -> np.ndarray:
    return np.array([BOS_ID, *_encoding.encode_ordinary(text)], dtype=np.uint16)


def write_shard(path: Path, tokens: np.ndarray):
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    tmp.replace(path)


def tokenize(paths: list, out: Path, name: str, shard_tokens: int, workers: int, bpe_path=None,
             val_tokens: int | None = None) -> list:
    """Writes the first val_tokens tokens (default: shard_tokens) to the val shard, the rest to train shards of
    shard_tokens; documents that straddle a boundary continue in the next shard. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    val_tokens = val_tokens or shard_tokens
    buf, filled, written = np.empty(max(shard_tokens, val_tokens), dtype=np.uint16), 0, []

    def capacity():
        return val_tokens if not written else shard_tokens

    def flush(count):
        split = "val" if not written else "train"
        path = out / f"{name}_{split}_{len(written):06d}.bin"
        write_shard(path, buf[:count])
        written.append(path)
        print(f"{path}: {count:,} tokens", flush=True)

    with Pool(workers, initializer=_init_worker, initargs=(bpe_path,)) as pool:
        for doc in pool.imap(encode_document, documents(paths), chunksize=16):
            while len(doc):
                take = min(len(doc), capacity() - filled)
                buf[filled:filled + take] = doc[:take]
                filled, doc = filled + take, doc[take:]
                if filled == capacity():
                    flush(filled)
                    filled = 0
    if filled:
        flush(filled)
    if len(written) == 1:
        print(f"note: all {filled or val_tokens:,} tokens went to the val shard (--val_tokens {val_tokens:,}), so "
              f"there is no train shard: pass a smaller --val_tokens", flush=True)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("inputs", nargs="+", help=".txt files (one document each) and .jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="folder for the shards")
    parser.add_argument("--name", default="text", help="shard name prefix (default: %(default)s)")
    parser.add_argument("--shard_tokens", type=int, default=10**8, help="tokens per train shard (FineWeb: 10^8)")
    parser.add_argument("--val_tokens", type=int, default=10_485_760,
                        help="tokens in the val shard, the first ones (default: what train_gpt.py scores, 10,485,760)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (default: all cores)")
    parser.add_argument("--bpe", default=None, help="another gpt2.tiktoken (default: data/gpt2.tiktoken)")
    args = parser.parse_args(argv)
    for path in args.inputs:  # every input now, in one line, not in a worker's traceback with a folder made
        if not os.path.isfile(path):
            raise SystemExit(f"error: {path}: {'a folder' if os.path.isdir(path) else 'no such file'}: pass .txt and "
                             f".jsonl files")
        if not os.access(path, os.R_OK):
            raise SystemExit(f"error: {path}: not readable (check its permissions)")
    if args.shard_tokens < 1 or args.val_tokens < 1 or args.workers < 1:
        raise SystemExit("error: --shard_tokens, --val_tokens and --workers must be positive")
    gpt2_encoding(args.bpe)  # fail here, once, rather than in every worker
    try:  # the output folder now, in one line: a parent that is a file, a folder without write permission
        args.out.mkdir(parents=True, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        blocking = next((p for p in [args.out, *args.out.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocking} is a file, not a folder" if blocking else (e.strerror or str(e))
        raise SystemExit(f"error: --out {args.out}: cannot make or write that folder ({why}): pass another") from None
    try:
        tokenize(args.inputs, args.out, args.name, args.shard_tokens, args.workers, args.bpe, args.val_tokens)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError) as e:
        raise SystemExit(f"error: an input is not UTF-8 text or JSON lines with a \"text\" field ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


if __name__ == "__main__":
    main()
