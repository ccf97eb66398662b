#!/bin/bash
# port 6 (FP8 down projection): CUDA tests; stage bench of the default (FP8 down) and --fp8_down 0 in one call;
# the 118-step proxy, seeds alternating between the arms, as DEADLINE (s) leaves room
set -u
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-570}
start=$SECONDS
left() { echo $((DEADLINE - (SECONDS - start))); }
mkdir -p /tmp/res /tmp/bench /tmp/rc
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > /tmp/res/gpu.txt
echo "host: $(grep -m1 'model name' /proc/cpuinfo) cores $(nproc)" >> /tmp/res/gpu.txt
cat /tmp/res/gpu.txt
python3 data/proxy.py --src .gpu --dst /tmp/proxy --train 2 > /dev/null
(time timeout 170 python3 -m pytest -q tests/test_training.py -k cuda -s) > /tmp/res/cuda_tests.txt 2>&1
grep -E "passed|failed|Error" /tmp/res/cuda_tests.txt | tail -6
echo "after tests: $((SECONDS - start)) s"
for arm in fp8down bf16down; do
  if (( $(left) > 110 )); then
    extra=(); [ $arm = bf16down ] && extra=(-- --fp8_down 0)
    timeout $(( $(left) < 200 ? $(left) : 200 )) python3 records/bench/stagebench.py --out /tmp/bench --name $arm "${extra[@]}" > /tmp/bench/${arm}_stdout.txt 2>&1 || echo "stagebench $arm stopped"
    tail -4 /tmp/bench/${arm}_stdout.txt
  fi
  echo "after bench $arm: $((SECONDS - start)) s"
done
for seed in 0 1 2; do
  if (( $(left) > 130 )); then
    BUDGET_S=$(( $(left) - 10 )) records/bench/recipe.sh /tmp/rc .gpu "$seed" on= off=--fp8_down\ 0 2>&1 | tail -4
  fi
done
echo "total $((SECONDS - start)) s"
tar czf $OUT/c2.tgz -C /tmp res bench rc
