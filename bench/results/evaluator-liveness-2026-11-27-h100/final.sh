#!/bin/bash
# At the shipped line (1% of a CPU over 3 s, read every second; the 3 s floor), on the binaries in .kb/bin: the
# CUDA corpus where its binary was carried (its hang and its stream race included), then 3 and 4 cached relu
# evaluations beside the hang.
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/final target/release && cp .kb/bin/* target/release/ && gunzip -f target/release/kforge.gz && chmod +x target/release/kforge
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/final/device.txt 2>&1
export PATH=$PWD/target/release:$PATH
[ -e .kb/bin/corpus ] && KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
  KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 150 target/release/corpus --nocapture \
  > $OUT/final/corpus-cuda.log 2>&1; echo "corpus rc=$?"; grep -E "test result|FAILED|expected finding|infinite|race" $OUT/final/corpus-cuda.log | tail -8
for n in 3 4; do
  echo "== hang$n"; python3 bench/timing/hang.py --out /tmp/hang$n --n $n --repeats 2 --run-timeout 0 --deadline-s $(( (n == 3 ? 250 : 500) - ($(date +%s) - T0) )) 2>&1 | tail -5
  mkdir -p $OUT/final/hang$n && cp /tmp/hang$n/summary.md /tmp/hang$n/results.jsonl /tmp/hang$n/machine.txt $OUT/final/hang$n/
done
echo "total $(( $(date +%s) - T0 )) s"
