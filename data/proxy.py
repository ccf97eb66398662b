"""Unpack the offline proxy shards (Project Gutenberg books in FineWeb's shard format, xz-compressed) into a
folder the trainer reads: the data of the GPU benches in records/bench/, where FineWeb is out of reach.

    python data/proxy.py                         # ../shared/data/*.bin.xz -> data/proxy/
    python data/proxy.py --train 3 --dst /tmp/p  # only the first 3 train shards

Then: torchrun --standalone --nproc_per_node=1 train_gpt.py \\
        --train_files 'data/proxy/proxy_train_*.bin' --val_files 'data/proxy/proxy_val_*.bin' --val_tokens 2000000
"""
import argparse
import lzma
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import is_shard, read_header  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SRC = REPO.parent / "shared" / "data"


def unpack(src: Path, dst: Path, num_train: int | None = None) -> list:
    """Decompresses the val shard and the first num_train train shards (all if None) into dst; skips shards
    already there and valid. Returns the shard paths."""
    val = sorted(src.glob("proxy_val_*.bin.xz"))
    train = sorted(src.glob("proxy_train_*.bin.xz"))[:num_train]
    if not val or not train:
        raise SystemExit(f"error: no proxy_val_*.bin.xz and proxy_train_*.bin.xz in {src}: pass --src with the folder "
                         f"that holds them. The proxy is public-domain books of Project Gutenberg in FineWeb's shard "
                         f"format; to make comparable shards of your own, cut books into 1.5-9 KB pieces at paragraph "
                         f"breaks, one per line of a .jsonl file, and run data/tokenize_text.py on them")
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for xz in val + train:
        path = dst / xz.name.removesuffix(".xz")
        if not is_shard(path):
            tmp = path.with_suffix(".tmp")
            with lzma.open(xz) as f_in, open(tmp, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
            read_header(str(tmp))
            tmp.replace(path)
        out.append(path)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC, help="folder of *.bin.xz (default: %(default)s)")
    parser.add_argument("--dst", type=Path, default=REPO / "data" / "proxy", help="output folder")
    parser.add_argument("--train", type=int, default=None, help="how many train shards (default: all)")
    args = parser.parse_args(argv)
    for path in unpack(args.src, args.dst, args.train):
        print(f"{path}: {read_header(str(path)):,} tokens")


if __name__ == "__main__":
    main()
