#!/usr/bin/env bash
# Compares porter's predicted step time on the cpu device with the measured one, policy by
# policy: for each row it runs `porter plan --json` (the device model calibrated on this
# machine, docs/planning.md) and then `porter train --report` on the same config, and prints
# one Markdown row: the predicted total and its parts, the median of the measured steps after
# the warm-up, measured / predicted, and the predicted MFU. Each plan calibrates the device
# again just before its run is trained, so both see the same load; the row prints the f32
# peak that calibration measured and the 1-minute load average before the plan.
# The calibration is short (a few 1024^3 matmuls and a 32 MiB memcpy), so on a shared machine
# it moves with the load. The last two columns therefore also plan each row on pinned figures:
# the best f32 peak and memory bandwidth of CALIBRATIONS plans of `none` made at the start
# (porter.device.peak_tflops and porter.device.hbm_gbps; per kernel-thread count).
#   scripts/step_time_vs_plan.sh [ROWS...]
# ROWS: none full selective uniform sqrt optimal zero2 offload (default: all of them).
# Environment: PORTER (default build/release/cli/porter), STEPS (8), WARMUP (2, steps left
# out of the median), OUT (a folder for the configs, plans, reports and logs; default a new
# temporary one), CALIBRATIONS (5).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
porter=${PORTER:-$root/build/release/cli/porter}
steps=${STEPS:-8}
warmup=${WARMUP:-2}
calibrations=${CALIBRATIONS:-5}
out=${OUT:-$(mktemp -d /tmp/step_time_vs_plan.XXXXXX)}
mkdir -p "$out"
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(none full selective uniform sqrt optimal zero2 offload)

# A GPT whose matmuls are all above the cpu kernels' thresholds: 4 layers, hidden 768,
# 12 heads, 512 tokens, micro-batch 4 (2048 tokens), vocab 8192, f32, one micro-batch per step.
config=$out/config.json
cat > "$config" <<'EOF'
{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
  "zero_optimization": {"stage": 0},
  "porter": {
    "model": {"layers": 4, "hidden": 768, "heads": 12, "seq_len": 512, "vocab": 8192, "dropout": 0.0},
    "data": {"type": "synthetic", "seed": 7},
    "device": {"type": "cpu", "memory_limit": "16GiB", "pinned_limit": "4GiB", "threads": 2},
    "train": {"steps": 8, "seed": 42, "log_every": 1}
  }
}
EOF

row_args() {  # the row's name -> its --set arguments (and the launcher's)
  case $1 in
    none|full|selective|sqrt) echo "--set porter.checkpointing.policy=$1" ;;
    optimal) echo "--set porter.checkpointing.policy=optimal --set porter.checkpointing.memory_budget=0.5" ;;
    # Two ranks on two cores: one kernel thread each.
    zero2) echo "--set zero_optimization.stage=2 --set zero_optimization.overlap_comm=true --set porter.device.threads=1" ;;
    # Uniform: 2 segments of 2 blocks.
    uniform) echo "--set porter.checkpointing.policy=uniform --set activation_checkpointing.number_checkpoints=2" ;;
    offload) echo "--set porter.checkpointing.policy=uniform --set activation_checkpointing.number_checkpoints=2 --set activation_checkpointing.cpu_checkpointing=true --set porter.device.sim_link_gbps=12" ;;
    *) echo "unknown row '$1' (expected none full selective uniform sqrt optimal zero2 offload)" >&2; return 1 ;;
  esac
}

load1() { cut -d' ' -f1 /proc/loadavg; }

pinned() {  # kernel threads -> "--set" arguments pinning the best of $calibrations calibrations
  local threads=$1 i
  for ((i = 0; i < calibrations; i++)); do
    "$porter" plan --config "$config" --set porter.device.threads="$threads" --json \
      > "$out/calibration.t$threads.$i.json"
  done
  python3 - "$out"/calibration.t"$threads".*.json <<'EOF'
import json, sys
devices = [json.load(open(f))["device"] for f in sys.argv[1:]]
peak = max(d["f32_flops_per_s"] for d in devices)
hbm = max(d["hbm_bytes_per_s"] for d in devices)
print(f"--set porter.device.peak_tflops={peak / 1e12:.6f} --set porter.device.hbm_gbps={hbm / 1e9:.3f}")
EOF
}

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cpus"
echo "# uptime before: $(uptime)"
echo "# files: $out"
pinned_t2=$(pinned 2)
pinned_t1=$(pinned 1)
echo "# pinned, 2 threads: $pinned_t2"
echo "# pinned, 1 thread: $pinned_t1"
echo "| row | load | calibrated f32 GFLOP/s | predicted total | compute + recompute + exposed comm + exposed offload + optimizer | measured median (steps $((warmup + 1))..$steps) | measured / predicted | predicted MFU | predicted total, pinned | measured / pinned |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for row in "${rows[@]}"; do
  args=$(row_args "$row")
  launch=()
  plan_world=()
  pin=$pinned_t2
  if [ "$row" = zero2 ]; then launch=(--nproc 2); plan_world=(--world-size 2); pin=$pinned_t1; fi
  load=$(load1)
  # shellcheck disable=SC2086  # the row's arguments are words
  "$porter" plan --config "$config" $args "${plan_world[@]}" --json > "$out/$row.plan.json"
  # shellcheck disable=SC2086
  "$porter" plan --config "$config" $args $pin "${plan_world[@]}" --json > "$out/$row.pinned.json"
  # shellcheck disable=SC2086
  "$porter" train --config "$config" $args "${launch[@]}" --steps "$steps" \
    --report "$out/$row.report.json" > "$out/$row.train.log" 2>&1
  python3 - "$out/$row.plan.json" "$out/$row.report.json" "$row" "$load" "$warmup" \
    "$out/$row.pinned.json" <<'EOF'
import json, statistics, sys
plan = json.load(open(sys.argv[1]))
report = json.load(open(sys.argv[2]))
row, load, warmup = sys.argv[3], sys.argv[4], int(sys.argv[5])
pinned = json.load(open(sys.argv[6]))["step_time"]["total_s"]
t = plan["step_time"]
measured = statistics.median(report["step_times_s"][warmup:])
comm = t["exposed_dp_comm_s"] + t["exposed_tp_comm_s"]
offload = t["exposed_activation_offload_s"] + t["exposed_optimizer_offload_s"]
parts = " + ".join(f"{x:.3f}" for x in (t["compute_s"], t["recompute_s"], comm, offload, t["optimizer_s"]))
gflops = plan["device"]["f32_flops_per_s"] / 1e9
print(f"| {row} | {load} | {gflops:.1f} | {t['total_s']:.3f} s | {parts} | {measured:.3f} s "
      f"| {measured / t['total_s']:.2f} | {t['mfu']:.3f} | {pinned:.3f} s | {measured / pinned:.2f} |")
if plan["description"] != report["plan"]["description"]:
    print(f"|   | | | plan: {plan['description']} | train: {report['plan']['description']} | | | | | |")
EOF
done
echo "# uptime after: $(uptime)"
