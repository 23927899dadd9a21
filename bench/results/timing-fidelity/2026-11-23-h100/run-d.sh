#!/bin/bash
# GPU run D: timed loops wait spinning (cuCtxSetFlags); a subset with the candidate that syncs in forward.
cd "$(dirname "$0")/../../../.."
mkdir -p target/release && cp .kb/bin/* target/release/
export PATH=$PWD/target/release:$PATH
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
mkdir -p /tmp/kbd && cp /tmp/kbc/*.py /tmp/kbd/
python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '88_MinGPT', '12_Matmul_with_diag', '76_Gemm_Add'))]
json.dump(keep, open('/tmp/kbd/manifest.json', 'w'))
PY
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbd --tasks-dir $PWD/.kb/kernelbench"
trap 'mkdir -p $OUT/fid; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null' EXIT
echo "== dobench"; $F --phases dobench --deadline-s 140 2>&1 | grep -v "^\s*$" | tail -6
echo "== warm"; $F --phases warm --deadline-s 150 2>&1 | tail -3
echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s 90 2>&1 | tail -6
echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s 80 2>&1 | tail -6
$F --summary-only > /dev/null 2>&1
