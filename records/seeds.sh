#!/usr/bin/env bash
# Several seeds of one or more configurations of the one-GPU proxy bench, back to back: after a script's first
# run in a call, torch's compile cache starts the next ones in seconds. Then records/tool.py compares the arms.
#   records/seeds.sh OUT XZ_DIR "SEEDS" NAME=SCRIPT[ FLAGS...] ...
#   records/seeds.sh $OUT .gpu "0 1 2" new=train_gpt.py "old=.gpu/old_train_gpt.py --fp8_head 1"
# Every run: the proxy shards (3 train shards, 49.2M tokens in 125 steps x 393,216) and the same first
# 1,572,864 val tokens (6 x 262,144 or 32 x 49,152: a multiple of both sequence lengths), val every 10 steps.
# Logs go to OUT/NAME/NAME_sSEED.txt. A run starts only if it should end within BUDGET_S (default 570 s
# from the start; a run is expected to take as long as the last one less its compile warm-up), so one device
# call ends with its table instead of being cut off.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 src=$2 seeds=$3
shift 3
data=${PROXY_DIR:-/tmp/proxy}
budget=${BUDGET_S:-570}
export PYTHONUNBUFFERED=1
start=$SECONDS
mkdir -p "$out"
python3 data/proxy.py --src "$src" --dst "$data" --train 3
common=(--train_files "$data/proxy_train_*.bin" --val_files "$data/proxy_val_*.bin" --val_tokens 1572864
        --num_steps 125 --val_every 10 --warmup_steps 3)
expect=0
for arm in "$@"; do
    name=${arm%%=*} rest=${arm#*=}
    script=${rest%% *} flags=${rest#"$script"}
    for seed in $seeds; do
        if (( SECONDS - start + expect > budget )); then
            echo "skipped $name seed $seed: $((SECONDS - start)) s gone, a run takes ~$expect s (BUDGET_S=$budget)"
            continue
        fi
        t0=$SECONDS
        # shellcheck disable=SC2086  # flags are words
        python3 "$script" "${common[@]}" --seed "$seed" --log_dir "$out/$name" --run_id "${name}_s$seed" $flags \
            2>&1 | grep -v '^step:[0-9]*/[0-9]* train_loss' || echo "FAILED: $name seed $seed"
        took=$((SECONDS - t0))
        warm=$(grep -o '^warmup_steps:[0-9]* warmup_time:[0-9]*' "$out/$name/${name}_s$seed.txt" 2>/dev/null \
               | grep -o '[0-9]*$' || echo 0)
        expect=$((took - warm / 1000 + 20))  # the next run of this script reuses the compile cache
        echo "$name seed $seed: $took s (warm-up $((warm / 1000)) s)"
    done
done
names=()
for arm in "$@"; do names+=("$out/${arm%%=*}"); done
for d in "${names[@]}"; do python3 records/tool.py summary "$d" --target 0; done | tee "$out/summary.txt"
if (( ${#names[@]} == 2 )); then python3 records/tool.py compare "${names[@]}" | tee -a "$out/summary.txt"; fi
