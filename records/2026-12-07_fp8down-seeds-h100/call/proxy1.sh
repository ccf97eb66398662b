# proxy1.sh NAME SEED [CAP_GIB|-] FLAGS...: one 118-step proxy run (recipe.sh's flags), log to /tmp/rc/NAME/NAME_sSEED.txt
name=$1 seed=$2 cap=$3; shift 3
data=/tmp/proxy
runner=(python3); [ "$cap" != - ] && runner=(python3 .gpu/capped.py "$cap")
mkdir -p /tmp/rc/$name
t0=$SECONDS
PYTHONUNBUFFERED=1 "${runner[@]}" train_gpt.py --train_files "$data/proxy_train_*.bin" --val_files "$data/proxy_val_*.bin" \
  --val_tokens 1572864 --val_every 5 --warmup_steps 3 --num_steps 118 --extension_steps 3 --momentum_warmup_steps 22 \
  --momentum_cooldown_steps 4 "$@" --seed $seed --log_dir /tmp/rc/$name --run_id ${name}_s$seed 2>&1 \
  | grep -v '^step:[0-9]*/[0-9]* train_loss\|^warmup_step' | tail -3
echo "$name s$seed: $((SECONDS - t0)) s"
