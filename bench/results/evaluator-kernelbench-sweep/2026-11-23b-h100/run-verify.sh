#!/bin/bash
# Verification on the H100 of the fixes after sweep s3b: the tasks that failed there or need the disk budget,
# cold (8 in flight, 6 slots) then warm (default 4 slots, 4 in flight).
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
D=$OUT/s4; mkdir -p $D target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; free -g; df -h /; } > $D/machine.txt 2>&1
python3 bench/kernelbench/make_candidates.py --reproduce .kb/kernelbench /tmp/cand 1 2 3 > /dev/null
python3 - <<'PY'
import json
pick = ["level1/67_", "level1/97_", "level2/19_", "level1/63_", "level1/87_", "level1/21_", "level1/33_", "level1/11_",
        "level1/45_", "level1/4_", "level3/29_", "level2/66_"]
m = [e for e in json.load(open('/tmp/cand/manifest.json')) if any(e['task'].startswith(p) for p in pick)]
json.dump(m, open('/tmp/cand/manifest.json', 'w')); print(len(m), 'tasks')
PY
( while true; do echo "$(( $(date +%s) - T0 )) $(df -BG --output=used,avail / | tail -1 | tr -s ' ') $(free -g | awk '/Mem/{print $3}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 5; done > $D/usage.log 2>&1 ) > /dev/null 2>&1 &
LOGGER=$!; trap 'kill $LOGGER 2>/dev/null' EXIT
RUN="target/release/evaluator-kernelbench --kernelbench .kb/kernelbench --python $(which python3) --work /tmp/kfs --no-torch-compile --candidates /tmp/cand"
timeout $(( 300 - ($(date +%s) - T0) )) $RUN --gpu-slots 6 --in-flight 8 --out $D/cold.jsonl > $D/cold.log 2>&1; echo "cold rc=$? $(( $(date +%s) - T0 )) s"
T1=$(date +%s)
timeout $(( ${BUDGET:-440} - ($(date +%s) - T0) )) $RUN --gpu-slots 4 --in-flight 4 --out $D/warm.jsonl > $D/warm.log 2>&1; echo "warm rc=$? $(( $(date +%s) - T1 )) s"
python3 - <<PY
import json
for name in ('cold', 'warm'):
    try: r = [json.loads(l) for l in open('$D/%s.jsonl' % name) if l.strip()]
    except FileNotFoundError: continue
    for x in r:
        st = x.get('stage_ms') or {}
        print(name, x['task'][:34].ljust(34), x.get('verdict', '')[8:], round(x.get('wall_s', 0), 1),
              {k: round(st[k] / 1000, 1) for k in ('queue_disk', 'queue_device', 'run', 'check', 'device') if k in st},
              (x.get('error') or '')[-120:].replace('\n', ' '), json.dumps(x.get('mismatch'))[:120] if x.get('mismatch') else '')
PY
sort -k2 -n $D/usage.log | awk '{print $3}' | sort -n | head -1 | xargs echo "min free:"
