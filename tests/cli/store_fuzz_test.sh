#!/usr/bin/env bash
# A fuzzer sends random frames to rank 0's store port while a 2-rank run trains: the run's
# losses equal those of a run left alone, bit for bit, and every stranger is refused.
# Usage: store_fuzz_test.sh PORTER WORKDIR
set -euo pipefail
porter=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }

config="$(dirname "$0")/small_zero2.json"
steps=(--steps 6)

# The report's "losses" array, whitespace removed.
losses() {
  tr -d ' \n' < "$1" | grep -o '"losses":\[[^]]*\]' || true
}

"$porter" train --config "$config" "${steps[@]}" --nproc 2 --report "$work/alone.json" > "$work/alone.log" 2>&1 ||
  { cat "$work/alone.log"; fail "the run left alone failed"; }

port=$(( 20000 + $$ % 20000 ))
"$porter" launch -n 2 --master-port "$port" -- \
  "$porter" train --config "$config" "${steps[@]}" --report "$work/fuzzed.json" > "$work/fuzzed.log" 2>&1 &
launcher=$!
sent=0
while kill -0 "$launcher" 2> /dev/null; do
  # A random frame: a random 4-byte length and up to 256 random bytes, on a fresh connection.
  n=$(( RANDOM % 257 ))
  if { head -c $(( 4 + n )) /dev/urandom > "/dev/tcp/127.0.0.1/$port"; } 2> /dev/null; then
    sent=$((sent + 1))
  fi
done
rc=0
wait "$launcher" || rc=$?
[ "$rc" = 0 ] || { cat "$work/fuzzed.log"; fail "the fuzzed run exited $rc"; }
[ "$sent" -gt 0 ] || fail "the fuzzer never reached the store"
alone=$(losses "$work/alone.json")
fuzzed=$(losses "$work/fuzzed.json")
[ -n "$alone" ] || fail "no losses in the report"
[ "$alone" = "$fuzzed" ] || fail "losses differ: alone $alone, fuzzed $fuzzed"
echo "$sent random frames sent to the store during the run; losses unchanged: $fuzzed"
