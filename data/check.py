"""Verify FineWeb-format .bin shards as the trainer will: header, token count vs file size, token ids, at least one
document start; and print their BOS density.

    python data/check.py data/fineweb10B/*.bin
    python data/check.py data/fineweb10B          # a folder: every .bin in it

The format and the rules (magic, version, header size, token ids, document starts) are defined once, in
train_gpt.py, whose load_train_shard this calls, as the trainer does; this adds each shard's statistics.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import BOS_ID, ShardFormatError, load_train_shard  # noqa: E402


def check_shard(path: str) -> dict:
    """Raises ShardFormatError on a bad header, size or token id, or no document start: the trainer's own
    rule for its shards (load_train_shard); returns the shard's statistics."""
    tokens = load_train_shard(path)
    num_docs = int((tokens == BOS_ID).sum())
    return {"path": path, "tokens": int(tokens.size), "docs": num_docs, "tokens_per_doc": tokens.size / num_docs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("paths", nargs="+", help="shards, or folders of them (each .bin inside)")
    args = parser.parse_args(argv)
    bad, paths = 0, []
    for path in args.paths:
        shards = sorted(str(p) for p in Path(path).glob("*.bin")) if Path(path).is_dir() else [path]
        if not shards:
            print(f"BAD  {path}: a folder with no .bin shards in it")
            bad += 1
        paths += shards
    for path in paths:
        try:
            s = check_shard(path)
        except (ShardFormatError, OSError) as e:
            print(f"BAD  {e}")
            bad += 1
            continue
        print(f"ok   {path}: {s['tokens']:,} tokens, {s['docs']:,} docs, {s['tokens_per_doc']:.0f} tokens/doc")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
