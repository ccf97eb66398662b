#!/usr/bin/env bash
# Fresh machine to a timed record run: install, fetch FineWeb (900M tokens), train on every visible GPU.
#   ./run.sh                 # extra arguments go to train_gpt.py, e.g. ./run.sh --num_steps 100
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q torch -r requirements.txt
python3 data/cached_fineweb10B.py 9
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -eq 0 ]; then echo "error: no CUDA GPU visible; train_gpt.py needs one per process" >&2; exit 1; fi
torchrun --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
