#!/bin/bash
# Records the Nsight Compute fixtures the profiler's tests read (services/profiler/tests/fixtures/<gpu>/): three
# kernels with known bottlenecks (bench/profiler/fixtures-src/kernels.cu) under `--set full` and under the default
# metric set (CudaForge's 24, `CUDAFORGE` in services/profiler/src/nsight.rs) with raw CSV in base units, the
# device's attributes, and the tool versions. Run on the GPU machine from the repository root:
#   OUT=/some/dir bash bench/profiler/record-fixtures.sh
set -u
cd "$(dirname "$0")/fixtures-src"
mkdir -p "$OUT/fixtures"
F=$OUT/fixtures
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  ncu --version; nvcc --version | tail -2; cat /proc/driver/nvidia/params 2>/dev/null | grep -i profil; id; } > "$F/machine.txt" 2>&1
python3 device_attributes.py > "$F/device_attributes.json" 2> "$F/device_attributes.err"
# The default set's 24 names, comma-joined, as the profiler's source lists them.
M=$(sed -n '/^pub const CUDAFORGE/,/^];/p' ../../../services/profiler/src/nsight.rs | grep -o '"[a-z0-9_.]*"' | tr -d '"' | paste -sd,)
[ "$(echo "$M" | tr ',' '\n' | wc -l)" = 24 ] || { echo "expected 24 metrics in CUDAFORGE, got: $M"; exit 1; }
nvcc -O3 -arch=native -o /tmp/kernels kernels.cu 2> "$F/nvcc.log" || { echo "nvcc failed"; cat "$F/nvcc.log"; exit 1; }
for kind in memory compute occupancy; do
  case $kind in memory) k=stream_axpy;; compute) k=fma_chains;; occupancy) k=shared_hog;; esac
  /usr/bin/time -f "%e s" -o "$F/$kind.time" ncu --csv --page raw --print-units base --set full \
    --kernel-name "$k" --launch-count 2 /tmp/kernels $kind 3 > "$F/$kind.full.csv" 2> "$F/$kind.full.err"
  echo "$kind rc=$? $(cat $F/$kind.time)"
  ncu --csv --page raw --print-units base --metrics "$M" --kernel-name "$k" --launch-count 2 \
    /tmp/kernels $kind 3 > "$F/$kind.cudaforge.csv" 2> "$F/$kind.cudaforge.err"
  echo "$kind cudaforge rc=$?"
  ncu --csv --page details --print-units base --set full --kernel-name "$k" --launch-count 1 \
    /tmp/kernels $kind 1 > "$F/$kind.details.csv" 2>> "$F/$kind.full.err"
done
# A denied run's message, for the FAILED_PRECONDITION text: none on this machine if counters are open to all.
ncu --query-metrics --csv > "$F/query-metrics.csv" 2>&1 || true
ls -la "$F"
# How long ncu takes around a PyTorch process (import, CUDA context, one profiled launch), against the process alone.
cat > /tmp/probe.py <<'PY'
import torch
x = torch.randn(1 << 24, device="cuda")
for _ in range(3):
    y = x * 2 + 1
torch.cuda.synchronize()
PY
/usr/bin/time -f "python alone %e s" python3 /tmp/probe.py 2>> "$F/torch-probe.txt"
for set in basic full; do
  /usr/bin/time -f "ncu --set $set, one launch: %e s" ncu --set $set --kernel-name regex:elementwise --launch-count 1 \
    --csv --page raw python3 /tmp/probe.py > /dev/null 2>> "$F/torch-probe.txt"
done
cat "$F/torch-probe.txt"
