#!/usr/bin/env bash
# Legitimate CPU evaluations beside the corpus's native fork bomb, on this (CPU) machine: does any end as a hang?
# And how long is a bystander kept off a CPU while the bomb's processes exit?
#
#   bench/timing/beside_fork_bomb.sh CORPUS_BINARY OUT [BOMBS] [EVALUATIONS]
#
# CORPUS_BINARY: the corpus test binary (cargo nextest run -p kforge-evaluator --test corpus --no-run; then
# target/debug/deps/corpus-*), copied aside so a rebuild does not change it mid-run. As root, with .venv set up.
# Runs BOMBS (7) fork bomb evaluations one after another, and beside them two loops of EVALUATIONS (22) each:
# lazy_extension_never_called.py and lazy_softmax_in_forward.py under the permissive policy (expected HACK and
# CORRECT). Then three fork bombs alone, each beside host_stall.py for 50 s. Writes OUT/summary.txt (each run's
# end, FAIL lines), OUT/<loop>-<i>.log, OUT/stall.txt.
set -uo pipefail
binary=$(realpath "$1"); out=$(realpath -m "$2"); bombs=${3:-7}; evaluations=${4:-22}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root/services/evaluator"
export KFORGE_CI=1
loop() {
  local name=$1 entry=$2 count=$3
  for i in $(seq 1 "$count"); do
    "$binary" --exact "$entry" > "$out/$name-$i.log" 2>&1 || echo "FAIL $name $i" >> "$out/summary.txt"
    echo "done $name $i $(date +%T)" >> "$out/summary.txt"
  done
}
loop bomb 'exploits/fork_bomb_native.py' "$bombs" &
loop extension 'exploits/lazy_extension_never_called.py[permissive]' "$evaluations" &
loop softmax 'exploits/lazy_softmax_in_forward.py[permissive]' "$evaluations" &
wait
grep -h "error the candidate" "$out"/*.log >> "$out/summary.txt"
echo "failed: $(grep -c '^FAIL' "$out/summary.txt") of $(grep -c '^done' "$out/summary.txt") runs" >> "$out/summary.txt"
for i in 1 2 3; do
  python3 "$root/bench/timing/host_stall.py" 50 > "$out/stall-$i.txt" &
  "$binary" --exact exploits/fork_bomb_native.py > "$out/stall-bomb-$i.log" 2>&1
  wait
  echo "bomb $i: $(cat "$out/stall-$i.txt")" >> "$out/stall.txt"
done
cat "$out/summary.txt" | tail -3; cat "$out/stall.txt"
