// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The small device kernels around cuDNN's SDPA (attention::CudnnSdpa), declared for host code;
/// defined in sdpa_ops.cuh and compiled once in kernels/instances/sdpa_ops.cu (seqpar::cuda_instances).
///  - `ragged_offsets`: a run's per-item element offsets into the eight tensors of a call, from the
///    items' first tokens and each tensor's token stride (views differ per call: Ulysses passes head
///    slices of wider buffers), as cuDNN's ragged-offset tensors (int32, items + 1 each).
///  - `scatter_stats` / `gather_stats`: cuDNN's padded statistics (items, heads, S_max, 1) to and from
///    the call's LSE view (heads, tokens).
///  - `zero_rows` / `accumulate_rows`: a run's rows of a dense (tokens, heads, d) scratch zeroed, then
///    added into the call's gradient (cuDNN's backward writes its gradients; the kernel protocol adds
///    them), only the rows of the run's items.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "seqpar/core/tensor.hpp"

namespace seqpar::gpu::detail::sdpa_ops {

/// Token strides of the tensors of a call, in the order of `ragged_offsets`' output arrays.
enum RaggedTensor : int { kQ, kK, kV, kO, kDo, kDq, kDk, kDv, kTensors };
struct RaggedStrides {
  std::int64_t token_stride[kTensors] = {};
};

/// out[t * (items + 1) + b] = first_token_t[b] * strides.token_stride[t], with first_token the items'
/// query tokens for Q, O, dO, dQ and key tokens for K, V, dK, dV (b in [0, items]: the last entry is
/// the end of the last item).
void ragged_offsets(cudaStream_t stream, const std::int64_t* q_tokens, const std::int64_t* k_tokens, int items,
                    RaggedStrides strides, std::int32_t* out);

/// lse(h, q_tokens[b] + s) = stats[(b * heads + h) * max_q + s] for s < q_lens[b].
void scatter_stats(cudaStream_t stream, const float* stats, const std::int64_t* q_tokens, const std::int32_t* q_lens,
                   int items, int heads, std::int64_t max_q, LseView<float> lse);
/// The inverse: stats[(b * heads + h) * max_q + s] = lse(h, q_tokens[b] + s) for s < q_lens[b].
void gather_stats(cudaStream_t stream, LseView<const float> lse, const std::int64_t* q_tokens,
                  const std::int32_t* q_lens, int items, int heads, std::int64_t max_q, float* stats);

/// The rows of a run's items, in device tables: item b holds rows [tokens[b], tokens[b] + prefix[b + 1] -
/// prefix[b]) of a buffer; `rows` = prefix[items] rows in all (items of zero length allowed: a run's
/// padding). The backward's zeroing and adding touch only these rows (issue 38, C2).
struct RowRanges {
  const std::int64_t* tokens = nullptr;  ///< device, items + 1
  const std::int64_t* prefix = nullptr;  ///< device, items + 1: prefix sums of the items' lengths
  int items = 0;
  std::int64_t rows = 0;
};

/// scratch(t, :, :) = 0 for the rows t of `ranges` (scratch: dense (tokens, heads, head_dim), as its view says).
template <class T>
void zero_rows(cudaStream_t stream, ThdView<T> scratch, RowRanges ranges);

/// dst(t, h, :) += src[(t * heads + h) * head_dim + :] for the rows t of `ranges` and every head of dst (in
/// float, rounded once); src is the dense (tokens, heads, head_dim) scratch cuDNN wrote.
template <class T>
void accumulate_rows(cudaStream_t stream, ThdView<T> dst, const T* src, RowRanges ranges);

}  // namespace seqpar::gpu::detail::sdpa_ops
