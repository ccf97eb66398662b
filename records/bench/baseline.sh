#!/usr/bin/env bash
# GPU proxy speedrun: train_gpt.py against the llm.c-style baseline, on one GPU, same shards, one command.
#   records/bench/baseline.sh [OUT_DIR] [XZ_DIR] [RUNS]   (XZ_DIR holds proxy_*.bin.xz, default ../shared/data;
#                                                         RUNS: "ours baseline" (default), "ours" or "baseline")
# Ours runs the recipe at the proxy's scale (records/bench/recipe.sh's after arm: 118 steps, 31.2M tokens); the
# baseline gets the old ~49M-token budget (3 proxy train shards hold 50.3M). Both score the same 1,572,864 val
# tokens (6 of train_gpt.py's 262,144-token val sequences, 1536 of the baseline's 1024-token rows); then
# records/tool.py prints tokens/s, MFU and the time-to-loss speedup. RUNS splits them across device calls.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-logs/bench}
src=${2:-../shared/data}
runs=${3:-ours baseline}
data=${PROXY_DIR:-/tmp/proxy}
export PYTHONUNBUFFERED=1
python3 data/proxy.py --src "$src" --dst "$data" --train 3
shards=(--train_files "$data/proxy_train_*.bin" --val_files "$data/proxy_val_*.bin" --val_tokens 1572864)
if [[ " $runs " == *" ours "* ]]; then
    python3 train_gpt.py "${shards[@]}" --num_steps 118 --extension_steps 3 --momentum_warmup_steps 22 \
        --momentum_cooldown_steps 4 --val_every 10 --warmup_steps 3 --log_dir "$out" --run_id ours
fi
# baseline: 93 steps x 524,288 tokens = 48.8M
if [[ " $runs " == *" baseline "* ]]; then
    python3 records/baseline/train_gpt2.py "${shards[@]}" --train_tokens 49152000 --val_every 10 --log_dir "$out" \
        --run_id baseline
fi
[[ -f "$out/ours.txt" && -f "$out/baseline.txt" ]] || { echo "logs in $out; compare both with records/tool.py bench"; exit 0; }
python3 records/tool.py bench "$out/ours.txt" "$out/baseline.txt" | tee "$out/summary.txt"
python3 records/tool.py plot "$out" -o "$out/curve.png"
