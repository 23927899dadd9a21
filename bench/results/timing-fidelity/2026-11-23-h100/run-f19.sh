#!/bin/bash
# Issue 19's open point: level2/68 (float() sync inside forward) with do_bench waiting blocked (default) and
# spinning, 3 fresh processes each, beside kforge idle (2 repeats), on one VM; level2/9 as the control.
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
mkdir -p $OUT/f19 target/release && cp .kb/bin/* target/release/
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
mkdir -p /tmp/kb68 && cp /tmp/kbc/*.py /tmp/kb68/
python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
json.dump([e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '9_Matmul_Subtract'))], open('/tmp/kb68/manifest.json', 'w'))
PY
F="python3 bench/timing/fidelity.py --out /tmp/f19 --candidates /tmp/kb68 --tasks-dir $PWD/.kb/kernelbench --dobench-repeats 3"
trap 'cp -r /tmp/f19/*.md /tmp/f19/*.jsonl /tmp/f19/*.txt $OUT/f19/ 2>/dev/null' EXIT
timeout $(( ${BUDGET:-300} - ($(date +%s) - T0) )) $F --phases dobench,dobench-spin,warm,idle --deadline-s $(( ${BUDGET:-300} - 40 - ($(date +%s) - T0) )) 2>&1 | tail -30
$F --summary-only > /dev/null 2>&1
echo "total $(( $(date +%s) - T0 )) s"
