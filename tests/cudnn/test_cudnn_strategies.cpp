// SPDX-License-Identifier: Apache-2.0
// CudnnSdpa under the runtime: a kernel type, so every strategy runs on it unchanged. A subset of the
// partitioner x communicator matrix (the zigzag ring with sharding-aware exchange, Ulysses, FlashCP's
// hybrid with a sharding-aware all-gather, and the hierarchical all-to-all + ring of USP) on 1, 2, 4
// and 8 ranks sharing the GPU (gpu::device_world), forward and backward against the fp64 reference
// over the whole packed batch at TransformerEngine's bf16 tolerance 2.5e-2, and the bytes each rank
// moved equal to what its programs declare. The executor prepares CudnnSdpa once per program
// (CudnnSdpa::prepare): this is the path a trainer takes. Skipped without a GPU. Written on a machine
// without one (2026-12-04): compiled there, to be run by bench/device/run.sh. MLA's head sizes 192/128
// (2026-12-05): ring, all-to-all and all-gather strategies on devices of compute capability 9.0 and newer
// (skipped with a message on older ones, where CudnnSdpa refuses the shape); compiled, never run.
// Attention sinks through an engine on CudnnSdpa (issue 38, 2026-12-07): compiled, never run.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "cuda/device_storage.hpp"
#include "seqpar/gpu/cudnn_sdpa.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/device_world.hpp"
#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

namespace seqpar {
namespace {

using Kernel = attention::CudnnSdpa<__nv_bfloat16>;
constexpr double kBf16Tolerance = 2.5e-2;

template <class S>
test::Errors check_on_gpu(const test::MaskedBatch& batch, const AttentionShape& shape, int world,
                          typename S::Arguments args, const std::vector<double>& sinks = {}) {
  return test::distributed_check<Kernel, test::DeviceStorage>(
      batch, shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args, Kernel{});
      },
      static_cast<std::uint32_t>(world) + 11, sinks);
}

// Two sequences of lognormal documents (median 12 tokens, length-1 documents among them).
DocumentBatch make_batch(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < 2; ++b) seqs.push_back(test::lognormal_docs(90 + 37 * b, 12.0, 1.0, rng));
  return DocumentBatch(seqs);
}

}  // namespace
}  // namespace seqpar

TEST_SUITE("cudnn") {
  TEST_CASE("CudnnSdpa<__nv_bfloat16> through DistributedAttention: a strategy subset on one GPU, head_dim 128") {
    using namespace seqpar;
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    using HybridGather = Strategy<partition::Hybrid, comm::AllGather>;
    using Usp = Strategy<partition::BatchAware<partition::PerDoc>, test::communicators::HierarchicalA2aRing>;
    const AttentionShape shape{8, 2, 128};
    for (int world : {1, 2, 4, 8}) {
      const DocumentBatch batch = make_batch(101u + static_cast<unsigned>(world));
      int run = 0;
      const auto check = [&]<class S>(const char* name, typename S::Arguments args) {
        INFO(name << ", world " << world);
        if (!S::can_implement(args, batch, shape,
                              Topology{world, args.ranks_per_node == 0 ? world : args.ranks_per_node}))
          return;
        ++run;
        const auto err = check_on_gpu<S>(batch, shape, world, args);
        CHECK(err.o < kBf16Tolerance);
        CHECK(err.lse < kBf16Tolerance);
        CHECK(err.dq < kBf16Tolerance);
        CHECK(err.dk < kBf16Tolerance);
        CHECK(err.dv < kBf16Tolerance);
        CHECK(err.bytes_match);
      };
      typename ZigzagRing::Arguments ring;
      ring.comm.sharding_aware = true;
      check.template operator()<ZigzagRing>("Zigzag x Ring(sharding-aware)", ring);
      check.template operator()<Ulysses>("Uniform x AllToAll", {});
      typename HybridGather::Arguments gather;
      gather.comm.sharding_aware = true;
      check.template operator()<HybridGather>("Hybrid x AllGather(sharding-aware)", gather);
      if (world >= 4) {
        typename Usp::Arguments usp;
        usp.ranks_per_node = world / 2;
        check.template operator()<Usp>("BatchAware<PerDoc> x Hierarchical(A2A, Ring)", usp);
      }
      CHECK(run >= 2);
    }
  }
  TEST_CASE("CudnnSdpa<__nv_bfloat16> with attention sinks through an engine: the LSE's units end to end") {
    // The engine applies sinks from each row's LSE (attention/sinks.hpp): cuDNN's statistics must be the
    // natural-log LSE of the scaled scores, as every other kernel's. Ring and a hierarchical strategy
    // with a sliding window, against the fp64 reference with the same sinks (issue 38, device item 7).
    using namespace seqpar;
    std::mt19937 rng(4);
    const DocumentBatch batch({test::lognormal_docs(120, 12.0, 1.0, rng), test::lognormal_docs(80, 6.0, 1.0, rng)});
    const AttentionShape shape{4, 2, 64};
    const std::vector<double> sinks{4.0, -0.5, 1.25, -std::numeric_limits<double>::infinity()};
    using Ring = Strategy<partition::Zigzag, comm::Ring>;
    using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    for (const test::Errors& e : {check_on_gpu<Ring>(batch, shape, 3, {}, sinks),
                                  check_on_gpu<Hier>(test::windowed(batch, 24), shape, 4, hier, sinks)}) {
      CHECK(e.o < kBf16Tolerance);
      CHECK(e.lse < kBf16Tolerance);
      CHECK(e.dq < kBf16Tolerance);
      CHECK(e.dk < kBf16Tolerance);
      CHECK(e.dv < kBf16Tolerance);
      CHECK(e.dsinks < kBf16Tolerance);
      CHECK(e.bytes_match);
    }
  }
  TEST_CASE(
      "CudnnSdpa<__nv_bfloat16> through DistributedAttention at MLA's 192/128 (sm_90+): ring, all-to-all, "
      "all-gather") {
    using namespace seqpar;
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    using HybridGather = Strategy<partition::Hybrid, comm::AllGather>;
    AttentionShape shape{8, 2, 192};
    shape.head_dim_v = 128;
    const Kernel probe;
    if (probe.exec().compute_capability() < 90) {
      CHECK_FALSE(probe.can_implement(shape));
      MESSAGE("compute capability below 9.0: CudnnSdpa refuses 192/128 here (cuDNN runs it from 9.0 on); skipped");
      return;
    }
    for (int world : {2, 4}) {
      const DocumentBatch batch = make_batch(91u + static_cast<unsigned>(world));
      int run = 0;
      const auto check = [&]<class S>(const char* name, typename S::Arguments args) {
        INFO(name << ", world " << world << ", 192/128");
        if (!S::can_implement(args, batch, shape,
                              Topology{world, args.ranks_per_node == 0 ? world : args.ranks_per_node}))
          return;
        ++run;
        const auto err = check_on_gpu<S>(batch, shape, world, args);
        CHECK(err.o < kBf16Tolerance);
        CHECK(err.lse < kBf16Tolerance);
        CHECK(err.dq < kBf16Tolerance);
        CHECK(err.dk < kBf16Tolerance);
        CHECK(err.dv < kBf16Tolerance);
        CHECK(err.bytes_match);
      };
      typename ZigzagRing::Arguments ring;
      ring.comm.sharding_aware = true;
      check.template operator()<ZigzagRing>("Zigzag x Ring(sharding-aware)", ring);
      check.template operator()<Ulysses>("Uniform x AllToAll", {});
      check.template operator()<HybridGather>("Hybrid x AllGather", {});
      CHECK(run >= 2);
    }
  }
}
