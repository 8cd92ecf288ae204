// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// attention::CudnnSdpa<T> compiled once (seqpar::cudnn_instances): plain C++ over cudnn-frontend, so
// that host code (tests, benchmarks, a trainer) includes cudnn_sdpa.hpp and links this.
#include "seqpar/gpu/cudnn_sdpa_impl.hpp"

template class seqpar::attention::CudnnSdpa<__half>;
template class seqpar::attention::CudnnSdpa<__nv_bfloat16>;
