#!/usr/bin/env bash
# Proxy runs from a list, one at a time on the GPU, inside one device call's deadline: the recipe bench's 118
# scaled steps (recipe.sh's flags) per line, a log per run, nothing run twice.
#   records/bench/proxyqueue.sh LIST
# LIST's lines: "NAME SEED CAP FLAGS...": a proxy run of this train_gpt.py with FLAGS (the last of a repeated flag
# wins, e.g. --val_every 118 for the final val alone), CAP "-" or GiB to play a smaller GPU (capped.py); or
# "bench NAME CAP FLAGS...": stagebench.py (BENCH_N timed steps a stage, default 10) with FLAGS.
# Env: OUT (default /tmp/out) gets pq.tgz (logs under rc/NAME/NAME_sSEED.txt, outputs under res/, benches under
# bench/) after every run; DEADLINE (s, default 580) and MIN (s, default 75): no run starts with under MIN s of
# the deadline left, and a run still going at the deadline is stopped. SRC (default .gpu) holds the xz proxy
# shards; they unpack to PROXY_DIR (default /tmp/proxy). A run whose log has a summary is skipped; a log without
# one (a run cut short) is moved aside to .cut, so that its run id can start again. TESTS: a pytest -k
# expression over tests/test_training.py, run last if 60 s are left.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out} DEADLINE=${DEADLINE:-580} MIN=${MIN:-75} SRC=${SRC:-.gpu} data=${PROXY_DIR:-/tmp/proxy}
start=$SECONDS
left() { echo $((DEADLINE - (SECONDS - start))); }
save() { tar czf "$OUT/pq.tgz" -C /tmp rc res bench 2>/dev/null; }
mkdir -p "$OUT" /tmp/rc /tmp/res /tmp/bench
[ -f "$data/proxy_val_000000.bin" ] || python3 data/proxy.py --src "$SRC" --dst "$data" --train 2 > /dev/null
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > /tmp/res/gpu.txt 2>&1
cat /tmp/res/gpu.txt
scaled=(--train_files "$data/proxy_train_*.bin" --val_files "$data/proxy_val_*.bin" --val_tokens 1572864
        --val_every 5 --warmup_steps 3 --num_steps 118 --extension_steps 3 --momentum_warmup_steps 22
        --momentum_cooldown_steps 4)
while read -r line; do
  set -- $line; [ $# -lt 3 ] && continue
  if (( $(left) < MIN )); then echo "not run: $line"; continue; fi
  if [ "$1" = bench ]; then kind=bench name=$2 seed=- cap=$3; else kind=run name=$1 seed=$2 cap=$3; fi
  shift 3
  runner=(python3); [ "$cap" != - ] && runner=(python3 records/bench/capped.py "$cap")
  t0=$SECONDS
  if [ $kind = bench ]; then
    [ -f "/tmp/bench/${name}_done" ] && continue
    timeout $(( $(left) - 5 )) "${runner[@]}" records/bench/stagebench.py --out /tmp/bench --name "$name" \
      --n "${BENCH_N:-10}" -- "$@" < /dev/null > "/tmp/bench/${name}_stdout.txt" 2>&1 \
      && touch "/tmp/bench/${name}_done" || echo "bench $name stopped"
    tail -6 "/tmp/bench/${name}_stdout.txt" | cut -c1-200
  else
    log=/tmp/rc/$name/${name}_s$seed.txt
    grep -q '^summary:' "$log" 2>/dev/null && continue
    [ -f "$log" ] && mv "$log" "$log.cut"
    mkdir -p "/tmp/rc/$name"
    PYTHONUNBUFFERED=1 timeout $(( $(left) - 5 )) "${runner[@]}" train_gpt.py "${scaled[@]}" "$@" --seed "$seed" \
      --log_dir "/tmp/rc/$name" --run_id "${name}_s$seed" < /dev/null > "/tmp/res/p_${name}_s$seed.txt" 2>&1
    grep -hE '^summary|^note|^error' "/tmp/res/p_${name}_s$seed.txt" | sed 's/ log:.*//' | cut -c1-220
  fi
  echo "$name $seed: $((SECONDS - t0)) s"
  save
done < "$1"
if [ -n "${TESTS:-}" ] && (( $(left) > 60 )); then
  timeout $(( $(left) - 5 )) python3 -m pytest -q tests/test_training.py -k "$TESTS" > /tmp/res/cuda_tests.txt 2>&1
  tail -3 /tmp/res/cuda_tests.txt
fi
echo "total $((SECONDS - start)) s"; save
