#!/usr/bin/env bash
# Kill tests of porter's checkpoints (docs/training-state.md, "Run directories"):
#   1. a 2-rank run whose rank 1 is killed with SIGKILL mid-run finishes by itself with
#      --max-restarts, and its final checkpoint equals an uninterrupted run's, bit for bit;
#      repeated for kill steps drawn from the seeds in PORTER_KILL_SEEDS (default "1 2");
#   2. SIGTERM to the launcher: every rank saves, porter exits 5, and --resume continues to the
#      same final state;
#   3. a checkpoint write killed part-way leaves the previous checkpoint loadable.
# At a real size: hidden 768, seq 256, micro-batch 2 (every matmul above the kernel table's
# measured thresholds, as in ExactTest), dropout on, ZeRO-2 over 2 ranks, one kernel thread
# each, a checkpoint every 2 of 6 steps (two to three minutes on a 2-core machine).
# Usage: restart_test.sh PORTER WORKDIR
set -euo pipefail
porter=$1
work=$2
steps=6
rm -rf "$work"
mkdir -p "$work"
config="$work/config.json"
cat > "$config" <<'JSON'
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000000},
  "porter": {
    "model": {"layers": 2, "hidden": 768, "heads": 12, "seq_len": 256, "vocab": 256, "dropout": 0.1},
    "data": {"type": "synthetic", "seed": 1},
    "device": {"type": "cpu", "threads": 1},
    "checkpointing": {"policy": "full"},
    "comm": {"backend": "gloo", "timeout_s": 60},
    "train": {"seed": 42, "log_every": 1}
  }
}
JSON

fail() { echo "FAIL: $*" >&2; exit 1; }

# The sections of two checkpoints' rank directories are the same bytes (meta.json holds
# timings-free state only, but its "kernel_table" origin may differ: compare the .bin files).
same_state() {
  local a=$1 b=$2 n=0
  for f in $(cd "$a" && find . -name '*.bin' | sort); do
    cmp -s "$a/$f" "$b/$f" || fail "$a/$f differs from $b/$f"
    n=$((n + 1))
  done
  [ "$n" -gt 0 ] || fail "no sections in $a"
  [ "$(cd "$a" && find . -name '*.bin' | sort)" = "$(cd "$b" && find . -name '*.bin' | sort)" ] ||
    fail "$a and $b hold different sections"
}

common=(train --config "$config" --steps "$steps" --save-every 2)

# The reference: uninterrupted.
"$porter" "${common[@]}" --nproc 2 --save "$work/ref" > "$work/ref.log" 2>&1 ||
  { cat "$work/ref.log"; fail "the uninterrupted run failed"; }
[ "$(cat "$work/ref/latest")" = "step-$steps" ] || fail "ref: latest is not step-$steps"

# The pid of world rank $2 among the children of launcher $1.
rank_pid() {
  local launcher=$1 rank=$2 pid stat
  for stat in /proc/[0-9]*/stat; do
    pid=${stat#/proc/}
    pid=${pid%/stat}
    # Field 4 of /proc/<pid>/stat is the parent's pid (the name in field 2 has no spaces here).
    [ "$(cut -d' ' -f4 "$stat" 2> /dev/null)" = "$launcher" ] || continue
    if { tr '\0' '\n' < "/proc/$pid/environ"; } 2>/dev/null | grep -qx "RANK=$rank"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

# Waits until $1 (a log) has a progress line for step $2 or later from rank 0.
wait_for_step() {
  local log=$1 step=$2 i
  for i in $(seq 1 600); do
    if grep -Eq "\[rank 0\] step ([0-9]+)/$steps" "$log"; then
      local last
      last=$(grep -Eo "\[rank 0\] step [0-9]+/$steps" "$log" | tail -1 | sed -E 's/.*step ([0-9]+)\/.*/\1/')
      [ "$last" -ge "$step" ] && return 0
    fi
    sleep 0.1
  done
  fail "no step $step in $log"
}

for seed in ${PORTER_KILL_SEEDS:-1 2}; do
  RANDOM=$seed
  k=$((1 + RANDOM % (steps - 3)))  # leaves the run steps to go when the kill lands
  run="$work/kill-$k"
  "$porter" "${common[@]}" --nproc 2 --max-restarts 3 --save "$run" > "$run.log" 2>&1 &
  launcher=$!
  wait_for_step "$run.log" "$k"
  pid=$(rank_pid "$launcher" 1) || fail "rank 1 of launcher $launcher not found"
  kill -9 "$pid"
  wait "$launcher" || { cat "$run.log"; fail "the restarted run (killed after step $k) failed"; }
  grep -q "restarting the world from its latest checkpoint (restart 1 of 3)" "$run.log" ||
    { cat "$run.log"; fail "no restart logged after the kill at step $k"; }
  same_state "$work/ref/step-$steps" "$run/step-$steps"
  echo "seed $seed: rank 1 killed after step $k: restarted, final state bit-identical"
done

# SIGTERM to the launcher (as Slurm and Kubernetes preempt): saved, exit 5, resumable.
run="$work/term"
"$porter" "${common[@]}" --nproc 2 --save "$run" > "$run.log" 2>&1 &
launcher=$!
wait_for_step "$run.log" 2
kill -TERM "$launcher"
rc=0
wait "$launcher" || rc=$?
[ "$rc" = 5 ] || { cat "$run.log"; fail "SIGTERM: exit code $rc, expected 5"; }
grep -q "stopped by SIGTERM after step" "$run.log" || { cat "$run.log"; fail "no stop line"; }
grep -q "Resume with the same command and --resume $run" "$run.log" || fail "no resume hint"
"$porter" "${common[@]}" --nproc 2 --save "$run" --resume "$run" > "$run.resume.log" 2>&1 ||
  { cat "$run.resume.log"; fail "resume after SIGTERM failed"; }
same_state "$work/ref/step-$steps" "$run/step-$steps"
echo "SIGTERM: saved, exit 5, resumed to a bit-identical final state"

# A write killed part-way: a damaged newest checkpoint is skipped for the previous one.
run="$work/torn"
cp -r "$work/ref" "$run"
victim=$(find "$run/step-$steps" -name 'exp_avg.bin' | head -1)
truncate -s 100 "$victim"
"$porter" "${common[@]}" --nproc 2 --save "$run/out" --resume "$run" > "$run.log" 2>&1 ||
  { cat "$run.log"; fail "resume past a torn checkpoint failed"; }
grep -q "warning: --resume: skipping $run/step-$steps" "$run.log" ||
  { cat "$run.log"; fail "no warning about the torn checkpoint"; }
grep -q "resumed from $run/step-$((steps - 2)) at step $((steps - 2))" "$run.log" ||
  { cat "$run.log"; fail "did not resume from the previous checkpoint"; }
same_state "$work/ref/step-$steps" "$run/out/step-$steps"
echo "torn newest checkpoint: skipped with a warning, the previous one resumed bit-identically"

# The final checkpoint (2 ranks, ZeRO-2) resumes on 1 rank at stage 0 and on 2 ranks at stage 3
# with parameter offload; saved again there, it holds the same weights (porter consolidate of
# each, f32, bit for bit; the moments are compared element for element in EngineReshard).
data_of() {  # a safetensors file's tensor bytes (its header names its source)
  local f=$1 n
  n=$(od -An -t u8 -N 8 "$f" | tr -d ' ')
  tail -c +$((9 + n)) "$f"
}
"$porter" consolidate --checkpoint "$work/ref" --out "$work/ref.safetensors" --dtype f32 > /dev/null 2>&1
"$porter" train --config "$config" --steps "$steps" --resume "$work/ref/step-$steps" \
  --set zero_optimization.stage=0 --save "$work/one-rank" > "$work/one-rank.log" 2>&1 ||
  { cat "$work/one-rank.log"; fail "resuming on 1 rank at stage 0 failed"; }
"$porter" train --config "$config" --steps "$steps" --nproc 2 --resume "$work/ref/step-$steps" \
  --set zero_optimization.stage=3 --set 'zero_optimization.offload_param={"device": "cpu"}' \
  --save "$work/stage3" > "$work/stage3.log" 2>&1 ||
  { cat "$work/stage3.log"; fail "resuming on 2 ranks at stage 3 with parameter offload failed"; }
for layout in one-rank stage3; do
  "$porter" consolidate --checkpoint "$work/$layout" --out "$work/$layout.safetensors" --dtype f32 > /dev/null 2>&1
  cmp -s <(data_of "$work/ref.safetensors") <(data_of "$work/$layout.safetensors") ||
    fail "$layout: the weights differ from the checkpoint it resumed"
done
echo "2-rank ZeRO-2 checkpoint resumed on 1 rank at stage 0 and on 2 ranks at stage 3 with parameter offload: same weights"
