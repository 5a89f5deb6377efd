#!/usr/bin/env bash
# Long sequences on a simulated cpu device, from porter estimate (whose bytes equal what the
# cpu device measures: tests/engine/engine_flash_test.cc, tests/cli/long_context_test.sh):
#   1. one block's saved bytes and the smallest total peak over the policies, materialised and
#      flash attention, against the sequence length, and which one `auto` takes;
#   2. the longest sequence (a multiple of 256) that fits the device under some policy, with
#      each attention.
# The model is examples/configs/llama-long-context-cpu.json's (a 2-layer Llama, hidden 256,
# 4 heads, 2 key/value heads, bf16). Needs python3 for the JSON.
# Usage: bench/long_context.sh [PORTER] [DEVICE_MEMORY]   (defaults: build/release/cli/porter 4GiB)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
porter=${1:-$root/build/release/cli/porter}
memory=${2:-4GiB}
example=$root/examples/configs/llama-long-context-cpu.json

# estimate T ATTENTION: "<layer bytes> <smallest total peak> <fits> <auto's choice>"
estimate() {
  "$porter" estimate --config "$example" --json --set porter.model.seq_len="$1" \
    --set porter.model.attention="$2" --set porter.device.memory_limit="\"$memory\"" |
    python3 -c '
import json, sys
j = json.load(sys.stdin)
row = next(r for r in j["attention"]["table"] if r["attention"] == j["attention"]["chosen"])
ok = [p for p in j["policies"] if "total_peak_bytes" in p]
best = min(ok, key=lambda p: p["total_peak_bytes"])
print(row["layer_bytes"], best["total_peak_bytes"], best["fits"], best["policy"])'
}
auto_choice() {
  "$porter" estimate --config "$example" --json --set porter.model.seq_len="$1" \
    --set porter.device.memory_limit="\"$memory\"" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["attention"]["chosen"])'
}
gib() { python3 -c "print(f'{$1 / 2**30:.2f}')"; }

echo "device memory $memory; $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo
echo "| T | block, materialized (GiB) | block, flash (GiB) | smallest total, materialized (GiB) | smallest total, flash (GiB) | auto (policy none) |"
echo "|---|---|---|---|---|---|"
for t in 1024 2048 4096 8192 12288 16384 32768 65536; do
  read -r ml mt _ _ <<< "$(estimate "$t" materialized)"
  read -r fl ft _ _ <<< "$(estimate "$t" flash)"
  echo "| $t | $(gib "$ml") | $(gib "$fl") | $(gib "$mt") | $(gib "$ft") | $(auto_choice "$t") |"
done
echo
longest() {  # the largest multiple of 256 that fits with attention $1
  local lo=256 hi=$((1 << 22))
  while (( hi - lo > 256 )); do
    local mid=$(( (lo + hi) / 2 / 256 * 256 ))
    read -r _ _ fits _ <<< "$(estimate "$mid" "$1")"
    if [[ "$fits" == "True" ]]; then lo=$mid; else hi=$mid; fi
  done
  echo "$lo"
}
echo "longest sequence on $memory: materialized $(longest materialized), flash $(longest flash)"
