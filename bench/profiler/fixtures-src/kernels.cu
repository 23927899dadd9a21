// Three kernels with known bottlenecks, for recording Nsight Compute fixtures the profiler's parser, diagnosis
// and metric selection are tested on. Usage: kernels {memory|compute|occupancy} [repeats]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    cudaError_t e = (call);                                                                          \
    if (e != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                 \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Memory-bound: 12 bytes of DRAM traffic per two flops, over 1 GiB per array.
__global__ void stream_axpy(const float* __restrict__ x, float* __restrict__ y, float a, size_t n) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) y[i] = a * x[i] + y[i];
}

// Compute-bound: eight independent chains of fused multiply-adds per thread, no memory traffic in the loop.
__global__ void fma_chains(float* out, int iters) {
  float v[8];
  for (int c = 0; c < 8; ++c) v[c] = threadIdx.x * 0.001f + c;
  for (int k = 0; k < iters; ++k) {
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = fmaf(v[c], 0.99991f, 0.00013f);
  }
  float s = 0.f;
  for (int c = 0; c < 8; ++c) s += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Occupancy-limited: 64 threads a block and 112 KiB of dynamic shared memory a block, so at most two blocks
// (four warps) fit on an SM; each thread streams through global memory with few loads in flight.
__global__ void shared_hog(const float* __restrict__ x, float* __restrict__ y, size_t n) {
  extern __shared__ float tile[];
  size_t stride = (size_t)gridDim.x * blockDim.x;
  float acc = 0.f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
    tile[threadIdx.x] = x[i];
    acc += tile[threadIdx.x] * 1.5f;
  }
  y[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "memory";
  int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (!std::strcmp(which, "memory")) {
    size_t n = (size_t)1 << 28;
    float *x, *y;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMalloc(&y, n * sizeof(float)));
    CHECK(cudaMemset(x, 0, n * sizeof(float)));
    CHECK(cudaMemset(y, 0, n * sizeof(float)));
    for (int r = 0; r < repeats; ++r) stream_axpy<<<sms * 8, 256>>>(x, y, 2.0f, n);
  } else if (!std::strcmp(which, "compute")) {
    float* out;
    int blocks = sms * 16, threads = 256;
    CHECK(cudaMalloc(&out, (size_t)blocks * threads * sizeof(float)));
    for (int r = 0; r < repeats; ++r) fma_chains<<<blocks, threads>>>(out, 1 << 14);
  } else {
    size_t n = (size_t)1 << 26;
    int shared = 112 * 1024;
    CHECK(cudaFuncSetAttribute(shared_hog, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    float *x, *y;
    int blocks = sms * 2, threads = 64;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMalloc(&y, (size_t)blocks * threads * sizeof(float)));
    CHECK(cudaMemset(x, 0, n * sizeof(float)));
    for (int r = 0; r < repeats; ++r) shared_hog<<<blocks, threads, shared>>>(x, y, n);
  }
  CHECK(cudaDeviceSynchronize());
  std::printf("%s done\n", which);
  return 0;
}
