"""Verify FineWeb-format .bin shards: header, token count vs file size, token ids, BOS density.

    python data/check.py data/fineweb10B/*.bin

The format itself (magic, version, header size) is defined once, in train_gpt.py, which reads shards with
the same functions; this adds the checks that need a pass over the tokens.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import BOS_ID, ShardFormatError, load_shard  # noqa: E402


def check_shard(path: str) -> dict:
    """Raises ShardFormatError on a bad header, size, or token id (load_shard checks all three, as the trainer
    does when it loads a shard); returns the shard's statistics."""
    tokens = load_shard(path)
    num_docs = int((tokens == BOS_ID).sum())
    return {"path": path, "tokens": int(tokens.size), "docs": num_docs,
            "tokens_per_doc": tokens.size / num_docs if num_docs else float("inf")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.paths:
        try:
            s = check_shard(path)
        except (ShardFormatError, OSError) as e:
            print(f"BAD  {e}")
            bad += 1
            continue
        note = "" if s["docs"] else "  (no <|endoftext|>: the trainer needs documents that start with it)"
        print(f"ok   {path}: {s['tokens']:,} tokens, {s['docs']:,} docs, {s['tokens_per_doc']:.0f} tokens/doc{note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
