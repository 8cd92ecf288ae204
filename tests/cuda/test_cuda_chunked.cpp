// SPDX-License-Identifier: Apache-2.0
// Chunked attention (DPP: a long document split across chunks, the K/V prefix carried) on one GPU:
// runtime::ChunkedAttention<CudaFlash<float>> on CudaExec, 1, 2 and 4 ranks sharing the GPU, over an
// all-to-all, a ring and a sharding-aware all-gather strategy; every chunk's forward, then every
// backward in reverse, gathered and compared with the fp64 reference over the whole batch (fp32: 1e-4
// of the largest reference value, as test_cuda_strategies measures), and each call's prefix bytes as
// counted by the transport equal to what its program declares. Skipped without a GPU.
#include <doctest/doctest.h>

#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device_storage.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/flash.hpp"
#include "support/distributed_check.hpp"

namespace seqpar {
namespace {

using Kernel = attention::CudaFlash<float>;

// The chunked entry point of the shared distributed check (tests/support/distributed_check.hpp), shards in
// device memory: every chunk's forward, then every backward in reverse.
template <class S>
test::Errors check_chunked_on_gpu(int world, typename S::Arguments args) {
  const AttentionShape shape{4, 2, 64};
  const DocumentBatch batch({{300, 9, 21, 40}, {17, 120, 3}});
  const std::vector<Chunk> chunks =
      schedule::DynamicChunk{{.token_capacity = 128, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch);
  return test::distributed_check<Kernel, test::DeviceStorage>(
      batch, chunks, test::forward_then_backward(chunks.size()), shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args, Kernel{});
      },
      static_cast<std::uint32_t>(world) + 5);
}

}  // namespace
}  // namespace seqpar

TEST_SUITE("cuda") {
  TEST_CASE("ChunkedAttention<CudaFlash<float>> on one GPU equals attention over the whole batch") {
    using namespace seqpar;
    for (int world : {1, 2, 4}) {
      CAPTURE(world);
      const auto a2a = check_chunked_on_gpu<Strategy<partition::Uniform, comm::AllToAll>>(world, {});
      CHECK(a2a.max() < 1e-4);
      CHECK(a2a.bytes_match);
      const auto ring = check_chunked_on_gpu<Strategy<partition::Zigzag, comm::Ring>>(world, {});
      CHECK(ring.max() < 1e-4);
      CHECK(ring.bytes_match);
      Strategy<partition::PerDoc, comm::AllGather>::Arguments aware;
      aware.comm.sharding_aware = true;
      const auto gather = check_chunked_on_gpu<Strategy<partition::PerDoc, comm::AllGather>>(world, aware);
      CHECK(gather.max() < 1e-4);
      CHECK(gather.bytes_match);
    }
  }
}
