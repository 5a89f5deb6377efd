#!/usr/bin/env bash
# Runs one porter binary over a corpus of configs (the examples, the published DeepSpeed
# configs beside a model, and variants of policy, architecture, tensor parallelism and budget)
# and writes every `plan --json` and `estimate --json` answer into one folder. Two folders
# made by two builds compare with scripts/plan_corpus_compare.py, which sets aside the times a
# profiled plan measured: a change that must not move a plan shows no other difference. (A
# plan that chooses by measured times can differ between two runs of one binary; running the
# corpus twice with the old build shows which.)
#   scripts/plan_corpus.sh PORTER OUTDIR
set -euo pipefail
porter=${1:?usage: plan_corpus.sh PORTER OUTDIR}
out=${2:?usage: plan_corpus.sh PORTER OUTDIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"

configs=()
for f in "$root"/examples/*.json "$root"/examples/configs/*.json; do configs+=("$f"); done
published=("$root"/../shared/realworld-configs/*.json)

variants=(
  ""
  "--set porter.checkpointing.policy=uniform"
  "--set porter.checkpointing.policy=selective"
  "--set porter.checkpointing.policy=sqrt"
  "--set porter.model.arch=llama"
  "--set porter.model.arch=llama --set porter.model.kv_heads=2 --set porter.checkpointing.policy=block"
  "--budget 0.5"
)

run() {  # name, then porter's arguments
  local name=$1; shift
  "$porter" plan --json "$@" > "$out/$name.plan.json" 2>/dev/null || echo "exit $?" >> "$out/$name.plan.json"
  "$porter" estimate --json "$@" > "$out/$name.estimate.json" 2>/dev/null || echo "exit $?" >> "$out/$name.estimate.json"
}

for c in "${configs[@]}"; do
  base=$(basename "$c" .json)
  i=0
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    run "$base.v$i" --config "$c" $v
    i=$((i + 1))
  done
done
for c in "${published[@]}"; do
  [[ -f $c ]] || continue
  base=$(basename "$c" .json)
  run "$base" --config "$c" --config "$root/examples/model-for-published-config.json"
done
echo "$(ls "$out" | wc -l) answers in $out"
