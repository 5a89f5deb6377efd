#!/usr/bin/env bash
# ZeRO offload through `porter train`: (1) the demo model's step with the optimizer offloaded
# against the optimizer on the device, and (2) examples/gpt-offload-10x.json (model states over
# 10x the device) against the same run without offload on a device that holds it. Prints both
# tables; the figures and how to read them are in docs/benchmarks.md, "ZeRO offload".
# Usage: bench/offload_step.sh [step|largest|all]   (build the porter target first)
# Environment: PORTER (build/release/cli/porter); RUNS (5), STEPS (50), WARMUP (5), LINK_GBPS
# (12) and STAGE (2) for the step table; BIG_RUNS (3) and BIG_STEPS (6) for the largest-model
# table (its first step is skipped); IDLE_WAIT_S (60: how long to wait for an idle machine);
# OTHER_MAX (0.5: a run during which other processes used more CPU-seconds is repeated, at
# most twice); OUT (a temporary directory; set it to keep the reports and traces).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in step | largest | all) ;; *) echo "usage: $0 [step|largest|all]" >&2; exit 1 ;; esac
porter=${PORTER:-build/release/cli/porter}
runs=${RUNS:-5}
big_runs=${BIG_RUNS:-3}
steps=${STEPS:-50}
warmup=${WARMUP:-5}
big_steps=${BIG_STEPS:-6}
link=${LINK_GBPS:-12}
stage=${STAGE:-2}
idle_wait=${IDLE_WAIT_S:-60}
other_max=${OTHER_MAX:-0.5}
big=examples/gpt-offload-10x.json
big_nproc=8          # the example's train_batch_size / micro-batch
big_roomy=128MiB     # a device that holds the model's shard of all three states
if [[ -n ${OUT:-} ]]; then
  out=$OUT
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
idle_indent="  "
# shellcheck source=bench/idle.sh
source bench/idle.sh  # the script runs from the repository root (cd above)
[[ -x $porter ]] || { echo "$porter not found: cmake --build build/release --target porter" >&2; exit 1; }

# Runs one command under /usr/bin/time, then prints the CPU-seconds that other processes used
# while it ran: /proc/stat's busy time over both cores, less the command's own.
timed() {  # timed NAME COMMAND...   (output in $out/NAME.log)
  local name=$1 t0 t1 rc wall user sys
  shift
  t0=$(cpu_busy_ticks)
  set +e
  /usr/bin/time -f "%e %U %S" -o "$out/$name.time" "$@" > "$out/$name.log" 2>&1
  rc=$?
  set -e
  t1=$(cpu_busy_ticks)
  read -r wall user sys < "$out/$name.time"
  python3 -c "import sys; w,u,s,t=map(float,sys.argv[1:]); print(f'{max(0.0,t-u-s):.2f}', w)" \
    "$wall" "$user" "$sys" "$((t1 - t0))e-2" > "$out/$name.other"
  echo "    $(cut -d' ' -f2 "$out/$name.other") s wall; other processes used" \
    "$(cut -d' ' -f1 "$out/$name.other") CPU-s meanwhile"
  return $rc
}
# measured NAME COMMAND...: timed after wait_idle, repeated (at most twice) while other
# processes used more than other_max CPU-seconds during it.
measured() {
  local attempt
  for attempt in 1 2 3; do
    wait_idle
    timed "$@" || return
    python3 -c "import sys; sys.exit(float(sys.argv[1]) > float(sys.argv[2]))" \
      "$(cut -d' ' -f1 "$out/$1.other")" "$other_max" && return 0
    ((attempt < 3)) && echo "    (the machine was busy: again)"
  done
  return 0
}
[[ -x /usr/bin/time ]] || { echo "/usr/bin/time not found (apt-get install time)" >&2; exit 1; }
[[ $(getconf CLK_TCK) == 100 ]] || { echo "CLK_TCK is not 100" >&2; exit 1; }

echo "== machine"
lscpu | grep -E "Model name" | sed 's/^/  /'
echo "  ISA flags: $(lscpu | grep -E '^Flags' | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512bw|avx512vl|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|amx_int8)$' | tr '\n' ' ')"
echo "  cores: $(nproc); porter: $porter ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"

if [[ $what != largest ]]; then
  echo
  echo "== step: examples/gpt-tiny.json at ZeRO stage $stage on 1 rank, link $link GB/s," \
    "$runs runs x $steps steps (first $warmup skipped), optimizer on the device and offloaded"
  common=(--config examples/gpt-tiny.json --set zero_optimization.stage="$stage"
    --set porter.device.sim_link_gbps="$link" --steps "$steps")
  for ((r = 1; r <= runs; r++)); do
    # Alternate the order, so that a slow spell of the machine does not fall on one mode.
    modes=(device offload)
    ((r % 2 == 0)) && modes=(offload device)
    for mode in "${modes[@]}"; do
      extra=()
      [[ $mode == offload ]] && extra=(--set zero_optimization.offload_optimizer.device=cpu)
      echo "  run $r, $mode: $porter train ${common[*]} ${extra[*]} --report ..."
      measured "step-$mode-$r" "$porter" train "${common[@]}" "${extra[@]}" \
        --report "$out/step-$mode-$r.json" || { tail -20 "$out/step-$mode-$r.log" >&2; exit 1; }
    done
  done
  # One more run of each with a trace, for the optimizer phase per step; the step times in
  # the table come from the untraced runs above.
  for mode in device offload; do
    extra=()
    [[ $mode == offload ]] && extra=(--set zero_optimization.offload_optimizer.device=cpu)
    echo "  traced, $mode: $porter train ${common[*]} ${extra[*]} --trace ... --report ..."
    measured "trace-$mode" "$porter" train "${common[@]}" "${extra[@]}" \
      --trace "$out/trace-$mode.json" --report "$out/trace-$mode.report.json" ||
      { tail -20 "$out/trace-$mode.log" >&2; exit 1; }
  done
  python3 - "$out" "$runs" "$warmup" "$link" <<'PY'
import json, statistics as st, sys
out, runs, warmup, link_gbps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
med = st.median
def spans(trace, name):
    ev = json.load(open(trace))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    return [e["dur"] / 1e6 for e in ev
            if e.get("name") == name and e.get("ph") == "X" and e["args"]["step"] >= warmup]
rows = {}
for mode in ("device", "offload"):
    per_run = []
    for r in range(1, runs + 1):
        rep = json.load(open(f"{out}/step-{mode}-{r}.json"))
        n = rep["steps"]
        o = rep["zero"]["offload_optimizer"] or {}
        copy_bytes = (o.get("d2h_bytes", 0) + o.get("h2d_bytes", 0)) / n
        per_run.append({
            "step": med(rep["step_times_s"][warmup:]),
            "update": o.get("cpu_update_s", 0.0) / n,
            "exposed": o.get("exposed_s", 0.0) / n,
            "copy_mib": copy_bytes / 2**20,
            "link": copy_bytes / (link_gbps * 1e9),
        })
    rows[mode] = {k: med(x[k] for x in per_run) for k in per_run[0]}
    trace = f"{out}/trace-{mode}.json"
    rows[mode]["phase"] = med(spans(trace, "optimizer adamw"))
    rows[mode]["traced_step"] = med(
        json.load(open(f"{out}/trace-{mode}.report.json"))["step_times_s"][warmup:])
    rows[mode]["host"] = med(spans(trace, "host adamw")) if mode == "offload" else 0.0
    rows[mode]["steps"] = [round(x["step"] * 1e3, 1) for x in per_run]
    rows[mode]["other"] = [open(f"{out}/step-{mode}-{r}.other").read().split()[0]
                           for r in range(1, runs + 1)]
ms = lambda s: f"{s * 1e3:.1f}"
print("\n| optimizer | step, median (runs) | optimizer phase | host AdamW (trace; report) "
      "| copies / step | copies at link rate | exposed / step | hidden | exposed / step time |")
print("|---|---|---|---|---|---|---|---|---|")
for mode, label in (("device", "on the device"), ("offload", "offloaded (cpu)")):
    x = rows[mode]
    runs_txt = ", ".join(str(s) for s in x["steps"])
    if mode == "device":
        print(f"| {label} | {ms(x['step'])} ms ({runs_txt}) | {ms(x['phase'])} ms | - | - | - | - | - | - |")
        continue
    busy = x["update"] + x["link"]
    hidden = max(0.0, 1.0 - x["exposed"] / busy) if busy > 0 else 0.0
    print(f"| {label} | {ms(x['step'])} ms ({runs_txt}) | {ms(x['phase'])} ms "
          f"| {ms(x['host'])} ms; {ms(x['update'])} ms | {x['copy_mib']:.2f} MiB "
          f"| {ms(x['link'])} ms | {ms(x['exposed'])} ms | {100 * hidden:.1f}% "
          f"| {100 * x['exposed'] / x['step']:.1f}% |")
d, o = rows["device"], rows["offload"]
print(f"\nother processes' CPU-s during each run: on the device {', '.join(d['other'])}; "
      f"offloaded {', '.join(o['other'])}")
print(f"the traced runs' median steps: on the device {ms(d['traced_step'])} "
      f"ms, offloaded {ms(o['traced_step'])} ms")
print(f"offloaded / on device: step {o['step'] / d['step']:.3f}x "
      f"({ms(o['step'] - d['step'])} ms), optimizer phase {o['phase'] / d['phase']:.2f}x")
print("step: median over steps >= warm-up of each run, then over runs. optimizer phase and the "
      "first host AdamW figure: medians over steps >= warm-up of the traced run's 'optimizer "
      "adamw' span (compute lane: global norm, clipping, update and, offloaded, the copies) and "
      "'host adamw' span. The report's host AdamW (cpu_update_s) and exposed (exposed_s) are "
      "means over all steps, warm-up included, median over runs. hidden = 1 - exposed / "
      "(host AdamW + copies at the link rate), at least 0")
PY
fi

if [[ $what != step ]]; then
  echo
  echo "== largest model: $big, $big_nproc ranks, $big_runs runs x $big_steps steps (first skipped)"
  "$porter" estimate --config "$big" --world-size 1 --set train_batch_size=1 > "$out/estimate-1.txt"
  "$porter" estimate --config "$big" > "$out/estimate-$big_nproc.txt"
  grep -E "Psi =|none +device|optimizer \+ params" "$out/estimate-1.txt" | sed 's/^/  ws 1: /'
  grep -E "none +device|optimizer \+ params" "$out/estimate-$big_nproc.txt" | sed "s/^/  ws $big_nproc: /"
  no_offload=(--set zero_optimization.offload_optimizer.device=none
    --set zero_optimization.offload_param.device=none)
  # Without offload the example's own device cannot hold it: expect every rank to exit with 3.
  wait_idle
  echo "  check: $porter train --nproc $big_nproc --config $big ${no_offload[*]} --steps 1"
  set +e
  "$porter" train --nproc "$big_nproc" --config "$big" "${no_offload[@]}" --steps 1 \
    > "$out/big-no-offload-small.log" 2>&1
  rc=$?
  set -e
  echo "    exit code $rc; $(grep -m1 -o 'launch: failed: rank 0 exit code [0-9]*' "$out/big-no-offload-small.log" || true)" \
    "(3: out of memory): $(grep -m1 -o 'tried to allocate [^)]*) for [a-z]*' "$out/big-no-offload-small.log" || true)"
  for ((r = 1; r <= big_runs; r++)); do
    modes=(offload roomy)
    ((r % 2 == 0)) && modes=(roomy offload)
    for mode in "${modes[@]}"; do
      extra=()
      [[ $mode == roomy ]] && extra=("${no_offload[@]}" --set porter.device.memory_limit="\"$big_roomy\"")
      echo "  run $r, $mode: $porter train --nproc $big_nproc --config $big ${extra[*]} --steps $big_steps --report ..."
      measured "big-$mode-$r" "$porter" train --nproc "$big_nproc" --config "$big" "${extra[@]}" \
        --steps "$big_steps" --report "$out/big-$mode-$r.json" ||
        { tail -30 "$out/big-$mode-$r.log" >&2; exit 1; }
    done
  done
  python3 - "$out" "$big_runs" "$big_nproc" <<'PY'
import json, re, statistics as st, sys
out, runs, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
med = st.median
MiB = 2**20
est = open(f"{out}/estimate-1.txt").read()
states = float(re.search(r"none +device +([0-9.]+) MiB", est).group(1))
psi = int(re.search(r"Psi = (\d+)", est).group(1))
rows = {}
for mode in ("offload", "roomy"):
    per_run = []
    for r in range(1, runs + 1):
        rep = json.load(open(f"{out}/big-{mode}-{r}.json"))
        z = rep["zero"]
        n = rep["steps"]
        o = z["offload_optimizer"] or {}
        per_run.append({
            "step": med(rep["step_times_s"][1:]),
            "cap": rep["ranks"][0]["memory"]["capacity_bytes"] / MiB,
            "peak": max(x["memory"]["peak_bytes"] for x in rep["ranks"]) / MiB,
            "host": (o.get("host_bytes", 0) + (z["offload_param"] or {}).get("host_bytes", 0)) / MiB,
            "update": o.get("cpu_update_s", 0.0) / n,
            "exposed": o.get("exposed_s", 0.0) / n,
            "gather_exposed": z["gather_exposed_s"] / n,
        })
    rows[mode] = {k: med(x[k] for x in per_run) for k in per_run[0]}
    rows[mode]["steps"] = [f"{x['step']:.2f}" for x in per_run]
    rows[mode]["other"] = [open(f"{out}/big-{mode}-{r}.other").read().split()[0]
                           for r in range(1, runs + 1)]
print(f"\nmodel: Psi = {psi / 1e6:.2f}M parameters; model states (porter estimate --world-size 1, "
      f"offload none) {states:.2f} MiB")
print("\n| run | device per rank | model states / device | peak per rank (max over ranks) "
      "| host per rank | step, median (runs) | host AdamW / step | optimizer offload exposed / step "
      "| gathers exposed / step |")
print("|---|---|---|---|---|---|---|---|---|")
for mode, label in (("offload", "stage 3, optimizer + params offloaded"),
                    ("roomy", "stage 3, no offload")):
    x = rows[mode]
    host = f"{x['host']:.2f} MiB" if x["host"] else "-"
    upd = f"{x['update'] * 1e3:.1f} ms" if x["host"] else "- (on the device)"
    exp = f"{x['exposed'] * 1e3:.1f} ms" if x["host"] else "-"
    print(f"| {label} | {x['cap']:.0f} MiB | {states / x['cap']:.2f}x | {x['peak']:.2f} MiB "
          f"| {host} | {x['step']:.2f} s ({', '.join(x['steps'])}) | {upd} | {exp} "
          f"| {x['gather_exposed'] * 1e3:.0f} ms |")
o, n = rows["offload"], rows["roomy"]
print(f"\nother processes' CPU-s during each run: offloaded {', '.join(o['other'])}; "
      f"not offloaded {', '.join(n['other'])}")
print(f"offloaded / not offloaded: step {o['step'] / n['step']:.2f}x; device peak "
      f"{o['peak'] / n['peak']:.2f}x; per-step figures from the report are means over all steps")
PY
fi
