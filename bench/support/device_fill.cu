// SPDX-License-Identifier: Apache-2.0
// The kernels of device_fill.hpp, for float, __half and __nv_bfloat16.
#include "support/device_fill.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/detail/element.hpp"

namespace seqpar::bench {
namespace {

__device__ std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <class T>
__global__ void fill_normal_kernel(T* p, std::int64_t first, std::int64_t count, std::uint64_t tag) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t h = mix64(tag * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(first + i));
    const float u1 = (static_cast<float>(h >> 40) + 0.5f) * 0x1.0p-24f;
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) * 0x1.0p-24f;
    p[i] = gpu::detail::from_float<T>(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

template <class T>
__global__ void count_nonfinite_kernel(const T* p, std::int64_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    local += isfinite(gpu::detail::to_float(p[i])) ? 0 : 1;
  if (local != 0) atomicAdd(count, local);
}

}  // namespace

template <class T>
void fill_normal(cudaStream_t stream, T* p, std::int64_t first, std::int64_t count, std::uint64_t tag) {
  if (count <= 0) return;
  fill_normal_kernel<<<1024, 256, 0, stream>>>(p, first, count, tag);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), "bench::fill_normal");
}

template <class T>
unsigned long long count_nonfinite(cudaStream_t stream, const T* p, std::int64_t n, unsigned long long* counter) {
  constexpr const char* where = "bench::count_nonfinite";
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned long long), stream), where);
  if (n > 0) {
    count_nonfinite_kernel<<<1024, 256, 0, stream>>>(p, n, counter);
    SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
  }
  unsigned long long host = 0;
  SEQPAR_CUDA_CHECK(cudaMemcpyAsync(&host, counter, sizeof(host), cudaMemcpyDeviceToHost, stream), where);
  SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream), where);
  return host;
}

#define SEQPAR_BENCH_DEVICE_FILL(T)                                                          \
  template void fill_normal<T>(cudaStream_t, T*, std::int64_t, std::int64_t, std::uint64_t); \
  template unsigned long long count_nonfinite<T>(cudaStream_t, const T*, std::int64_t, unsigned long long*);
SEQPAR_BENCH_DEVICE_FILL(float)
SEQPAR_BENCH_DEVICE_FILL(__half)
SEQPAR_BENCH_DEVICE_FILL(__nv_bfloat16)
#undef SEQPAR_BENCH_DEVICE_FILL

}  // namespace seqpar::bench
