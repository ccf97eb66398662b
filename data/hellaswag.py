"""Download HellaSwag's validation split (10,042 items, one JSON object per line) for train_gpt.py's --hellaswag.

    python data/hellaswag.py                  # -> data/hellaswag/hellaswag_val.jsonl
    python train_gpt.py --hellaswag CKPT      # then score a checkpoint on it

The file is the one its authors publish beside the paper (Zellers et al. 2019, MIT licence). It is written to a
temporary file beside the destination and renamed when whole and checked, so an interrupted download leaves
nothing behind; a valid file already there is kept.
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import missing_folders, remove_empty  # noqa: E402

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
ITEMS = 10042
DEFAULT_OUT = Path(__file__).resolve().parent / "hellaswag" / "hellaswag_val.jsonl"


def problem(path: Path) -> str:
    """Why path is not HellaSwag's validation split, or '' if it is: ITEMS lines, each an item with a context,
    4 endings and a label."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        for line in (lines[0], lines[-1]):
            item = json.loads(line)
            if not (isinstance(item["ctx"], str) and len(item["endings"]) == 4 and 0 <= int(item["label"]) < 4):
                return "its items lack a context, 4 endings or a label"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return "" if len(lines) == ITEMS else f"{len(lines)} lines, not {ITEMS}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write it (default: %(default)s)")
    parser.add_argument("--url", default=URL, help="where to get it (default: its authors' file)")
    args = parser.parse_args(argv)
    if args.out.exists() and not problem(args.out):
        print(f"{args.out}: present and valid ({ITEMS:,} items): nothing to download")
        return 0
    made = missing_folders(args.out.parent)
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
    try:  # where it goes first: a folder that cannot be written is not the network's fault
        args.out.parent.mkdir(parents=True, exist_ok=True)
        open(tmp, "wb").close()
    except OSError as e:
        remove_empty(made)
        print(f"error: cannot write {args.out} ({e.strerror or e}: {e.filename}): pass --out with a writable path",
              file=sys.stderr)
        return 1
    why = ""
    try:
        with urllib.request.urlopen(args.url, timeout=30) as response, open(tmp, "wb") as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
        why = problem(tmp)
        if not why:
            os.replace(tmp, args.out)
    except (OSError, ValueError) as e:  # no network, a refused request, a bad URL, a full disk
        why = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
    finally:
        tmp.unlink(missing_ok=True)
    if why:
        remove_empty(made)
        print(f"error: could not get HellaSwag's validation split from {args.url} ({why}). Check the network, or "
              f"download the file elsewhere and pass it to train_gpt.py --hellaswag_file", file=sys.stderr)
        return 1
    print(f"{args.out}: {ITEMS:,} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
