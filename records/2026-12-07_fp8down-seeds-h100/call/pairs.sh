#!/bin/bash
# pairs.sh FILE: FILE's lines ("NAME SEED CAP|- FLAGS...", proxy1.sh's) two at a time, both on the GPU at once: for
# final losses only (each run's timing is void). Finished logs are skipped; no pair starts with under MIN s left.
set -u
OUT=${OUT:-/tmp/out}; DEADLINE=${DEADLINE:-580}; MIN=${MIN:-150}; start=$SECONDS
left() { echo $((DEADLINE - (SECONDS - start))); }
save() { tar czf $OUT/rc.tgz -C /tmp rc res 2>/dev/null; }
mkdir -p /tmp/rc /tmp/res
[ -f /tmp/proxy/proxy_val_000000.bin ] || python3 data/proxy.py --src .gpu --dst /tmp/proxy --train 2 > /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/res/gpu.txt
cat /tmp/res/gpu.txt
todo=()
while read -r line; do
  set -- $line; [ $# -lt 3 ] && continue
  grep -q '^summary:' /tmp/rc/$1/$1_s$2.txt 2>/dev/null || todo+=("$line")
done < "$1"
for ((i = 0; i < ${#todo[@]}; i += 2)); do
  if (( $(left) < MIN )); then echo "not run: ${todo[@]:i}"; break; fi
  for line in "${todo[@]:i:2}"; do
    set -- $line
    timeout $(( $(left) - 5 )) bash .gpu/proxy1.sh $line < /dev/null > /tmp/res/p_$1_s$2.txt 2>&1 &
    sleep 2
  done
  wait
  for line in "${todo[@]:i:2}"; do set -- $line; grep -hE "^summary|s[0-9]+: " /tmp/res/p_$1_s$2.txt | sed 's/ log:.*//' | cut -c1-160; done
  save
done
echo "total $((SECONDS - start)) s"; save
