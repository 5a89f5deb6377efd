#!/usr/bin/env bash
# ZeRO offload on one rank through `porter train`: the largest model that trains on a 1 GiB
# simulated device (1) at ZeRO stage 2 with the optimizer offloaded (the device keeps the
# 16-bit parameters: DeepSpeed's 2 Psi rule) and (2) at stage 3 with the optimizer and the
# parameters offloaded (the device keeps none of the model states: the host's memory is the
# limit), each against the same model with no offload on a device that holds it. Prints a
# `porter estimate` search table and a step-time table per stage; the figures and how to read
# them are in docs/benchmarks.md, "ZeRO offload on one rank".
# Usage: bench/offload_one_rank.sh [stage2|stage3|all]   (build the porter target first)
# Environment: PORTER (build/release/cli/porter); RUNS (3) and STEPS (4: the first is skipped)
# per mode; DEVICE (1GiB: the offloaded runs' device); PINNED (12GiB: porter.device.pinned_limit,
# whose 8 GiB default is below these models' pinned host states); S2_LAYERS (69), S2_HIDDEN
# (768), S2_HEADS (12), S2_ROOMY (10GiB: the no-offload device) for stage 2; S3_LAYERS (74: the
# largest, trained once, offloaded), S3_CMP_LAYERS (69: the model of the comparison), S3_HIDDEN
# (768), S3_HEADS (12), S3_ROOMY (10GiB), S3_RUNS (RUNS) for stage 3; NEXT (0; 1 also trains the
# next layer count up for one step at DEVICE, to show where it stops); IDLE_WAIT_S (30: how
# long to wait for an idle machine before each run); OUT (a temporary directory; set it to
# keep the reports and logs).
# Every run holds ~14-16 GB of host memory (16-18 bytes per parameter of model states, pinned
# or as the simulated device's memory, plus the process's own): run nothing big beside it.
# A run of these ~0.5B-parameter models spends ~2 minutes setting up (initialisation and the
# kernel and cost profiles) before its first step; the whole script takes ~45 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in stage2 | stage3 | all) ;; *) echo "usage: $0 [stage2|stage3|all]" >&2; exit 1 ;; esac
porter=${PORTER:-build/release/cli/porter}
runs=${RUNS:-3}
steps=${STEPS:-4}
device=${DEVICE:-1GiB}
pinned=${PINNED:-12GiB}
idle_wait=${IDLE_WAIT_S:-30}
next=${NEXT:-0}
if [[ -n ${OUT:-} ]]; then
  out=$OUT
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
idle_indent="    "
# shellcheck source=bench/idle.sh
source bench/idle.sh  # the script runs from the repository root (cd above)
[[ -x $porter ]] || { echo "$porter not found: cmake --build build/release --target porter" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "/usr/bin/time not found (apt-get install time)" >&2; exit 1; }
[[ $(getconf CLK_TCK) == 100 ]] || { echo "CLK_TCK is not 100" >&2; exit 1; }

# timed NAME COMMAND...: runs it under /usr/bin/time (output in $out/NAME.log); $out/NAME.other
# gets the CPU-seconds other processes used meanwhile, the wall time and the maximum RSS (KB).
timed() {
  local name=$1 t0 t1 rc wall user sys rss
  shift
  if [[ -f $out/$name.other && -f $out/$name.json ]]; then
    echo "    kept from an earlier invocation with this OUT: $out/$name.json"
    return 0
  fi
  wait_idle
  t0=$(cpu_busy_ticks)
  set +e
  /usr/bin/time -f "%e %U %S %M" -o "$out/$name.time" "$@" > "$out/$name.log" 2>&1
  rc=$?
  set -e
  t1=$(cpu_busy_ticks)
  read -r wall user sys rss < <(tail -1 "$out/$name.time")
  python3 -c "import sys; w,u,s,t,r=map(float,sys.argv[1:]); print(f'{max(0.0,t-u-s):.1f}', w, int(r))" \
    "$wall" "$user" "$sys" "$((t1 - t0))e-2" "$rss" > "$out/$name.other"
  local o w k
  read -r o w k < "$out/$name.other"
  echo "    exit $rc; $w s wall, max RSS $((k / 1024)) MiB; other processes used $o CPU-s meanwhile"
  return $rc
}

echo "== machine"
lscpu | grep -E "Model name" | sed 's/^/  /'
echo "  ISA flags: $(lscpu | grep -E '^Flags' | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512bw|avx512vl|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|amx_int8)$' | tr '\n' ' ')"
echo "  cores: $(nproc); memory: $(free -g | awk '/^Mem:/ {print $2}') GiB; porter: $porter ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"

# search STAGE CONFIG HIDDEN HEADS LAYERS...: porter estimate's Psi, predicted device peak,
# verdict and host bytes per rank for each layer count, at DEVICE, one line each.
search() {
  local stage=$1 config=$2 hidden=$3 heads=$4 layers
  shift 4
  for layers in "$@"; do
    "$porter" estimate --config "$config" --set porter.device.memory_limit="$device" \
      --set porter.model.layers="$layers" --set porter.model.hidden="$hidden" \
      --set porter.model.heads="$heads" > "$out/est-$stage-$hidden-$layers.txt"
    python3 - "$out/est-$stage-$hidden-$layers.txt" "$layers" "$hidden" "$heads" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
psi = int(re.search(r"Psi = (\d+)", t).group(1))
v = re.search(r"verdict \([^)]*\): (.*)", t).group(1)
peak = re.search(r"fits: ([0-9.]+ [KMG]iB) of", v) or re.search(r"needs ([0-9.]+ [KMG]iB)", v)
host = re.search(r"host per rank ([0-9.]+ [KMG]iB)", t).group(1)
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {psi / 1e6:.2f}M | {psi / 536870912:.3f} "
      f"| {peak.group(1)} | {'fits' if v.startswith('fits') else 'does not fit'} | {host} |")
PY
  done
}

# bench STAGE CONFIG LAYERS HIDDEN HEADS ROOMY NO_OFFLOAD...: RUNS runs of STEPS steps of the
# model offloaded at DEVICE and not offloaded at ROOMY, alternating, then the table.
bench() {
  local stage=$1 config=$2 layers=$3 hidden=$4 heads=$5 roomy=$6 runs=$7 r mode
  shift 7
  local no_offload=("$@")
  local model=(--set porter.model.layers="$layers" --set porter.model.hidden="$hidden"
    --set porter.model.heads="$heads" --set porter.device.pinned_limit="$pinned")
  local offload=(--set porter.device.memory_limit="$device")
  local plain=("${no_offload[@]}" --set porter.device.memory_limit="$roomy")
  "$porter" estimate --config "$config" "${model[@]}" "${offload[@]}" > "$out/$stage-estimate.txt"
  "$porter" estimate --config "$config" "${model[@]}" "${plain[@]}" > "$out/$stage-estimate-roomy.txt"
  for ((r = 1; r <= runs; r++)); do
    # Alternate the order, so that a slow spell of the machine does not fall on one mode.
    local modes=(offload roomy)
    ((r % 2 == 0)) && modes=(roomy offload)
    for mode in "${modes[@]}"; do
      local extra=("${offload[@]}")
      [[ $mode == roomy ]] && extra=("${plain[@]}")
      echo "  run $r, $mode: $porter train --config $config ${model[*]} ${extra[*]} --steps $steps --report ..."
      timed "$stage-$mode-$r" "$porter" train --config "$config" "${model[@]}" "${extra[@]}" \
        --steps "$steps" --report "$out/$stage-$mode-$r.json" ||
        { tail -30 "$out/$stage-$mode-$r.log" >&2; exit 1; }
    done
  done
  if ((next)); then
    echo "  next size up: $porter train --config $config ${model[*]/porter.model.layers=$layers/porter.model.layers=$((layers + 1))} ${offload[*]} --steps 1"
    local up=("${model[@]}")
    up[1]=porter.model.layers=$((layers + 1))
    timed "$stage-next" "$porter" train --config "$config" "${up[@]}" "${offload[@]}" --steps 1 \
      --report "$out/$stage-next.json" || true
    grep -m1 -E "^error" "$out/$stage-next.log" | cut -c1-200 | sed 's/^/    /' || true
  fi
  python3 - "$out" "$stage" "$runs" <<'PY'
import json, re, statistics as st, sys
out, stage, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
med = st.median
GiB, MiB = 2**30, 2**20
est = open(f"{out}/{stage}-estimate.txt").read()
psi = int(re.search(r"Psi = (\d+)", est).group(1))
rows = {}
for mode in ("offload", "roomy"):
    per_run = []
    for r in range(1, runs + 1):
        rep = json.load(open(f"{out}/{stage}-{mode}-{r}.json"))
        z, n = rep["zero"], rep["steps"]
        o = z["offload_optimizer"] or {}
        p = z["offload_param"] or {}
        other, wall, rss = open(f"{out}/{stage}-{mode}-{r}.other").read().split()
        per_run.append({
            "step": med(rep["step_times_s"][1:]),
            "cap": rep["memory"]["capacity_bytes"] / GiB,
            "peak": rep["memory"]["peak_bytes"] / MiB,
            "host": (o.get("host_bytes", 0) + p.get("host_bytes", 0)) / GiB,
            "update": o.get("cpu_update_s", 0.0) / n,
            "exposed": o.get("exposed_s", 0.0) / n,
            "d2h_wait": o.get("d2h_wait_s", 0.0) / n,
            "gather_exposed": z["gather_exposed_s"] / n,
            "rss": int(rss) / 2**20, "wall": float(wall), "other": float(other),
        })
    rows[mode] = {k: med(x[k] for x in per_run) for k in per_run[0]}
    rows[mode]["steps"] = [f"{x['step']:.2f}" for x in per_run]
    rows[mode]["others"] = [f"{x['other']:.0f}" for x in per_run]
    rows[mode]["walls"] = [f"{x['wall']:.0f}" for x in per_run]
states = 18 * psi
print(f"\nmodel: Psi = {psi / 1e6:.2f}M parameters = {psi / 536870912:.3f} x 537M (2 Psi bytes "
      f"= 1 GiB); model states (2+4+12) Psi = {states / GiB:.2f} GiB = "
      f"{states / (rows['offload']['cap'] * GiB):.2f}x the {rows['offload']['cap']:.2f} GiB device")
off_label = {"stage2": "stage 2, optimizer offloaded",
             "stage3": "stage 3, optimizer + parameters offloaded"}[stage]
print("\n| run | device | model states / device | device peak | host model states (pinned) "
      "| max RSS | step, median (runs) | host AdamW / step | offload exposed / step "
      "| gathers exposed / step |")
print("|---|---|---|---|---|---|---|---|---|---|")
for mode, label in (("offload", off_label), ("roomy", f"{stage[:5]} {stage[5:]}, no offload")):
    x = rows[mode]
    off = x["host"] > 0
    host = f"{x['host']:.2f} GiB" if off else "-"
    upd = f"{x['update']:.2f} s" if off else "on the device"
    exp = f"{x['exposed']:.2f} s" if off else "-"
    print(f"| {label} | {x['cap']:.2f} GiB | {states / (x['cap'] * GiB):.2f}x | {x['peak']:.1f} MiB "
          f"| {host} | {x['rss']:.1f} GiB | {x['step']:.2f} s ({', '.join(x['steps'])}) "
          f"| {upd} | {exp} | {x['gather_exposed'] * 1e3:.0f} ms |")
o, n = rows["offload"], rows["roomy"]
print(f"\noffloaded / not offloaded: step {o['step'] / n['step']:.2f}x "
      f"({o['step'] - n['step']:+.2f} s); offload exposed {o['exposed'] / o['step'] * 100:.0f}% of "
      f"the offloaded step (gradient copies' wait {o['d2h_wait'] * 1e3:.1f} ms of it)")
print(f"other processes' CPU-s during each run: offloaded {', '.join(o['others'])}; "
      f"not offloaded {', '.join(n['others'])}; wall s: {', '.join(o['walls'])}; "
      f"{', '.join(n['walls'])}")
print("step: median of steps 2.. of each run, then over runs. host AdamW (cpu_update_s), exposed "
      "(exposed_s) and gathers exposed: the report's totals over all steps / steps, median over "
      "runs. max RSS: /usr/bin/time's, of the whole process")
PY
}

header="| layers | hidden | heads | Psi | Psi / 537M | predicted device peak | verdict at $device | host per rank |"
if [[ $what != stage3 ]]; then
  s2=examples/gpt-offload-stage2-one-rank.json
  echo
  echo "== stage 2, optimizer offloaded: $s2, seq 256, micro-batch 1, $device device"
  echo "  search: $porter estimate --config $s2 --set porter.device.memory_limit=$device" \
    "--set porter.model.layers=L --set porter.model.hidden=H --set porter.model.heads=A"
  echo
  echo "$header"
  echo "|---|---|---|---|---|---|---|---|"
  search stage2 "$s2" 768 12 66 68 69 70 72
  search stage2 "$s2" 1024 16 36 37 38 39 40
  echo
  bench stage2 "$s2" "${S2_LAYERS:-69}" "${S2_HIDDEN:-768}" "${S2_HEADS:-12}" "${S2_ROOMY:-10GiB}" "$runs" \
    --set zero_optimization.offload_optimizer.device=none
fi
if [[ $what != stage2 ]]; then
  s3=examples/gpt-offload-one-rank.json
  echo
  echo "== stage 3, optimizer + parameters offloaded: $s3, seq 256, micro-batch 1, $device device"
  echo "  search: $porter estimate --config $s3 --set porter.device.memory_limit=$device" \
    "--set porter.model.layers=L --set porter.model.hidden=H --set porter.model.heads=A"
  echo
  echo "$header"
  echo "|---|---|---|---|---|---|---|---|"
  search stage3 "$s3" 768 12 68 74 80 96 128
  search stage3 "$s3" 1024 16 40 42 48
  echo
  # The largest model: host-bound, and its run without offload would need more host memory
  # than this machine gives one run (~16 GB), so it trains once, offloaded only.
  l3=${S3_LAYERS:-74}
  largest=(--set porter.model.layers="$l3" --set porter.model.hidden="${S3_HIDDEN:-768}"
    --set porter.model.heads="${S3_HEADS:-12}" --set porter.device.pinned_limit="$pinned"
    --set porter.device.memory_limit="$device")
  echo "  largest: $porter train --config $s3 ${largest[*]} --steps $steps --report ..."
  timed stage3-largest "$porter" train --config "$s3" "${largest[@]}" --steps "$steps" \
    --report "$out/stage3-largest.json" || { tail -30 "$out/stage3-largest.log" >&2; exit 1; }
  python3 - "$out" <<'PY'
import json, statistics as st, sys
out = sys.argv[1]
rep = json.load(open(f"{out}/stage3-largest.json"))
z, n = rep["zero"], rep["steps"]
o, p = z["offload_optimizer"], z["offload_param"]
other, wall, rss = open(f"{out}/stage3-largest.other").read().split()
psi = rep["num_params"]
print(f"    Psi = {psi / 1e6:.2f}M ({psi / 536870912:.3f} x 537M), model states 18 Psi = "
      f"{18 * psi / 2**30:.2f} GiB = {18 * psi / rep['memory']['capacity_bytes']:.2f}x the device; "
      f"device peak {rep['memory']['peak_bytes'] / 2**20:.1f} MiB; host model states "
      f"{(o['host_bytes'] + p['host_bytes']) / 2**30:.2f} GiB; max RSS {int(rss) / 2**20:.1f} GiB; "
      f"step (median of steps 2..) {st.median(rep['step_times_s'][1:]):.2f} s; host AdamW "
      f"{o['cpu_update_s'] / n:.2f} s and offload exposed {o['exposed_s'] / n:.2f} s per step; "
      f"gathers exposed {z['gather_exposed_s'] / n * 1e3:.0f} ms per step")
PY
  echo
  echo "  against no offload, at S3_CMP_LAYERS (${S3_CMP_LAYERS:-69}) layers: the largest whose run" \
    "without offload stays under ~16 GB of host memory"
  bench stage3 "$s3" "${S3_CMP_LAYERS:-69}" "${S3_HIDDEN:-768}" "${S3_HEADS:-12}" "${S3_ROOMY:-10GiB}" \
    "${S3_RUNS:-$runs}" \
    --set zero_optimization.offload_optimizer.device=none \
    --set zero_optimization.offload_param.device=none
fi
