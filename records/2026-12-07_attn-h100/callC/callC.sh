#!/bin/bash
# CUDA tests (the rehearsal fix, window_attention's test); window_attention against Flex at stage 3's shapes;
# stage benches --attn_kernel 1 then the default (Flex) in one call; then the default's proxy seed 0 if time is left
set -u
OUT=${OUT:-/tmp/out}; DEADLINE=${DEADLINE:-580}; start=$SECONDS
left() { echo $((DEADLINE - (SECONDS - start))); }
save() { tar czf $OUT/c.tgz -C /tmp res bench rc 2>/dev/null; }
mkdir -p /tmp/res /tmp/rc /tmp/bench
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > /tmp/res/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> /tmp/res/gpu.txt
cat /tmp/res/gpu.txt
python3 data/proxy.py --src .gpu --dst /tmp/proxy --train 2 > /dev/null
(time timeout 150 python3 -m pytest -q tests/test_training.py -k "cuda and (window_attention or rehearsal or fp8_down)" -s) > /tmp/res/cuda_tests.txt 2>&1
grep -E "passed|failed|Error|^FAILED" /tmp/res/cuda_tests.txt | tail -8
echo "after tests: $((SECONDS - start)) s"; save
OUT=/tmp/res timeout 130 python3 .gpu/attn_bench.py > /tmp/res/attn_stdout.txt 2>&1; grep -E "^==|per pass|Error" /tmp/res/attn_stdout.txt | tail -8
echo "after attn bench: $((SECONDS - start)) s"; save
for arm in attn flex; do
  if (( $(left) > 120 )); then
    extra=(); [ $arm = attn ] && extra=(-- --attn_kernel 1)
    timeout $(( $(left) < 190 ? $(left) - 5 : 190 )) python3 records/bench/stagebench.py --out /tmp/bench --name $arm "${extra[@]}" > /tmp/bench/${arm}_stdout.txt 2>&1 || echo "stagebench $arm stopped"
    tail -4 /tmp/bench/${arm}_stdout.txt
  fi
  echo "after bench $arm: $((SECONDS - start)) s"; save
done
if (( $(left) > 100 )); then timeout $(( $(left) - 5 )) bash .gpu/proxy1.sh on 0 -; fi
echo "total $((SECONDS - start)) s"; save
