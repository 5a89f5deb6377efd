#!/usr/bin/env bash
# The long-context example as a user runs it (examples/configs/llama-long-context-cpu.json):
# a Llama at 16384 tokens on a 3 GiB simulated cpu device, where one block's materialised
# probabilities alone would be 4 GiB. porter estimate must choose flash attention and find
# that the materialised attention fits under no policy; porter train must run with flash
# attention, and its measured activation and total peaks must equal the predicted ones to the
# byte. About half a minute on a 2-core machine.
# Usage: long_context_test.sh PORTER EXAMPLE WORKDIR
set -euo pipefail
porter=$1
example=$2
work=$3
rm -rf "$work"
mkdir -p "$work"

"$porter" estimate --config "$example" > "$work/estimate.txt"
grep -q "attention: flash (porter.model.attention auto" "$work/estimate.txt" || {
  echo "porter estimate did not choose flash attention:"; cat "$work/estimate.txt"; exit 1; }
# The materialised row's full peak (the smallest of its policies) is above the 3 GiB device.
mat_full=$(awk '$1 == "materialized" && NF == 9 {print $(NF-1), $NF}' "$work/estimate.txt")
case "$mat_full" in
  *GiB|*TiB) ;;
  *) echo "materialised full peak unexpectedly small: $mat_full"; cat "$work/estimate.txt"; exit 1 ;;
esac
if [[ "$mat_full" == *GiB ]] && awk -v v="${mat_full% GiB}" 'BEGIN { exit !(v + 0 <= 3.0) }'; then
  echo "the materialised attention fits the 3 GiB device under full: $mat_full"; exit 1
fi

"$porter" train --config "$example" --steps 2 --report "$work/report.json" > "$work/train.txt" 2>&1 || {
  echo "porter train failed:"; cat "$work/train.txt"; exit 1; }
grep -q "seq 16384, vocab 512, flash attention" "$work/train.txt" || {
  echo "porter train did not run flash attention:"; cat "$work/train.txt"; exit 1; }
# The report's bytes (the first memory object is the run's): predicted = measured, exactly.
value() { grep -m1 "\"$1\":" "$work/report.json" | tr -dc '0-9'; }
for key in peak_bytes activation_peak_bytes; do
  measured=$(value "$key")
  predicted=$(value "predicted_$key")
  if [[ -z "$measured" || "$measured" != "$predicted" ]]; then
    echo "$key: predicted '$predicted' against measured '$measured'"; cat "$work/train.txt"; exit 1
  fi
  echo "$key: predicted $predicted = measured $measured"
done
