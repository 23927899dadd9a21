#!/bin/bash
# The CUDA corpus at the corpus binary in .kb/bin (commit in .kb/bin/COMMIT): the flush through the harness's own
# torch.Tensor.zero_, watched.
cd "$(dirname "$0")/../../.."
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton;print(torch.__version__,torch.version.cuda,triton.__version__)"; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/corpus-machine.txt 2>&1
KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda KFORGE_CORPUS_RUN_TIMEOUT=60 \
  KFORGE_CORPUS_PYTHON=$(which python3) timeout 200 .kb/bin/corpus --nocapture > $OUT/corpus-cuda.log 2>&1
echo "corpus rc=$?"; grep -E "test result|FAILED" $OUT/corpus-cuda.log | tail -4
