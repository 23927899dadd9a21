#!/bin/bash
# KernelBench sweep, one level: the reproducing candidates cold (caches empty; 8 in flight, 6 slots, to finish),
# then every third task again warm (reference and baselines cached; the evaluator's default 4 slots, 4 in flight).
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
L=${LEVEL:?}
D=$OUT/l$L
mkdir -p $D target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; free -g; df -h / /tmp; } > $D/machine.txt 2>&1
rm -rf /tmp/cand$L /tmp/warm$L /tmp/kfs$L; python3 bench/kernelbench/make_candidates.py --reproduce .kb/kernelbench /tmp/cand$L $L > /dev/null
if [ "$SHORTCUTS" = 1 ]; then
  python3 bench/kernelbench/make_candidates.py --loss-shortcuts /tmp/ls > /dev/null; cp /tmp/ls/*.py /tmp/cand$L/
  python3 -c "import json;a=json.load(open('/tmp/ls/manifest.json'));b=json.load(open('/tmp/cand$L/manifest.json'));json.dump(a+b,open('/tmp/cand$L/manifest.json','w'))"
fi
mkdir -p /tmp/warm$L && cp /tmp/cand$L/*.py /tmp/warm$L/
python3 -c "
import json; m=json.load(open('/tmp/cand$L/manifest.json')); r=[e for e in m if e.get('kind')=='reproduce']
json.dump(r[::3], open('/tmp/warm$L/manifest.json','w')); print('warm sample', len(r[::3]), 'of', len(m))"
( while true; do echo "$(( $(date +%s) - T0 )) $(df -BG --output=used,avail / | tail -1 | tr -s ' ') $(free -g | awk '/Mem/{print $3}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 10; done > $D/usage.log 2>&1 ) &
RUN="target/release/evaluator-kernelbench --kernelbench .kb/kernelbench --python $(which python3) --work /tmp/kfs$L --no-torch-compile"
timeout $(( ${COLD_BUDGET:-420} - ($(date +%s) - T0) )) $RUN --candidates /tmp/cand$L --gpu-slots 6 --in-flight 8 --out $D/cold.jsonl > $D/cold.log 2>&1
echo "cold rc=$? $(( $(date +%s) - T0 )) s, $(grep -c . $D/cold.jsonl) results"
T1=$(date +%s)
timeout $(( ${BUDGET:-575} - ($(date +%s) - T0) )) $RUN --candidates /tmp/warm$L --gpu-slots 4 --in-flight 4 --out $D/warm.jsonl > $D/warm.log 2>&1
echo "warm rc=$? $(( $(date +%s) - T1 )) s, $(grep -c . $D/warm.jsonl) results"
for p in cold warm; do python3 bench/kernelbench/sweep_summary.py $D/$p.jsonl > $D/$p-summary.md 2>&1; python3 -c "
import json,collections
r=[json.loads(l) for l in open('$D/$p.jsonl')]
print('$p', collections.Counter((x.get('kind'),x.get('verdict',x.get('refused','')[:40])) for x in r))
w=sorted(x['wall_s'] for x in r if 'wall_s' in x and x.get('verdict')=='VERDICT_CORRECT'); n=len(w)
print('  correct n',n,'p50',w[n//2] if n else None,'p95',w[min(n-1,int(n*0.95))] if n else None,'max',w[-1] if n else None)
for x in r:
  if x.get('verdict') not in ('VERDICT_CORRECT',) and x.get('kind')=='reproduce': print('  ', x.get('task'), x.get('verdict'), (x.get('error') or '')[-200:].replace(chr(10),' '))
"; done
tail -3 $D/usage.log
