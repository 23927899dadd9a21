#!/bin/bash
# GPU run B: timing fidelity: do_bench in clean processes, then kforge warm and idle (two repeats).
cd "$(dirname "$0")/../../../.."
mkdir -p target/release && cp .kb/bin/* target/release/
export PATH=$PWD/target/release:$PATH
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbc --tasks-dir $PWD/.kb/kernelbench --corpus --limit ${LIMIT:-10}"
trap 'mkdir -p $OUT/fid; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt /tmp/fid/logs $OUT/fid/ 2>/dev/null' EXIT
for phases in $PHASES; do
  echo "== $phases"; $F --phases $phases --deadline-s ${DEADLINE:-500} 2>&1 | tail -15
done
$F --summary-only > /dev/null 2>&1; cat /tmp/fid/summary.md | head -80
