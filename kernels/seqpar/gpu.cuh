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
/// #include <seqpar/gpu.cuh>
/// using namespace seqpar;  // safe in a .cu: the namespace is seqpar::gpu, not libcu++'s ::cuda
/// @endcode

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.cuh"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/device_world.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.cuh"
#include "seqpar/gpu/slices.hpp"
