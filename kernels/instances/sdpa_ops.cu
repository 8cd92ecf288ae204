// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The device kernels around cuDNN's SDPA (gpu/detail/sdpa_ops.hpp), compiled once for the project's
// tests, benchmarks and CudnnSdpa instances (seqpar::cuda_instances). They need no cuDNN.
#include "seqpar/gpu/detail/sdpa_ops.cuh"

namespace ops = seqpar::gpu::detail::sdpa_ops;
template void ops::zero_rows<__half>(cudaStream_t, seqpar::ThdView<__half>, ops::RowRanges);
template void ops::zero_rows<__nv_bfloat16>(cudaStream_t, seqpar::ThdView<__nv_bfloat16>, ops::RowRanges);
template void ops::accumulate_rows<__half>(cudaStream_t, seqpar::ThdView<__half>, const __half*, ops::RowRanges);
template void ops::accumulate_rows<__nv_bfloat16>(cudaStream_t, seqpar::ThdView<__nv_bfloat16>, const __nv_bfloat16*,
                                                  ops::RowRanges);
