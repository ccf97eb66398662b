#!/usr/bin/env bash
# Fresh GPU machine to a timed record run: install, fetch FineWeb (900M tokens), train on every visible GPU.
#   ./run.sh                 # extra arguments go to train_gpt.py, e.g. ./run.sh --num_steps 100
set -euo pipefail
cd "$(dirname "$0")"
# check for GPUs before installing the multi-GB CUDA torch or downloading 1.8 GB of data
if ! gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); then gpus=0; fi
if [ "$gpus" -eq 0 ]; then
    echo "error: no NVIDIA GPU visible (nvidia-smi); ./run.sh trains on GPUs. On CPU: python train_gpt.py" \
         "--preset smoke (README.md, Quick start)" >&2
    exit 1
fi
# the torch that GPUs here were tested with (its CUDA build, which brings its Triton); a newer one may compile
# the model differently: check the GPU tests (tests/test_training.py -k cuda) before trusting it
python3 -m pip install -q torch==2.11.0 -r requirements.txt
python3 data/cached_fineweb10B.py 9
if command -v torchrun >/dev/null; then launch=(torchrun); else launch=(python3 -m torch.distributed.run); fi
"${launch[@]}" --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
