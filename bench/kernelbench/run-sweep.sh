#!/bin/bash
# KernelBench sweep over all tasks of levels 1-3 (plus the six loss shortcuts), resumable across commands and
# machines: each candidate is evaluated cold and then at once again warm (`--again`: compile, reference outputs and
# baselines cached), SLOTS evaluations in flight per GPU on as many GPU slots (default 4, the evaluator's
# `gpu_slots`; the sweeps up to 2026-11-27 ran 6), every GPU of the machine
# in one evaluator, tasks in a seeded random order. A task counts as done
# once its warm line exists, in this machine's /tmp/res-NAME or in results carried from earlier machines (.kb/done/).
# BINARY (under .kb/bin) picks the evaluator; each NAME has its own work directory (another's is removed first).
# ONLY (a regular expression on the task's path) restricts it to some tasks; DONE (default .kb/done) is where earlier
# machines' results are read from (a folder with none: a fresh sweep).
cd "$(dirname "$0")/../.."
T0=$(date +%s)
D=$OUT/${NAME:?}; R=/tmp/res-$NAME; W=/tmp/kfs-$NAME; mkdir -p $D $R target/release && cp .kb/bin/* target/release/
for w in /tmp/kfs-*; do [ "$w" = $W ] || rm -rf "$w"; done  # another run's caches would make this one's cold warm
[ -f $R/machine.txt ] || { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; free -g; df -h / /tmp /dev/shm; echo "${BINARY:-evaluator-kernelbench} (.kb/bin/COMMIT: $(cat .kb/bin/COMMIT))"; } > $R/machine.txt 2>&1
trap 'kill $LOGGER 2>/dev/null; cp $R/*.jsonl $R/machine.txt $D/ 2>/dev/null; tar czf $D/logs.tgz -C $R . 2>/dev/null' EXIT
if [ ! -d /tmp/cand ]; then
  python3 bench/kernelbench/make_candidates.py --reproduce .kb/kernelbench /tmp/cand 1 2 3 > /dev/null
  python3 bench/kernelbench/make_candidates.py --loss-shortcuts /tmp/ls > /dev/null; cp /tmp/ls/*.py /tmp/cand/
  python3 -c "import json;a=json.load(open('/tmp/ls/manifest.json'));b=json.load(open('/tmp/cand/manifest.json'));json.dump(a+b,open('/tmp/cand/all.json','w'))"
fi
rm -rf /tmp/todo && mkdir -p /tmp/todo && cp -r /tmp/cand/. /tmp/todo/
LEFT=$(python3 -c "
import json,glob,random
done={(x['task'],x.get('kind')) for f in glob.glob('$R/sweep-*.jsonl')+glob.glob('${DONE:-.kb/done}/*.jsonl') for x in map(json.loads,filter(str.strip,open(f))) if x.get('pass')=='warm'}
import re
m=[e for e in json.load(open('/tmp/cand/all.json')) if (e['task'],e.get('kind')) not in done and re.search('${ONLY:-.}', e['task'])]
random.Random(0).shuffle(m)  # large level-1 tasks beside small ones of every level
json.dump(m,open('/tmp/todo/manifest.json','w')); print(len(m))")
echo "$LEFT left"
( while true; do echo "$(( $(date +%s) - T0 )) $(df -BG --output=used,avail / | tail -1 | tr -s ' ') $(free -g | awk '/Mem/{print $3}') $(df -BG --output=used /dev/shm | tail -1 | tr -d ' ') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 10; done >> $R/usage-$T0.log 2>&1 ) > /dev/null 2>&1 &
LOGGER=$!
if [ "$LEFT" != 0 ]; then
  timeout $(( ${BUDGET:-570} - ($(date +%s) - T0) )) target/release/${BINARY:-evaluator-kernelbench} --kernelbench .kb/kernelbench \
    --python $(which python3) --work $W --no-torch-compile --again --candidates /tmp/todo --gpu-slots ${SLOTS:-4} \
    --in-flight $(( ${SLOTS:-4} * $(nvidia-smi -L | grep -c ^GPU) )) --out $R/sweep-$T0.jsonl > $R/sweep-$T0.log 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s, $(grep -c . $R/sweep-$T0.jsonl) lines"
fi
python3 bench/kernelbench/sweep_summary.py $R/sweep-*.jsonl $(ls ${DONE:-.kb/done}/*.jsonl 2>/dev/null) 2>&1 | tail -40
echo "total $(( $(date +%s) - T0 )) s"; df -h / | tail -1
