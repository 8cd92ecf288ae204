// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::DefaultCudaKernel<T>`: the CUDA attention kernel seqpar recommends for element type T
/// (issue 38). For __half and __nv_bfloat16: `CudnnSdpa<T>` (cuDNN's fused attention, the kernel
/// torch's SDPA runs; 24-43x CudaFlash's speed in the one GPU run, 2026-12-04) when seqpar::cudnn is
/// built (kernels/cudnn.cmake defines SEQPAR_ENABLE_CUDNN for its users); otherwise, and for float,
/// `CudaFlash<T>` (seqpar's FlashAttention-2, the fp32 kernel, the on-GPU oracle and CudnnSdpa's own
/// fallback for a graph cuDNN will not build). `kDefaultCudaKernelIsCudnn<T>` says which one it is.
///
/// @code
/// using Kernel = seqpar::attention::DefaultCudaKernel<__nv_bfloat16>;  // CudnnSdpa where built
/// seqpar::DistributedAttention<ZigzagRing, Kernel> attn(transport, shape, args, Kernel(exec));
/// @endcode
///
/// Status: CudnnSdpa has never run in seqpar (compiled for sm_80 and sm_90a only); CudaFlash ran on an
/// H200 on 2026-12-04 (bench/device/results/2026-12-04-h200/).

#include <type_traits>

#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/flash.hpp"
#if defined(SEQPAR_ENABLE_CUDNN)
#include "seqpar/gpu/cudnn_sdpa.hpp"
#endif

namespace seqpar::attention {

namespace detail {
template <class T>
struct DefaultCudaKernel {
  using type = CudaFlash<T>;
};
#if defined(SEQPAR_ENABLE_CUDNN)
template <class T>
requires gpu::detail::kIsHalfPrecision<T>
struct DefaultCudaKernel<T> {
  using type = CudnnSdpa<T>;
};
#endif
}  // namespace detail

/// CudnnSdpa<T> for 16-bit T where seqpar::cudnn is built, else CudaFlash<T>.
template <class T>
using DefaultCudaKernel = typename detail::DefaultCudaKernel<T>::type;

/// Whether DefaultCudaKernel<T> is CudnnSdpa.
template <class T>
inline constexpr bool kDefaultCudaKernelIsCudnn = !std::is_same_v<DefaultCudaKernel<T>, CudaFlash<T>>;

static_assert(AttentionKernel<DefaultCudaKernel<float>>);
static_assert(AttentionKernel<DefaultCudaKernel<__nv_bfloat16>>);

}  // namespace seqpar::attention
