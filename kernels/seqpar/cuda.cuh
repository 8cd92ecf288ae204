// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The CUDA path in one include (for .cu translation units): the stream-ordered context, the
/// attention kernel, the executor's data operations on the GPU (needed wherever a
/// `DistributedAttention<S, attention::CudaFlash<T>>` is instantiated), device memory and slice
/// upload, and the one-GPU in-process world.
///
/// @code
/// #include <seqpar/seqpar.hpp>
/// #include <seqpar/cuda.cuh>
/// namespace sp = seqpar;   // not `using namespace seqpar;` at file scope: `cuda::` would be ambiguous
///                          // between seqpar::cuda and libcu++'s ::cuda
/// @endcode

#include "seqpar/cuda/check.hpp"
#include "seqpar/cuda/data_ops.cuh"
#include "seqpar/cuda/device_memory.hpp"
#include "seqpar/cuda/device_world.hpp"
#include "seqpar/cuda/exec.hpp"
#include "seqpar/cuda/flash.cuh"
#include "seqpar/cuda/slices.hpp"
