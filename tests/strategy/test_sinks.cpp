// SPDX-License-Identifier: Apache-2.0
// Attention sinks (attention/sinks.hpp, gpt-oss) through every partitioner x communicator combination
// (tests/support/strategy_list.hpp) against an fp64 oracle written out from the definition
// (test::detail::sink_reference: explicit softmax with the extra term, backward from the explicit
// probabilities), forward, backward and the sinks' gradient, with and without a sliding window; through
// CpuFlash fp32 and bf16 and through ChunkedAttention; and the refusals.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/sinks.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

constexpr double kSinksTolerance = 1e-10;

// One logit per query head, drawn so that the sink matters (comparable with a row's largest scores),
// with one head of a large sink (most of the softmax) and one without a sink (-inf).
std::vector<double> random_sinks(int heads, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.5);
  std::vector<double> s;
  for (int h = 0; h < heads; ++h) s.push_back(normal(rng));
  s[0] = 6.0;
  if (heads > 1) s[static_cast<std::size_t>(heads - 1)] = -std::numeric_limits<double>::infinity();
  return s;
}

template <class Combination>
void check_sinks(Combination) {
  using S = typename Combination::strategy;
  const std::string name = Combination::name();
  typename S::Arguments args = Combination::arguments();
  int accepted = 0;
  for (const int world : {2, 3, 5, 8}) {
    std::mt19937 rng(static_cast<unsigned>(101 * world + name.size()));
    // Two sequences of lognormal documents (lengths 1 to ~40: split across shards, and shorter than
    // the window), so that every partitioner, Whole-Doc included, accepts most worlds.
    const DocumentBatch batch({test::lognormal_docs(60, 6.0, 1.0, rng), test::lognormal_docs(50, 9.0, 1.0, rng)});
    // Head counts every head-splitting communicator (Ulysses) can divide on this world; GQA on 2 and 8.
    const AttentionShape shape = world == 2   ? AttentionShape{4, 2, 8}
                                 : world == 8 ? AttentionShape{16, 8, 8}
                                              : AttentionShape{world, world, 8};
    args.ranks_per_node = world >= 4 ? world / 2 : world;
    const std::vector<double> sinks = random_sinks(shape.heads_q, static_cast<unsigned>(world));
    for (const std::int64_t window : {std::int64_t{0}, std::int64_t{7}}) {
      const test::MaskedBatch b = test::windowed(batch, window);
      INFO(name << ": world " << world << ", window " << window << ", " << b.batch.documents().size() << " documents");
      if (!S::can_implement(args, b.batch, shape, Topology{world, args.ranks_per_node}, b.mask).ok) continue;
      ++accepted;
      const auto err =
          test::check_strategy<S, attention::Reference<double>>(b, shape, world, args, {}, 7 + world, sinks);
      CHECK(err.o < kSinksTolerance);
      CHECK(err.lse < kSinksTolerance);
      CHECK(err.dq < kSinksTolerance);
      CHECK(err.dk < kSinksTolerance);
      CHECK(err.dv < kSinksTolerance);
      CHECK(err.dsinks < kSinksTolerance);
      CHECK(err.bytes_match);  // the sinks add no message to the programs (only the gradient's gather)
    }
  }
  MESSAGE(name << ": " << accepted << " runs");
  CHECK(accepted >= 4);
}

template <class Kernel, class S>
test::Errors run_with_sinks(const test::MaskedBatch& batch, const AttentionShape& shape, int world,
                            const typename S::Arguments& args, const std::vector<double>& sinks) {
  return test::check_attention<Kernel>(
      batch, shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args);
      },
      11, sinks);
}

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("sinks: every strategy equals the fp64 oracle (forward, backward, the sinks' gradient)") {
    test::for_each_combination([](auto combination) { check_sinks(combination); });
  }

  TEST_CASE("sinks: CpuFlash fp32 and bf16 through ring, Ulysses, all-gather and hierarchical") {
    std::mt19937 rng(5);
    const DocumentBatch batch({test::lognormal_docs(150, 20.0, 1.0, rng), {90, 3, 1}});
    const AttentionShape shape{4, 2, 32};
    const std::vector<double> sinks = random_sinks(shape.heads_q, 3);
    using Ring = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    using Gather = Strategy<partition::PerDoc, comm::AllGather>;
    using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    const auto check_fp32 = [](const test::Errors& e) {
      CHECK(e.o < 1e-5);
      CHECK(e.lse < 1e-5);
      CHECK(e.dq < 1e-4);
      CHECK(e.dk < 1e-4);
      CHECK(e.dv < 1e-4);
      CHECK(e.dsinks < 1e-4);
      CHECK(e.bytes_match);
    };
    using F32 = attention::CpuFlash<float>;
    check_fp32(run_with_sinks<F32, Ring>(batch, shape, 4, {}, sinks));
    check_fp32(run_with_sinks<F32, Ulysses>(batch, shape, 2, {}, sinks));
    check_fp32(run_with_sinks<F32, Gather>(test::windowed(batch, 16), shape, 3, {}, sinks));
    check_fp32(run_with_sinks<F32, Hier>(batch, shape, 4, hier, sinks));
    // bf16 storage: the tolerances of tests/strategy/test_bf16.cpp (the sinks' gradient sums
    // dO . O' over every row in fp32 from bf16 values).
    using B16 = attention::CpuFlash<attention::bf16>;
    for (const test::Errors& e : {run_with_sinks<B16, Ring>(batch, shape, 4, {}, sinks),
                                  run_with_sinks<B16, Hier>(test::windowed(batch, 9), shape, 4, hier, sinks)}) {
      CHECK(e.o < 1e-2);
      CHECK(e.lse < 1e-2);
      CHECK(e.dq < 2e-2);
      CHECK(e.dk < 2e-2);
      CHECK(e.dv < 2e-2);
      CHECK(e.dsinks < 2e-2);
    }
  }

  TEST_CASE("sinks: chunk by chunk (DynamicChunk's split documents, the KV-prefix carry) equals the oracle") {
    // The sink joins a chunk's rows after the prefix merge: a split document's later slice must count
    // it once, not once for its own keys and once for the carried prefix.
    std::mt19937 rng(9);
    const DocumentBatch batch({{70, 5, 1, 20}, test::lognormal_docs(50, 8.0, 1.0, rng)});
    const AttentionShape shape{4, 2, 8};
    const std::vector<double> sinks = random_sinks(shape.heads_q, 4);
    const auto chunks = schedule::DynamicChunk{{.token_capacity = 32}}.chunks(batch);
    REQUIRE(chunks.size() >= 4);
    using S = Strategy<partition::Zigzag, comm::Ring>;
    using Kernel = attention::Reference<double>;
    const auto err = test::distributed_check<Kernel>(
        batch, chunks, test::forward_then_backward(chunks.size()), shape, 4,
        [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
          return std::make_unique<DistributedAttention<S, Kernel>>(t, shape);
        },
        13, sinks);
    CHECK(err.max() < kSinksTolerance);
    CHECK(err.bytes_match);
  }

  TEST_CASE("sinks: -inf is no sink, and a direct kernel call with apply_sinks equals the engine") {
    std::mt19937 rng(2);
    const DocumentBatch batch({test::lognormal_docs(80, 10.0, 1.0, rng)});
    const AttentionShape shape{2, 1, 8};
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const double ninf = -std::numeric_limits<double>::infinity();
    const auto none = test::check_strategy<S, attention::Reference<double>>(batch, shape, 3, {}, {}, 5);
    const auto minus_inf =
        test::check_strategy<S, attention::Reference<double>>(batch, shape, 3, {}, {}, 5, {ninf, ninf});
    CHECK(none.max() < kSinksTolerance);
    CHECK(minus_inf.max() < kSinksTolerance);  // and its dsinks are exactly 0 (the oracle's)

    // One rank, the kernel called directly: forward, apply_sinks, backward with the sink's O and LSE,
    // accumulate_sink_gradient; against the oracle.
    test::detail::WholeBatch g(batch, {}, shape, 5, std::type_identity<test::HostStorage>{},
                               std::type_identity<double>{}, {1.5, -0.5});
    const attention::Reference<double> ref;
    const auto slices = batch.document_causal_slices();
    ref.forward(shape, g.q.view(), g.k.view(), g.v.view(), slices, g.o.view(), g.lse.view());
    attention::apply_sinks(g.o.view(), g.lse.view(), std::span<const double>(g.sinks));
    ref.backward(shape, g.q.view(), g.k.view(), g.v.view(), g.o.view(), g.lse.view(), g.dout.view(), slices,
                 g.dq.view(), g.dk.view(), g.dv.view());
    std::vector<double> ds(2, 0.0);
    attention::accumulate_sink_gradient(ThdView<const double>(g.dout.view()), ThdView<const double>(g.o.view()),
                                        LseView<const double>(g.lse.view()), std::span<const double>(g.sinks),
                                        std::span<double>(ds));
    g.dsinks.push_back(ds);
    test::Errors e;
    g.errors(e);
    CHECK(e.max() < kSinksTolerance);
  }

  TEST_CASE("sinks: bad logits and disagreeing ranks are refused before any communication") {
    const DocumentBatch batch({{20, 12}});
    const AttentionShape shape{2, 2, 8};
    using S = Strategy<partition::Zigzag, comm::Ring>;
    using K = attention::Reference<double>;
    // What each rank's call raised: (std::invalid_argument or seqpar::Error code, message).
    struct Outcome {
      std::string kind, what;
    };
    const auto run = [&](const std::vector<double>& rank0, const std::vector<double>& rank1, bool rank1_sinks) {
      std::vector<Outcome> out(2);
      std::mutex mu;
      backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
        DistributedAttention<S, K> attn(t, shape);
        const auto n = attn.local_tokens(batch);
        ThdTensor<double> q(n, 2, 8), o(n, 2, 8);
        LseTensor<double> lse(2, n);
        const std::vector<double>& mine = t.rank() == 1 ? rank1 : rank0;
        Outcome r{"none", ""};
        try {
          if (t.rank() == 1 && !rank1_sinks)
            attn.forward(batch, q.view(), q.view(), q.view(), o.view(), lse.view());
          else
            attn.forward(batch, q.view(), q.view(), q.view(), o.view(), lse.view(), std::span<const double>(mine));
        } catch (const std::invalid_argument& e) {
          r = {"invalid_argument", e.what()};
        } catch (const Error& e) {
          r = {e.errc() == Errc::kPeerFailed ? "peer_failed"
               : e.errc() == Errc::kMismatch ? "mismatch"
                                             : "error",
               e.what()};
        }
        const std::lock_guard lock(mu);
        out[static_cast<std::size_t>(t.rank())] = r;
      });
      return out;
    };
    const std::vector<double> good{0.5, 0.25};
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    // Wrong count, NaN, +inf on rank 1: std::invalid_argument naming the argument there, seqpar::Error
    // (kPeerFailed) carrying it on rank 0.
    for (const auto& [bad, named] :
         {std::pair{std::vector<double>{0.5}, "sinks.size()"}, std::pair{std::vector<double>{0.5, nan}, "sinks[1]"},
          std::pair{std::vector<double>{inf, 0.0}, "sinks[0]"}}) {
      const auto out = run(good, bad, true);
      INFO(out[1].what);
      CHECK(out[1].kind == "invalid_argument");
      CHECK(out[1].what.find(named) != std::string::npos);
      CHECK(out[0].kind == "peer_failed");
      CHECK(out[0].what.find(named) != std::string::npos);
    }
    // One rank with sinks, one without: both raise kMismatch naming the sinks (no rank waits on the
    // other's gather).
    const auto out = run(good, good, false);
    for (const Outcome& r : out) {
      INFO(r.what);
      CHECK(r.kind == "mismatch");
      CHECK(r.what.find("attention sinks") != std::string::npos);
    }
  }
}
