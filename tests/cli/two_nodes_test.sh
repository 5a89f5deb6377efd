#!/usr/bin/env bash
# Two nodes on one machine: two network namespaces joined by a veth pair, each with its own
# address, each running `porter launch --nnodes 2 --node-rank R -n 1`. They train ZeRO-2 to the
# losses of one node with the same world size (porter train --nproc 2), bit for bit, and a
# stranger without the store token is refused while they do.
# Exits 77 (ctest's skip) where network namespaces cannot be made (not root, no ip(8)).
# Usage: two_nodes_test.sh PORTER WORKDIR
set -euo pipefail
porter=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
ns_a=porter-node0-$$
ns_b=porter-node1-$$

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || skip "network namespaces need root"
command -v ip > /dev/null || skip "no ip(8)"
cleanup() {
  ip netns del "$ns_a" 2> /dev/null || true
  ip netns del "$ns_b" 2> /dev/null || true
}
trap cleanup EXIT
ip netns add "$ns_a" 2> /dev/null || skip "cannot create a network namespace"
ip netns add "$ns_b" || skip "cannot create a second network namespace"
ip link add "va$$" netns "$ns_a" type veth peer name "vb$$" netns "$ns_b" ||
  skip "cannot create a veth pair"
ip -n "$ns_a" addr add 10.213.0.1/24 dev "va$$"
ip -n "$ns_b" addr add 10.213.0.2/24 dev "vb$$"
for ns in "$ns_a" "$ns_b"; do
  ip -n "$ns" link set lo up
done
ip -n "$ns_a" link set "va$$" up
ip -n "$ns_b" link set "vb$$" up

config="$(dirname "$0")/small_zero2.json"
steps=(--steps 4)

"$porter" train --config "$config" "${steps[@]}" --nproc 2 --report "$work/one-node.json" > "$work/one-node.log" 2>&1 ||
  { cat "$work/one-node.log"; fail "the one-node run failed"; }

export PORTER_STORE_TOKEN=two-node-test-token-$$
port=29611
for r in 0 1; do
  ns=$([ "$r" = 0 ] && echo "$ns_a" || echo "$ns_b")
  report=()
  [ "$r" = 0 ] && report=(--report "$work/two-nodes.json")
  ip netns exec "$ns" "$porter" launch --nnodes 2 --node-rank "$r" -n 1 \
    --master-addr 10.213.0.1 --master-port "$port" -- \
    "$porter" train --config "$config" "${steps[@]}" "${report[@]}" > "$work/node$r.log" 2>&1 &
  eval "pid$r=$!"
done
# A stranger on node 1's side knocks on rank 0's store without the token while they train.
stranger=0
for i in $(seq 1 50); do
  if ip netns exec "$ns_b" bash -c "exec 3<>/dev/tcp/10.213.0.1/$port && printf 'GET' >&3" 2> /dev/null; then
    stranger=1
    break
  fi
  sleep 0.1
done
rc0=0
rc1=0
wait "$pid0" || rc0=$?
wait "$pid1" || rc1=$?
[ "$rc0" = 0 ] || { cat "$work/node0.log"; fail "node 0 exited $rc0"; }
[ "$rc1" = 0 ] || { cat "$work/node1.log"; fail "node 1 exited $rc1"; }
grep -q "(0..0 of 2, node 0 of 2)" "$work/node0.log" || fail "node 0 did not start rank 0 of 2"
grep -q "(1..1 of 2, node 1 of 2)" "$work/node1.log" || fail "node 1 did not start rank 1 of 2"
if [ "$stranger" = 1 ]; then
  grep -Eq "refused|without the token|closed" "$work/node0.log" ||
    { cat "$work/node0.log"; fail "the stranger's connection was not logged as refused"; }
fi

# The report's "losses" array, whitespace removed.
losses() {
  tr -d ' \n' < "$1" | grep -o '"losses":\[[^]]*\]' || true
}
one=$(losses "$work/one-node.json")
two=$(losses "$work/two-nodes.json")
[ -n "$one" ] || fail "no losses in the one-node report"
[ "$one" = "$two" ] || fail "losses differ: one node $one, two nodes $two"
echo "two nodes (10.213.0.1, 10.213.0.2) train to the one-node losses: $two"
