import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# the offline proxy data: ../shared/data beside the checkout (CI lays it there too)
SHARED_DATA = Path(os.environ.get("SPEEDRUN_SHARED_DATA", REPO.parent / "shared" / "data"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def load_script(name: str, relpath: str):
    """Import a script from the repo (data/*.py, records/*.py) by path; their folders are not packages."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so worker processes can unpickle its functions
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def proxy_dir(tmp_path_factory) -> Path:
    """Real text: the Gutenberg proxy's val shard and first train shard, unpacked once per session."""
    if not SHARED_DATA.is_dir():
        pytest.fail(f"{SHARED_DATA} is missing: set SPEEDRUN_SHARED_DATA to the folder with proxy_*.bin.xz")
    proxy = load_script("data_proxy", "data/proxy.py")
    dst = tmp_path_factory.mktemp("proxy")
    proxy.unpack(SHARED_DATA, dst, num_train=1)
    return dst
