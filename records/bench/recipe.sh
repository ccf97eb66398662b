#!/usr/bin/env bash
# The recipe's proxy time-to-loss bench, on one GPU: arms of seeds run one after another (never two on the GPU
# at once) on the proxy shards, validating every 5 steps on the same 1,572,864 val tokens; then
# records/tool.py compares the first two arms named (time to the first arm's mean final val loss, with a 95%
# interval, and ms per million training tokens).
#   records/bench/recipe.sh OUT XZ_DIR "SEEDS" ARM...
#     before          the Aug-2025 recipe: 2a1f130's train_gpt.py, written out of its record log, 125 steps
#     after           this train_gpt.py: the 2026-01-19 record's steps scaled by the proxy's 125 per 1695
#     NAME=FLAGS      this train_gpt.py scaled the same way, with more flags (an ablation), e.g. nobigram=--bigram_vocab 0
#   records/bench/recipe.sh $OUT .gpu "0 1 2" after before
# Logs go to OUT/ARM/ARM_sSEED.txt, the comparison to OUT/compare.txt. A run starts only if it should end within
# BUDGET_S seconds of the start (default 570: one device call); a run is expected to take as long as the last
# one of its arm less its compile warm-up.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1 src=$2 seeds=$3
shift 3
data=${PROXY_DIR:-/tmp/proxy}
budget=${BUDGET_S:-570}
export PYTHONUNBUFFERED=1
start=$SECONDS
mkdir -p "$out"
python3 data/proxy.py --src "$src" --dst "$data" --train 3 >/dev/null
before_script=/tmp/before_train_gpt.py
python3 records/tool.py source records/2026-12-04_speed6-h200/new_s0.txt -o "$before_script" --force >/dev/null
common=(--train_files "$data/proxy_train_*.bin" --val_files "$data/proxy_val_*.bin" --val_tokens 1572864
        --val_every 5 --warmup_steps 3)
# FineWeb steps x 125/1695: 1600 -> 118 steps, 40 extension -> 3, momentum warm-up 300 -> 22, cool-down 50 -> 4
scaled=(--num_steps 118 --extension_steps 3 --momentum_warmup_steps 22 --momentum_cooldown_steps 4)
names=()
for arm in "$@"; do
    case $arm in
        before) name=before script=$before_script flags=(--num_steps 125) ;;
        after) name=after script=train_gpt.py flags=("${scaled[@]}") ;;
        *=*) name=${arm%%=*} script=train_gpt.py
             read -r -a extra <<< "${arm#*=}"
             flags=("${scaled[@]}" "${extra[@]}") ;;
        *) echo "unknown arm $arm" >&2; exit 2 ;;
    esac
    names+=("$out/$name")
    expect=0
    for seed in $seeds; do
        if (( SECONDS - start + expect > budget )); then
            echo "skipped $name seed $seed: $((SECONDS - start)) s gone, a run takes ~$expect s (BUDGET_S=$budget)"
            continue
        fi
        t0=$SECONDS
        python3 "$script" "${common[@]}" "${flags[@]}" --seed "$seed" --log_dir "$out/$name" --run_id "${name}_s$seed" \
            2>&1 | grep -v '^step:[0-9]*/[0-9]* train_loss\|^warmup_step' || echo "FAILED: $name seed $seed"
        took=$((SECONDS - t0))
        warm=$(grep -o '^warmup_steps:[0-9]* warmup_time:[0-9]*' "$out/$name/${name}_s$seed.txt" 2>/dev/null \
               | grep -o '[0-9]*$' || echo 0)
        expect=$((took - warm / 1000 + 15))  # the next run of this script reuses the compile cache
        echo "$name seed $seed: $took s (warm-up $((warm / 1000)) s)"
    done
done
if (( ${#names[@]} >= 2 )); then
    python3 records/tool.py compare "${names[0]}" "${names[1]}" | tee "$out/compare.txt"
fi
