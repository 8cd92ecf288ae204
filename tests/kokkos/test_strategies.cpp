// SPDX-License-Identifier: Apache-2.0
// The strategy matrix of tests/support/strategy_list.hpp with attention::KokkosFlash<Serial-or-default-
// host space, double> as every rank's kernel (DistributedAttention on its KokkosExec context, the
// executor's DataOps<KokkosExec>), on in-process worlds of 1..8 ranks, forward and backward against
// the fp64 reference over the unsharded batch, at one head size and at d_qk 8 / d_v 12; and 24/16 in fp64,
// 192/128 in fp32 through ring, Ulysses, all-gather and hierarchical, 24/16 with sinks and chunk by chunk.
#include <doctest/doctest.h>

#include <seqpar/kokkos.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

using Kernel = attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, double>;
static_assert(attention::AttentionKernel<Kernel>);

// fp64 everywhere: only the summation order differs from the reference.
constexpr double kTol = 1e-10;

// Small tiles, so that the short shards of these batches still span several query and key tiles.
Kernel kernel() {
  return Kernel({.q_tile = 8, .k_tile = 8});
}

// head_dim_v 0: one head size (8); otherwise V, O, dO and dV have head_dim_v values per head.
template <class Combination>
void check_combination(Combination, int head_dim_v = 0) {
  using S = typename Combination::strategy;
  const std::string name = Combination::name();
  typename S::Arguments args = Combination::arguments();
  int accepted = 0;
  for (int world = 1; world <= 8; ++world) {
    // As tests/strategy: B = 1..4 sequences of unequal length, lognormal documents on even worlds and
    // a long tail (one document of most of the sequence plus 1..3-token ones) on odd worlds.
    std::mt19937 rng(1000u * static_cast<unsigned>(world) + 17u);
    const int sequences = 1 + (world + static_cast<int>(name.size())) % 4;
    std::vector<std::vector<std::int64_t>> seqs;
    for (int b = 0; b < sequences; ++b) {
      const std::int64_t tokens = 40 + 13 * b + static_cast<std::int64_t>(rng() % 17);
      if (world % 2 == 0) {
        seqs.push_back(test::lognormal_docs(tokens, 9.0, 1.0, rng));
        continue;
      }
      std::vector<std::int64_t> docs{tokens - static_cast<std::int64_t>(rng() % 8)};
      for (std::int64_t left = tokens - docs[0]; left > 0;) {
        docs.push_back(std::min<std::int64_t>(left, 1 + static_cast<std::int64_t>(rng() % 3)));
        left -= docs.back();
      }
      std::shuffle(docs.begin(), docs.end(), rng);
      seqs.push_back(docs);
    }
    const DocumentBatch batch(seqs);
    AttentionShape shape = world % 3 == 0 ? AttentionShape{4, 4, 8} : AttentionShape{8, 2, 8};
    shape.head_dim_v = head_dim_v;
    args.ranks_per_node = world >= 4 ? world / 2 : world;
    INFO(name << ": world " << world << ", " << batch.documents().size() << " documents, heads " << shape.heads_q << ":"
              << shape.heads_kv << ", head sizes " << shape.qk_dim() << "/" << shape.v_dim());
    if (!S::can_implement(args, batch, shape, Topology{world, args.ranks_per_node}).ok) continue;
    ++accepted;
    const auto err = test::check_strategy<S, Kernel>(batch, shape, world, args, kernel());
    CHECK(err.o < kTol);
    CHECK(err.lse < kTol);
    CHECK(err.dq < kTol);
    CHECK(err.dk < kTol);
    CHECK(err.dv < kTol);
    CHECK(err.bytes_match);
  }
  MESSAGE(name << " on KokkosFlash: " << accepted << " world sizes run");
  CHECK(accepted >= 4);
}

}  // namespace

TEST_SUITE("kokkos") {
  TEST_CASE_TEMPLATE_DEFINE("KokkosFlash: partitioner x every communicator", P, kokkos_every_communicator) {
    test::for_each_communicator<P>([](auto combination) { check_combination(combination); });
  }
  TEST_CASE_TEMPLATE_APPLY(kokkos_every_communicator, test::Partitioners);

  // The same matrix with d_qk 8, d_v 12 (wider values than keys, off the kernel's 8-column register blocks).
  TEST_CASE_TEMPLATE_DEFINE("KokkosFlash with d_qk 8, d_v 12: partitioner x every communicator", P,
                            kokkos_every_communicator_head_sizes) {
    test::for_each_communicator<P>([](auto combination) { check_combination(combination, 12); });
  }
  TEST_CASE_TEMPLATE_APPLY(kokkos_every_communicator_head_sizes, test::Partitioners);

  TEST_CASE("KokkosFlash's can_implement: the calls' refusals, asked by the engine before any communication") {
    const Kernel flash = kernel();
    CHECK(flash.can_implement({4, 2, 32}));
    const Status gqa = flash.can_implement({3, 2, 32});
    CHECK_FALSE(gqa);
    CHECK(gqa.reason == "KokkosFlash: heads_q = 3: must be a multiple of heads_kv = 2");
    // Tiles whose team scratch (any pass) exceeds the space's level-1 maximum, as the calls refuse them.
    const Kernel huge({.q_tile = 4096, .k_tile = 4096});
    const AttentionShape wide{4, 2, 1024};
    const Status tiles = huge.can_implement(wide);
    CHECK_FALSE(tiles);
    CHECK(tiles.reason.find("KokkosFlash: args.q_tile/k_tile = 4096/4096: team scratch of") != std::string::npos);
    // Through DistributedAttention: every rank refuses with the local checks, before any message.
    const DocumentBatch batch({{20, 13}});
    std::vector<std::string> errors(2);
    std::vector<std::uint64_t> messages(2);
    try {
      backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        try {
          DistributedAttention<Strategy<partition::Zigzag, comm::Ring>, Kernel> attn(
              t, wide, {}, Kernel({.q_tile = 4096, .k_tile = 4096}));
          AttentionTensors<double> l(attn.local_tokens(batch), wide);
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        } catch (const std::invalid_argument& e) {
          errors[r] = e.what();
        }
        messages[r] = t.counters().messages_sent;
      });
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK(errors[r].find("the kernel cannot run it: KokkosFlash: args.q_tile/k_tile = 4096/4096") !=
            std::string::npos);
      CHECK(messages[r] == 1);  // the agreement's all_gather block to the one peer
    }
  }

  TEST_CASE("KokkosFlash with d_qk != d_v: ring, Ulysses, all-gather and hierarchical equal the fp64 reference") {
    std::mt19937 rng(11);
    const DocumentBatch batch({test::lognormal_docs(80, 9.0, 1.0, rng), {50, 3, 1, 17}});
    using Ring = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    using Gather = Strategy<partition::PerDoc, comm::AllGather>;
    using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    // fp64, 24/16 (GQA 4:2; Ulysses splits the heads over 2 ranks): only the summation order differs.
    AttentionShape small{4, 2, 24};
    small.head_dim_v = 16;
    const test::MaskedBatch windowed = test::windowed(batch, 7);
    for (const test::Errors& e : {test::check_strategy<Ring, Kernel>(batch, small, 3, {}, kernel()),
                                  test::check_strategy<Ulysses, Kernel>(windowed, small, 2, {}, kernel()),
                                  test::check_strategy<Gather, Kernel>(windowed, small, 3, {}, kernel()),
                                  test::check_strategy<Hier, Kernel>(batch, small, 4, hier, kernel())}) {
      MESSAGE("24/16 fp64: max error " << e.max());
      CHECK(e.o < kTol);
      CHECK(e.lse < kTol);
      CHECK(e.dq < kTol);
      CHECK(e.dk < kTol);
      CHECK(e.dv < kTol);
      CHECK(e.bytes_match);  // K and V pieces counted at their own widths
    }
    // fp32, MLA's 192/128: the tolerances of CpuFlash fp32 in tests/strategy/test_head_sizes.cpp.
    using F32 = attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, float>;
    const F32 f32({.q_tile = 16, .k_tile = 16});
    AttentionShape mla{4, 2, 192};
    mla.head_dim_v = 128;
    for (const test::Errors& e : {test::check_strategy<Ring, F32>(batch, mla, 4, {}, f32),
                                  test::check_strategy<Ulysses, F32>(batch, mla, 2, {}, f32),
                                  test::check_strategy<Gather, F32>(windowed, mla, 3, {}, f32),
                                  test::check_strategy<Hier, F32>(windowed, mla, 4, hier, f32)}) {
      MESSAGE("192/128 fp32: max error " << e.max());
      CHECK(e.o < 1e-5);
      CHECK(e.lse < 1e-5);
      CHECK(e.dq < 1e-4);
      CHECK(e.dk < 1e-4);
      CHECK(e.dv < 1e-4);
      CHECK(e.bytes_match);
    }
  }

  // The sink epilogue rescales O rows of d_v values on DataOps<KokkosExec>; chunk by chunk, the carry holds
  // K and V rows of their own widths.
  TEST_CASE("KokkosFlash with d_qk != d_v: attention sinks, and chunk by chunk through the ring") {
    std::mt19937 rng(12);
    const DocumentBatch batch({test::lognormal_docs(90, 9.0, 1.0, rng), {40, 5, 1, 14}});
    AttentionShape shape{4, 2, 24};
    shape.head_dim_v = 16;
    using Ring = Strategy<partition::Zigzag, comm::Ring>;
    using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    const std::vector<double> sinks{2.0, -0.5, 0.75, -std::numeric_limits<double>::infinity()};
    for (const test::Errors& e :
         {test::check_strategy<Ring, Kernel>(batch, shape, 3, {}, kernel(), 5, sinks),
          test::check_strategy<Hier, Kernel>(test::windowed(batch, 6), shape, 4, hier, kernel(), 5, sinks)}) {
      MESSAGE("24/16 with sinks: max error " << e.max());
      CHECK(e.max() < kTol);
      CHECK(e.bytes_match);
    }
    const auto chunks = schedule::DynamicChunk{{.token_capacity = 32}}.chunks(batch);
    REQUIRE(chunks.size() >= 4);
    const auto err = test::distributed_check<Kernel>(
        batch, chunks, test::forward_then_backward(chunks.size()), shape, 4,
        [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
          return std::make_unique<DistributedAttention<Ring, Kernel>>(t, shape, Ring::Arguments{}, kernel());
        },
        13);
    MESSAGE("24/16 chunked (" << chunks.size() << " chunks): max error " << err.max());
    CHECK(err.max() < kTol);
    CHECK(err.bytes_match);
  }

  TEST_CASE("KokkosFlash with attention sinks: the epilogue on DataOps<KokkosExec>, exact vs the fp64 oracle") {
    std::mt19937 rng(3);
    const DocumentBatch batch({test::lognormal_docs(90, 9.0, 1.0, rng), test::lognormal_docs(60, 5.0, 1.0, rng)});
    const AttentionShape shape{4, 2, 8};
    const std::vector<double> sinks{4.0, -0.5, 1.25, -std::numeric_limits<double>::infinity()};
    using Ring = Strategy<partition::Zigzag, comm::Ring>;
    using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    for (const test::Errors& e :
         {test::check_strategy<Ring, Kernel>(batch, shape, 3, {}, kernel(), 5, sinks),
          test::check_strategy<Hier, Kernel>(test::windowed(batch, 6), shape, 4, hier, kernel(), 5, sinks)}) {
      CHECK(e.max() < kTol);
      CHECK(e.bytes_match);
    }
  }
}
