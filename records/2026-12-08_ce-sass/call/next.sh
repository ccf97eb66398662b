#!/usr/bin/env bash
# The device calls this record could not make (no machine was lent), for the next session. Before them:
#   mkdir -p .gpu && cp ../shared/data/proxy_val_000000.bin.xz ../shared/data/proxy_train_00000[12].bin.xz .gpu/
#   git show a410aa0:train_gpt.py > .gpu/old_tg.py      # main before this record's CE kernel
#   cp records/2026-12-08_ce-sass/call/next.sh .gpu/
# and shrink the tree under the carry's 64 MiB as in records/2026-12-07_flags-alone-h100. Then
#   run: OUT=$OUT bash .gpu/next.sh A      (carry .gpu), and the same with B on the warm machine.
# A: the CUDA tests, the CE kernel before and after (each launch twice), the attention launches with and
#    without TMA. B: stage benches before and after, each with its profile.
set -u
part=$1 start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_$part.txt
[ -f /tmp/proxy/proxy_val_000000.bin ] || python3 data/proxy.py --src .gpu --dst /tmp/proxy --train 2 > /dev/null
if [ "$part" = A ]; then
  timeout 240 python3 -m pytest -q tests/test_training.py -k cuda > $OUT/cuda_tests.txt 2>&1
  tail -3 $OUT/cuda_tests.txt
  for rep in 1 2; do  # the kernel before keeps its default launch's output; after's launches are checked against it
    python3 records/bench/cebench.py --script .gpu/old_tg.py --n 40 --out $OUT/cebench.txt --save /tmp/ce_old.pt \
      > /dev/null 2>> $OUT/ce_err.txt
    python3 records/bench/cebench.py --n 40 --out $OUT/cebench.txt --against /tmp/ce_old.pt \
      > /dev/null 2>> $OUT/ce_err.txt
  done
  cat $OUT/cebench.txt
  timeout $((580 - (SECONDS - start))) python3 records/bench/attnbench.py /tmp/proxy/proxy_train_000001.bin \
    --out $OUT/attn > $OUT/attn_stdout.txt 2>&1; tail -4 $OUT/attn_stdout.txt
else
  python3 records/bench/stagebench.py --out $OUT/bench --name before --n 10 --script .gpu/old_tg.py \
    > $OUT/bench_before.txt 2>&1; tail -3 $OUT/bench_before.txt
  timeout $((580 - (SECONDS - start))) python3 records/bench/stagebench.py --out $OUT/bench --name after --n 10 \
    > $OUT/bench_after.txt 2>&1; tail -3 $OUT/bench_after.txt
fi
echo "total $((SECONDS - start)) s"
