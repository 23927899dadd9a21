#!/bin/bash
# GPU run A: machine facts, the CUDA corpus, then the timing-fidelity dobench and warm phases.
set -x
cd "$(dirname "$0")/.."
mkdir -p $OUT/a
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; } > $OUT/a/machine.txt 2>&1
mkdir -p target/release && cp .kb/bin/* target/release/
export PATH=$PWD/target/release:$PATH
KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 300 target/release/corpus --nocapture > $OUT/a/corpus-cuda.log 2>&1
echo corpus rc=$?
tail -40 $OUT/a/corpus-cuda.log
