#!/bin/bash
# queue.sh FILE: FILE's lines ("NAME SEED CAP|- FLAGS...", proxy1.sh's) one at a time on the GPU; finished logs are
# skipped; no run starts with under MIN s left. Lines "bench NAME CAP|- FLAGS..." run stagebench.py (in a capped process).
set -u
OUT=${OUT:-/tmp/out}; DEADLINE=${DEADLINE:-580}; MIN=${MIN:-75}; start=$SECONDS
left() { echo $((DEADLINE - (SECONDS - start))); }
save() { tar czf $OUT/rc.tgz -C /tmp rc res bench 2>/dev/null; }
mkdir -p /tmp/rc /tmp/res /tmp/bench
[ -f /tmp/proxy/proxy_val_000000.bin ] || python3 data/proxy.py --src .gpu --dst /tmp/proxy --train 2 > /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/res/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> /tmp/res/gpu.txt
cat /tmp/res/gpu.txt
while read -r line; do
  set -- $line; [ $# -lt 3 ] && continue
  if (( $(left) < MIN )); then echo "not run: $line"; continue; fi
  if [ "$1" = bench ]; then
    name=$2 cap=$3; shift 3
    [ -f /tmp/bench/${name}_done ] && continue
    runner=(python3); [ "$cap" != - ] && runner=(python3 .gpu/capped.py "$cap")
    t0=$SECONDS
    timeout $(( $(left) - 5 )) "${runner[@]}" records/bench/stagebench.py --out /tmp/bench --name $name --n ${BENCH_N:-10} -- "$@" < /dev/null > /tmp/bench/${name}_stdout.txt 2>&1 && touch /tmp/bench/${name}_done || echo "bench $name stopped"
    tail -6 /tmp/bench/${name}_stdout.txt | cut -c1-200; echo "bench $name: $((SECONDS - t0)) s"
  else
    grep -q '^summary:' /tmp/rc/$1/$1_s$2.txt 2>/dev/null && continue
    timeout $(( $(left) - 5 )) bash .gpu/proxy1.sh $line < /dev/null > /tmp/res/p_$1_s$2.txt 2>&1
    grep -hE "^summary|s[0-9]+: |rror|note:" /tmp/res/p_$1_s$2.txt | sed 's/ log:.*//' | cut -c1-220
  fi
  save
done < "$1"
if [ -n "${TESTS:-}" ] && (( $(left) > 60 )); then
  timeout $(( $(left) - 5 )) python3 -m pytest -q tests/test_training.py -k "$TESTS" > /tmp/res/cuda_tests.txt 2>&1; tail -3 /tmp/res/cuda_tests.txt
fi
echo "total $((SECONDS - start)) s"; save
