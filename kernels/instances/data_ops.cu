// SPDX-License-Identifier: Apache-2.0
// runtime::DataOps<gpu::CudaExec>'s launches for every storage type (float, __half, __nv_bfloat16;
// LSE in float), compiled once for C++ translation units that include seqpar/gpu/data_ops.hpp.
#include "seqpar/gpu/data_ops.cuh"

#define SEQPAR_DATA_OPS_INSTANCES(T)                                                                                  \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::pack<T, float>(                                      \
      const seqpar::gpu::CudaExec&, const seqpar::runtime::BufferTable<T, float>&,                                    \
      seqpar::runtime::TableSlice<seqpar::runtime::PieceCopy>, std::byte*, seqpar::comm::HeadWidths);                 \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::unpack<T, float>(                                    \
      const seqpar::gpu::CudaExec&, const seqpar::runtime::BufferTable<T, float>&,                                    \
      seqpar::runtime::TableSlice<seqpar::runtime::PieceCopy>, const std::byte*, seqpar::comm::HeadWidths);           \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::zero<T, float>(                                      \
      const seqpar::gpu::CudaExec&, const seqpar::runtime::BufferTable<T, float>&,                                    \
      std::span<const seqpar::runtime::BufferId>);                                                                    \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::fill_empty<T, float>(                                \
      const seqpar::gpu::CudaExec&, seqpar::ThdView<T>, seqpar::LseView<float>);                                      \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::merge<T, float>(                                     \
      const seqpar::gpu::CudaExec&, seqpar::ThdView<T>, seqpar::LseView<float>, seqpar::ThdView<T>,                   \
      seqpar::LseView<float>, seqpar::runtime::TableSlice<seqpar::AttnSlice>);                                        \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::apply_sinks<T, float>(                               \
      const seqpar::gpu::CudaExec&, seqpar::ThdView<T>, seqpar::LseView<float>, const float*);                        \
  template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::sink_gradient<T, float>(                             \
      const seqpar::gpu::CudaExec&, seqpar::ThdView<const T>, seqpar::ThdView<const T>, seqpar::LseView<const float>, \
      const float*, float*);

SEQPAR_DATA_OPS_INSTANCES(float)
SEQPAR_DATA_OPS_INSTANCES(__half)
SEQPAR_DATA_OPS_INSTANCES(__nv_bfloat16)

template void seqpar::runtime::DataOps<seqpar::gpu::CudaExec>::sum_parts<float>(const seqpar::gpu::CudaExec&,
                                                                                const float*, int, std::size_t, float*);

#undef SEQPAR_DATA_OPS_INSTANCES
