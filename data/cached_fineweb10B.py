"""Download pre-tokenized FineWeb (GPT-2 BPE, FineWeb-format .bin shards) from the Hugging Face hub.

    python data/cached_fineweb10B.py 9        # val shard + train shards 1..9 (900M tokens: enough for a record)
    python data/cached_fineweb10B.py 103      # all of FineWeb-10B

Shards land in data/fineweb10B/ (--dir), where train_gpt.py looks by default. Shards already there and valid
are skipped, so an interrupted download resumes; each downloaded shard's header is checked.
"""
import argparse
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from huggingface_hub import constants, hf_hub_download
from huggingface_hub.utils import logging as hub_logging

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_gpt import is_shard, missing_folders, read_header, remove_empty  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"   # 100M-token shards: fineweb_val_000000.bin, fineweb_train_000001.bin, ...
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"


def shard_names(num_train: int) -> list:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def fetch(name: str, dst: Path) -> bool:
    """Makes dst/name a valid shard; returns False if it was already there."""
    path = dst / name
    if is_shard(path):
        return False
    path.unlink(missing_ok=True)
    hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=dst)
    read_header(str(path))  # a bad download stops here, naming the file
    return True


OFFLINE_HINT = ("Check the network (or HF_ENDPOINT). Offline: make shards from your own text with "
                "`python data/tokenize_text.py` (GPT-2 BPE ships in data/), or unpack the Gutenberg proxy shards "
                "with `python data/proxy.py`")


def hub_unreachable(timeout: float = 10.0) -> str:
    """Why the hub cannot be reached in `timeout` seconds, or '': one quick request before any download, so
    that an offline machine gets one line at once instead of the hub library's retries."""
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:  # the hub answered, if not to this request
        return ""
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("num_train", type=int, nargs="?", default=9, help="train shards of 100M tokens (default 9)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="destination (default: %(default)s)")
    args = parser.parse_args(argv)
    names = shard_names(args.num_train)
    if all(is_shard(args.dir / name) for name in names):
        print(f"all {len(names)} shards are in {args.dir} and valid: nothing to download")
        return 0
    why = hub_unreachable()
    if why:
        print(f"error: cannot reach the Hugging Face hub at {constants.ENDPOINT} ({why}). {OFFLINE_HINT}",
              file=sys.stderr)
        return 1
    hub_logging.set_verbosity_error()  # one line of ours per shard, not the library's retry warnings
    made = missing_folders(args.dir)
    cache = args.dir / ".cache"  # the hub library's locks and metadata inside --dir
    cache_existed = cache.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for i, name in enumerate(names, 1):
        try:
            fetched = fetch(name, args.dir)
        except OSError as e:  # no route to the hub: huggingface_hub and requests errors are OSErrors
            if not cache_existed:
                shutil.rmtree(cache, ignore_errors=True)
            remove_empty(made)
            print(f"error: could not download {name} from the Hugging Face hub ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else 'no reason given'}). {OFFLINE_HINT}",
                  file=sys.stderr)
            return 1
        print(f"[{i}/{len(names)}] {name}: {'downloaded' if fetched else 'present, valid: skipped'} "
              f"({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
