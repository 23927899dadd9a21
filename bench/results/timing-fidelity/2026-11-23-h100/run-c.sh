#!/bin/bash
# GPU run C: the pipeline full, then liveness beside a hang, then the rest of idle repeat 0.
cd "$(dirname "$0")/../../../.."
export PATH=$PWD/target/release:$PATH
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbc --tasks-dir $PWD/.kb/kernelbench --corpus --limit 10"
trap 'mkdir -p $OUT/fid $OUT/hang; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null; cp -r /tmp/hang/*.md /tmp/hang/*.jsonl /tmp/hang/*.txt $OUT/hang/ 2>/dev/null' EXIT
echo "== full"; $F --phases full --deadline-s 200 2>&1 | tail -4
echo "== hang"; timeout 250 python3 bench/timing/hang.py --out /tmp/hang --n 4 --repeats 1 --run-timeout 0 --deadline-s 230 2>&1 | tail -12
echo "== idle"; $F --phases idle --only-repeat 0 --deadline-s 100 2>&1 | tail -4
$F --summary-only > /dev/null 2>&1
