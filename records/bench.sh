#!/usr/bin/env bash
# GPU proxy speedrun: train_gpt.py against the llm.c-style baseline, on one GPU, same shards, one command.
#   records/bench.sh [OUT_DIR] [XZ_DIR] [RUNS]   (XZ_DIR holds proxy_*.bin.xz, default ../shared/data;
#                                                RUNS: "ours baseline" (default), "ours" or "baseline")
# Both runs take about 10 minutes on an H200, most of it ours' compile; RUNS splits them across two calls.
# Each run gets the same ~49M-token budget (3 proxy train shards hold 50.3M) and the same 1,572,864 val
# tokens (6 of train_gpt.py's 262,144-token val sequences, 1536 of the baseline's 1024-token rows; the
# 2026-12-02 records scored 1,966,080); then records/tool.py prints tokens/s, MFU and the time-to-loss speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-logs/bench}
src=${2:-../shared/data}
runs=${3:-ours baseline}
data=${PROXY_DIR:-/tmp/proxy}
export PYTHONUNBUFFERED=1
python3 data/proxy.py --src "$src" --dst "$data" --train 3
shards=(--train_files "$data/proxy_train_*.bin" --val_files "$data/proxy_val_*.bin" --val_tokens 1572864)
# ours: 125 steps x 393,216 tokens = 49.2M
if [[ " $runs " == *" ours "* ]]; then
    python3 train_gpt.py "${shards[@]}" --num_steps 125 --val_every 10 --warmup_steps 3 --log_dir "$out" --run_id ours
fi
# baseline: 93 steps x 524,288 tokens = 48.8M
if [[ " $runs " == *" baseline "* ]]; then
    python3 records/baseline/train_gpt2.py "${shards[@]}" --train_tokens 49152000 --val_every 10 --log_dir "$out" \
        --run_id baseline
fi
[[ -f "$out/ours.txt" && -f "$out/baseline.txt" ]] || { echo "logs in $out; compare both with records/tool.py bench"; exit 0; }
python3 records/tool.py bench "$out/ours.txt" "$out/baseline.txt" | tee "$out/summary.txt"
python3 records/tool.py plot "$out" -o "$out/curve.png"
