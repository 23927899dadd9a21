#!/bin/bash
# KernelBench-scale sweep, part 1: level 1 (reproducing candidates) and the loss shortcuts, cold caches.
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
LEVELS=${LEVELS:-1}
NAME=${NAME:-s1}
mkdir -p $OUT/$NAME target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; free -g; df -h / /tmp; mount | grep -E " / | /tmp " ; } > $OUT/$NAME/machine.txt 2>&1
rm -rf /tmp/sweep; python3 bench/kernelbench/make_candidates.py --reproduce .kb/kernelbench /tmp/sweep $LEVELS
if [ "$SHORTCUTS" = 1 ]; then
  python3 bench/kernelbench/make_candidates.py --loss-shortcuts /tmp/ls
  cp /tmp/ls/*.py /tmp/sweep/
  python3 -c "import json;a=json.load(open('/tmp/ls/manifest.json'));b=json.load(open('/tmp/sweep/manifest.json'));json.dump(a+b,open('/tmp/sweep/manifest.json','w'))"
fi
( while true; do echo "$(( $(date +%s) - T0 )) $(df -BG --output=used,avail / /tmp | tail -2 | tr -s ' ' | tr '\n' ' ') $(free -g | awk '/Mem/{print $3, $6}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 10; done > $OUT/$NAME/usage.log 2>&1 ) &
timeout $(( ${BUDGET:-570} - ($(date +%s) - T0) )) target/release/evaluator-kernelbench --kernelbench .kb/kernelbench --candidates /tmp/sweep \
  --python $(which python3) --work ${WORK:-/tmp/kfs} --no-torch-compile --gpu-slots ${SLOTS:-4} --in-flight ${INFLIGHT:-4} \
  --out $OUT/$NAME/sweep.jsonl > $OUT/$NAME/sweep.log 2>&1
echo "rc=$? total $(( $(date +%s) - T0 )) s"
grep -c . $OUT/$NAME/sweep.jsonl
python3 bench/kernelbench/sweep_summary.py $OUT/$NAME/sweep.jsonl > $OUT/$NAME/summary.md
python3 -c "
import json,collections
r=[json.loads(l) for l in open('$OUT/$NAME/sweep.jsonl')]
print(collections.Counter((x.get('kind'),x.get('verdict',x.get('refused','')[:40])) for x in r))
w=sorted(x['wall_s'] for x in r if 'wall_s' in x); n=len(w)
print('n',n,'p50',w[n//2] if n else None,'p95',w[int(n*0.95)] if n else None,'max',w[-1] if n else None)
"
