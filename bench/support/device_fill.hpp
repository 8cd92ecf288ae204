// SPDX-License-Identifier: Apache-2.0
// Benchmark inputs drawn on the device and outputs scanned there (bench/attention_cuda.cpp,
// bench/runtime_cuda.cpp): declarations that the C++ compiler parses; the kernels are in
// device_fill.cu (float, __half, __nv_bfloat16), so that the benchmarks' host code stays out of nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace seqpar::bench {

/// Element i of p[0, count) is standard normal value number `first + i` of stream `tag` (splitmix64
/// of tag * 0x9E3779B97F4A7C15 + index, then Box-Muller), rounded to T: a rank that fills its rows
/// with their global indices holds the values of the whole-batch run; never zeros, which can time
/// faster than real data. A host generator would spend seconds on 16K x 16 x 128 x 4 values.
template <class T>
void fill_normal(cudaStream_t stream, T* p, std::int64_t first, std::int64_t count, std::uint64_t tag);

/// The number of non-finite elements of p[0, n), counted in `counter` (one device word, zeroed
/// here); waits for `stream`.
template <class T>
unsigned long long count_nonfinite(cudaStream_t stream, const T* p, std::int64_t n, unsigned long long* counter);

}  // namespace seqpar::bench
