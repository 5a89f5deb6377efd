#!/usr/bin/env bash
# What periodic checkpoints cost a run (Note [Background checkpoints] in engine/checkpointer.h):
# `porter train` on 2 ranks, ZeRO-2, a GPT at hidden 768 (2 layers, seq 256, micro-batch 2,
# 116.6 MB of checkpointed state per rank), with a checkpoint after every step and without
# any. Prints, per run, the medians of the step time with and without saves, and of the
# snapshot (the only part a step waits for), the background write and rank 0's publish, from
# each run's --report. The figures are in docs/benchmarks.md, "Periodic checkpoints".
# Usage: bench/checkpoint_save.sh   (build the porter target first)
# Environment: PORTER (build/release/cli/porter), RUNS (3), STEPS (12; the first two steps of
# each run are left out of the step medians), OUT (a temporary directory; set it to keep the
# reports), IDLE_WAIT_S (30).
set -euo pipefail
cd "$(dirname "$0")/.."
porter=${PORTER:-build/release/cli/porter}
runs=${RUNS:-3}
steps=${STEPS:-12}
out=${OUT:-$(mktemp -d)}
idle_wait=${IDLE_WAIT_S:-30}
# shellcheck source=bench/idle.sh
source bench/idle.sh
mkdir -p "$out"
bench/machine_info.sh 2> /dev/null | head -5 || true

cat > "$out/config.json" <<'JSON'
{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000000},
  "porter": {
    "model": {"layers": 2, "hidden": 768, "heads": 12, "seq_len": 256, "vocab": 256},
    "data": {"type": "synthetic", "seed": 1},
    "device": {"type": "cpu", "threads": 1},
    "checkpointing": {"policy": "full"},
    "train": {"seed": 42, "log_every": 1}
  }
}
JSON

summary() {  # report.json -> "median step s; snapshot s; write s; publish s; bytes"
  /usr/bin/python3 - "$1" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
t = r["step_times_s"][2:]
c = r["checkpoints"]
med = lambda xs: statistics.median(xs) if xs else float("nan")
print("%.3f %.4f %.3f %.3f %d" % (med(t), med([x["snapshot_s"] for x in c[1:]]),
      med([x["write_s"] for x in c]), med([x["publish_s"] for x in c]),
      c[0]["bytes"] if c else 0))
PY
}

printf '%-4s %-12s %-14s %-14s %-12s %-12s %-12s\n' run mode "median step" "first snapshot" \
  "snapshot" "write" "publish"
for i in $(seq 1 "$runs"); do
  for mode in none every-step; do
    wait_idle > /dev/null
    args=()
    [ "$mode" = every-step ] && args=(--save "$out/run-$i" --save-every 1)
    rm -rf "$out/run-$i"
    "$porter" train --config "$out/config.json" --nproc 2 --steps "$steps" \
      --report "$out/$mode-$i.json" "${args[@]}" > "$out/$mode-$i.log" 2>&1
    read -r step snap write publish bytes <<< "$(summary "$out/$mode-$i.json")"
    first=-
    if [ "$mode" = every-step ]; then
      first=$(/usr/bin/python3 -c 'import json,sys; print("%.3f" % json.load(open(sys.argv[1]))["checkpoints"][0]["snapshot_s"])' "$out/$mode-$i.json")
    fi
    printf '%-4s %-12s %-14s %-14s %-12s %-12s %-12s\n' "$i" "$mode" "${step} s" "$first" \
      "$([ "$mode" = none ] && echo - || echo "$snap s")" \
      "$([ "$mode" = none ] && echo - || echo "$write s")" \
      "$([ "$mode" = none ] && echo - || echo "$publish s")"
  done
done
echo "(checkpointed state per rank: ${bytes} bytes; reports in $out)"
