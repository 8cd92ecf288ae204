// SPDX-License-Identifier: Apache-2.0
// attention::CudaFlash<float>, every member compiled once (forward and backward, head sizes 64/64, 128/128 and 192/128,
// for every architecture of CMAKE_CUDA_ARCHITECTURES), for C++ translation units that include
// seqpar/gpu/flash.hpp. One storage type per translation unit, so that they build in parallel.
#include "seqpar/gpu/flash.cuh"

template class seqpar::attention::CudaFlash<float>;
