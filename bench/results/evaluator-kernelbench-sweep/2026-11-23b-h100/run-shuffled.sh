#!/bin/bash
# KernelBench sweep for LEVELS, resumable across commands on one warm machine: the reproducing candidates cold
# (8 in flight, 6 slots), skipping tasks already done in earlier commands (/tmp/res); once all are done, every third
# task again warm (reference and baselines cached; the evaluator's default 4 slots, 4 in flight).
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
D=$OUT/${NAME:?}; R=/tmp/res; mkdir -p $D $R target/release && cp .kb/bin/* target/release/
[ -f $R/machine.txt ] || { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; free -g; df -h / /tmp; } > $R/machine.txt 2>&1
trap 'kill $LOGGER 2>/dev/null; cp $R/*.jsonl $R/machine.txt $D/ 2>/dev/null; tar czf $D/logs.tgz -C $R . 2>/dev/null' EXIT
if [ ! -d /tmp/cand ]; then
  python3 bench/kernelbench/make_candidates.py --reproduce .kb/kernelbench /tmp/cand $LEVELS > /dev/null
  python3 bench/kernelbench/make_candidates.py --loss-shortcuts /tmp/ls > /dev/null; cp /tmp/ls/*.py /tmp/cand/
  python3 -c "import json;a=json.load(open('/tmp/ls/manifest.json'));b=json.load(open('/tmp/cand/manifest.json'));json.dump(b if '$SKIP_SHORTCUTS' else a+b,open('/tmp/cand/all.json','w'))"
fi
rm -rf /tmp/todo && mkdir -p /tmp/todo && cp -r /tmp/cand/. /tmp/todo/
LEFT=$(python3 -c "
import json,glob
done={(json.loads(l)['task'],json.loads(l).get('kind')) for f in glob.glob('$R/cold-*.jsonl') for l in open(f) if l.strip()}
import random
m=[e for e in json.load(open('/tmp/cand/all.json')) if (e['task'],e.get('kind')) not in done]
random.Random(0).shuffle(m)  # large level-1 tasks (written alone) beside small ones of every level
json.dump(m,open('/tmp/todo/manifest.json','w')); print(len(m))")
echo "cold: $LEFT left"
( while true; do echo "$(( $(date +%s) - T0 )) $(df -BG --output=used,avail / | tail -1 | tr -s ' ') $(free -g | awk '/Mem/{print $3}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 10; done >> $R/usage-$T0.log 2>&1 ) > /dev/null 2>&1 &
LOGGER=$!
RUN="target/release/evaluator-kernelbench --kernelbench .kb/kernelbench --python $(which python3) --work /tmp/kfs --no-torch-compile"
if [ "$LEFT" != 0 ]; then
  timeout $(( ${BUDGET:-560} - ($(date +%s) - T0) )) $RUN --candidates /tmp/todo --gpu-slots 6 --in-flight 8 --out $R/cold-$T0.jsonl > $R/cold-$T0.log 2>&1
  echo "cold rc=$? $(( $(date +%s) - T0 )) s, $(grep -c . $R/cold-$T0.jsonl) results"
fi
LEFT=$(python3 -c "
import json,glob
done={(json.loads(l)['task'],json.loads(l).get('kind')) for f in glob.glob('$R/cold-*.jsonl') for l in open(f) if l.strip()}
print(len([e for e in json.load(open('/tmp/cand/all.json')) if (e['task'],e.get('kind')) not in done]))")
if [ "$LEFT" = 0 ] && [ ! -s $R/warm.jsonl ] && [ $(( ${BUDGET:-560} - ($(date +%s) - T0) )) -gt 200 ]; then
  rm -rf /tmp/warm && mkdir -p /tmp/warm && cp -r /tmp/cand/. /tmp/warm/
  python3 -c "
import json; m=[e for e in json.load(open('/tmp/cand/all.json')) if e.get('kind')=='reproduce']
json.dump(m[::3], open('/tmp/warm/manifest.json','w')); print('warm sample', len(m[::3]))"
  timeout $(( ${BUDGET:-560} - ($(date +%s) - T0) )) $RUN --candidates /tmp/warm --gpu-slots 4 --in-flight 4 --out $R/warm.jsonl > $R/warm.log 2>&1
  echo "warm rc=$? $(( $(date +%s) - T0 )) s, $(grep -c . $R/warm.jsonl) results"
fi
python3 - <<PY
import json,glob,collections
for name in ('cold','warm'):
    r=[json.loads(l) for f in sorted(glob.glob('$R/%s*.jsonl' % name)) for l in open(f) if l.strip()]
    if not r: continue
    print(name, collections.Counter((x.get('kind'),x.get('verdict')) for x in r))
    w=sorted(x['wall_s'] for x in r if x.get('verdict')=='VERDICT_CORRECT'); n=len(w)
    if n: print('  correct n',n,'p50',round(w[n//2],1),'p95',round(w[min(n-1,int(n*0.95))],1),'max',round(w[-1],1))
    for x in r:
        if x.get('verdict')!='VERDICT_CORRECT' and x.get('kind')=='reproduce': print('  ',x['task'],x.get('verdict'),(x.get('error') or '')[-160:].replace(chr(10),' '))
PY
echo "total $(( $(date +%s) - T0 )) s"; df -h / | tail -1
