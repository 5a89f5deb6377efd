#!/usr/bin/env bash
# Fuzzes the config parser with libFuzzer (+ ASan/UBSan) for SECONDS seconds.
#
#   scripts/fuzz-config.sh SECONDS [JOBS]
#
# Builds build/fuzz with clang and -DPORTER_FUZZ=ON (install clang first: apt-get install
# clang), then runs tests/fuzz's config_fuzz on a scratch copy of the committed corpus
# (build/fuzz/corpus), so the run never rewrites tests/fuzz/corpus. A crash leaves
# crash-*/leak-*/timeout-* files in build/fuzz/artifacts and exits non-zero. To keep new
# interesting inputs, minimise them into the committed corpus:
#   build/fuzz/tests/fuzz/config_fuzz -merge=1 tests/fuzz/corpus build/fuzz/corpus
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:?usage: scripts/fuzz-config.sh SECONDS [JOBS]}"
jobs="${2:-1}"
if ! command -v clang++ >/dev/null; then
  echo "fuzz-config: clang++ not found; install it (apt-get install clang)" >&2
  exit 1
fi

cmake -S . -B build/fuzz -G Ninja \
  -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link" \
  -DPORTER_SANITIZE="address;undefined" \
  -DPORTER_FUZZ=ON -DPORTER_CUDA=OFF -DPORTER_BUILD_BENCH=OFF >/dev/null
cmake --build build/fuzz --target config_fuzz

mkdir -p build/fuzz/corpus build/fuzz/artifacts
cp -n tests/fuzz/corpus/* build/fuzz/corpus/ 2>/dev/null || true

echo "fuzz-config: fuzzing for ${seconds}s with ${jobs} job(s)"
start=$(date +%s)
status=0
if [ "$jobs" -gt 1 ]; then
  build/fuzz/tests/fuzz/config_fuzz build/fuzz/corpus -dict=tests/fuzz/config.dict \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -artifact_prefix=build/fuzz/artifacts/ -print_final_stats=1 \
    -jobs="$jobs" -workers="$jobs" || status=$?
else
  build/fuzz/tests/fuzz/config_fuzz build/fuzz/corpus -dict=tests/fuzz/config.dict \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -artifact_prefix=build/fuzz/artifacts/ -print_final_stats=1 || status=$?
fi
elapsed=$(( $(date +%s) - start ))
echo "fuzz-config: ran ${elapsed}s, exit status ${status}"
exit "$status"
