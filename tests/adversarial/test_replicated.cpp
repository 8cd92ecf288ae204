// SPDX-License-Identifier: Apache-2.0
// Issue 40, item 2: what every rank must hold alike is part of the call's agreement. Two layers called in
// different orders on two ranks are Errc::kMismatch naming the layer on every rank (not one layer's rows
// exchanged for another's); sinks and dsinks take part in the aliasing checks every other tensor has;
// sinks on one pass only: a backward without sinks after a forward with them is exact (frozen sinks), a
// backward with sinks after a forward without them is refused by name.
#include <doctest/doctest.h>

#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "adversarial/harness.hpp"

using namespace seqpar;
using test::contains;

namespace {

using S = Strategy<partition::Zigzag, comm::Ring>;
using Attn = DistributedAttention<S, attention::Reference<double>>;

// Inputs of one layer: every rank draws the global tensors from `seed` and keeps its own rows.
void fill_rows(Attn& attn, const DocumentBatch& batch, const AttentionShape& shape, int rank, std::uint64_t seed,
               AttentionTensors<double>& l) {
  test::Global g(batch.total_tokens(), shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  for (auto* t : {&g.q, &g.k, &g.v, &g.dout})
    for (double& x : t->storage) x = normal(rng);
  const ShardPlan& plan = attn.plan(batch);
  train::shard(plan, rank, g.q.view(), l.q.view()), train::shard(plan, rank, g.k.view(), l.k.view());
  train::shard(plan, rank, g.v.view(), l.v.view()), train::shard(plan, rank, g.dout.view(), l.dout.view());
}

constexpr auto kTimeout = std::chrono::seconds(20);
// A refusal reaches every rank at once: well before the transport's timeout.
constexpr auto kPrompt = std::chrono::seconds(10);

}  // namespace

TEST_SUITE("adversarial") {
  TEST_CASE("replicated: two layers called in different orders on two ranks are kMismatch naming the layer") {
    const AttentionShape shape{2, 1, 4};
    const DocumentBatch batch({{10, 6}});
    for (const bool swapped : {true, false}) {
      CAPTURE(swapped);
      std::vector<double> max_error(2, 0.0);
      const test::WorldOutcome w = test::run_world(
          2,
          [&](int rank, auto& t) {
            Attn a(t, shape), b(t, shape);  // two layers, made in the same order on every rank
            AttentionTensors<double> la(a.local_tokens(batch), shape), lb(b.local_tokens(batch), shape);
            fill_rows(a, batch, shape, rank, 1, la);
            fill_rows(b, batch, shape, rank, 2, lb);  // another layer's activations
            Attn& first = swapped && rank == 1 ? b : a;
            Attn& second = swapped && rank == 1 ? a : b;
            AttentionTensors<double>& l1 = &first == &a ? la : lb;
            AttentionTensors<double>& l2 = &first == &a ? lb : la;
            first.forward(batch, l1.q.view(), l1.k.view(), l1.v.view(), l1.o.view(), l1.lse.view());
            second.forward(batch, l2.q.view(), l2.k.view(), l2.v.view(), l2.o.view(), l2.lse.view());
            // In order: each layer's rows are its own (compared with the fp64 reference over the batch).
            for (auto [attn, l, seed] : {std::tuple{&a, &la, 1}, std::tuple{&b, &lb, 2}}) {
              test::Global g(batch.total_tokens(), shape);
              std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
              std::normal_distribution<double> normal;
              for (auto* x : {&g.q, &g.k, &g.v, &g.dout})
                for (double& y : x->storage) y = normal(rng);
              test::reference(batch, shape, g);
              test::Global mine(batch.total_tokens(), shape);
              train::unshard_local(attn->plan(batch), rank, l->o.view(), mine.o.view());
              const auto& owned = attn->owned_ranges(batch);
              for (const Range& r : owned)
                for (std::int64_t i = r.begin; i < r.end; ++i)
                  for (int h = 0; h < shape.heads_q; ++h)
                    for (int d = 0; d < shape.v_dim(); ++d)
                      max_error[static_cast<std::size_t>(rank)] =
                          std::max(max_error[static_cast<std::size_t>(rank)],
                                   std::abs(mine.o.view()(i, h, d) - g.o.view()(i, h, d)));
            }
          },
          kTimeout);
      if (swapped) {
        for (std::size_t r = 0; r < 2; ++r) {
          CAPTURE(w.errors[r]);
          CHECK(w.codes[r] == static_cast<int>(Errc::kMismatch));
          CHECK(contains(w.errors[r], "DistributedAttention: rank "));
          CHECK(contains(w.errors[r],
                         " disagree on the layer (the order this rank made its attention objects on the "
                         "transport, or set_layer's): "));
        }
        CHECK(contains(w.errors[0], "rank 1 and rank 0 disagree on the layer") == true);
        CHECK(contains(w.errors[0], "): 1 vs 0"));  // rank 1 runs its 2nd layer where rank 0 runs its 1st
        CHECK(contains(w.errors[1], "): 0 vs 1"));
        CHECK(w.took < kPrompt);
      } else {
        for (const std::string& e : w.errors) CHECK(e.empty());
        for (double e : max_error) CHECK(e <= 1e-12);  // fp64 reference, fp64 kernel
      }
    }
  }

  TEST_CASE("replicated: ranks running float and bfloat16 storage are kMismatch naming the element type") {
    // The element word holds the significand bits too (core/element_code.hpp): sizes alone would not tell
    // float16 from bfloat16, which CUDA ranks can run side by side (tests/cuda/test_element_code_host.cpp).
    const AttentionShape shape{2, 1, 8};
    const DocumentBatch batch({{10, 6}});
    const auto layer = [&]<class T>(auto& t, T) {
      DistributedAttention<S, attention::CpuFlash<T>> attn(t, shape);
      const std::int64_t n = attn.local_tokens(batch);
      ThdTensor<T> q(n, shape.heads_q, shape.head_dim), k(n, shape.heads_kv, shape.head_dim),
          v(n, shape.heads_kv, shape.head_dim), o(n, shape.heads_q, shape.head_dim);
      LseTensor<float> lse(shape.heads_q, n);
      attn.forward(batch, q.view(), k.view(), v.view(), o.view(), lse.view());
    };
    const test::WorldOutcome w = test::run_world(
        2,
        [&](int rank, auto& t) {
          if (rank == 0)
            layer(t, float{});
          else
            layer(t, attention::bf16{});
        },
        kTimeout);
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(w.errors[r]);
      CHECK(w.codes[r] == static_cast<int>(Errc::kMismatch));
      CHECK(contains(w.errors[r],
                     " disagree on the element type (value bytes, value significand bits, "
                     "accumulation bytes: BBSSAA): "));
    }
    CHECK(contains(w.errors[0], "rank 1 and rank 0 disagree on the element type"));
    CHECK(contains(w.errors[0], "): 20804 vs 42404"));  // rank 1's bf16/float word, then rank 0's float/float
    CHECK(contains(w.errors[1], "): 42404 vs 20804"));
    CHECK(w.took < kPrompt);
    static_assert(element_code<double, double>() == 85308 && element_code<float, float>() == 42404 &&
                  element_code<attention::bf16, float>() == 20804);
  }

  TEST_CASE("replicated: set_layer names the layer when the ranks made their objects in different orders") {
    const AttentionShape shape{2, 1, 4};
    const DocumentBatch batch({{10, 6}});
    const test::WorldOutcome w = test::run_world(
        2,
        [&](int rank, auto& t) {
          // Made in different orders (rank 1 first makes a planning copy it never calls), named explicitly.
          Attn first(t, shape), second(t, shape);
          Attn& layer = rank == 0 ? first : second;
          layer.set_layer(7);
          CHECK(layer.layer() == 7);
          AttentionTensors<double> l(layer.local_tokens(batch), shape);
          fill_rows(layer, batch, shape, rank, 3, l);
          layer.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        },
        kTimeout);
    for (const std::string& e : w.errors) CHECK(e.empty());
  }

  TEST_CASE("replicated: sinks inside o or lse, dsinks inside dq or an input lse, are refused by name on every rank") {
    const AttentionShape shape{2, 1, 4};
    const DocumentBatch batch({{10, 6}});
    // c: 0 sinks inside o; 1 sinks inside lse; 2 dsinks inside dq; 3 dsinks inside the forward's lse;
    //    4 sinks inside dv; 5 dsinks = sinks. Only rank 1 passes the aliased memory.
    const char* const expected[] = {
        "DistributedAttention::forward: o = [0x",       "DistributedAttention::forward: lse = [0x",
        "DistributedAttention::backward: dsinks = [0x", "DistributedAttention::backward: dsinks = [0x",
        "DistributedAttention::backward: dv = [0x",     "DistributedAttention::backward: dsinks = [0x"};
    const char* const overlaps[] = {"overlaps sinks", "overlaps sinks", "overlaps dq",
                                    "overlaps lse",   "overlaps sinks", "overlaps sinks"};
    for (int c = 0; c < 6; ++c) {
      CAPTURE(c);
      const test::WorldOutcome w = test::run_world(
          2,
          [&](int rank, auto& t) {
            Attn attn(t, shape);
            AttentionTensors<double> l(attn.local_tokens(batch), shape);
            fill_rows(attn, batch, shape, rank, 4, l);
            std::vector<double> sinks{0.5, -1.0}, dsinks(2);
            std::span<const double> s = sinks;
            std::span<double> ds = dsinks;
            const bool bad = rank == 1;
            // The aliased memory holds finite values (zeros): only the overlap can refuse it.
            if (bad && c == 0) s = {l.o.view().data, 2};
            if (bad && c == 1) s = {l.lse.view().data, 2};
            attn.forward(batch, AttentionMask::causal(), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(),
                         s);
            if (bad && c == 2) ds = {l.dq.view().data, 2};
            if (bad && c == 3) ds = {l.lse.view().data, 2};
            if (bad && c == 4) s = {l.dv.view().data, 2};
            if (bad && c == 5) ds = {sinks.data(), 2};
            attn.backward(batch, AttentionMask::causal(), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(),
                          l.dout.view(), l.dq.view(), l.dk.view(), l.dv.view(), s, ds);
          },
          kTimeout);
      CAPTURE(w.errors[1]);
      CHECK(w.invalid[1]);
      CHECK(contains(w.errors[1], expected[c]));
      CHECK(contains(w.errors[1], overlaps[c]));
      CHECK(w.codes[0] == static_cast<int>(Errc::kPeerFailed));
      CHECK(
          contains(w.errors[0], "rank 1 refused its arguments before any communication: " + std::string(expected[c])));
      CHECK(w.took < kPrompt);
    }
  }

  TEST_CASE("replicated: sinks on forward only is exact (frozen sinks); on backward only is refused by name") {
    const AttentionShape shape{2, 1, 4};
    const DocumentBatch batch({{10, 6}});
    const std::vector<double> sinks{0.5, 2.0};
    std::vector<double> max_difference(2, -1.0);
    const test::WorldOutcome frozen = test::run_world(
        2,
        [&](int rank, auto& t) {
          Attn attn(t, shape);
          AttentionTensors<double> l(attn.local_tokens(batch), shape), with(attn.local_tokens(batch), shape);
          fill_rows(attn, batch, shape, rank, 5, l);
          std::vector<double> dsinks(2);
          attn.forward(batch, AttentionMask::causal(), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(),
                       sinks);
          // The backward with the sinks (its dq, dk, dv are checked against an fp64 oracle written from
          // the definition in strategy/test_sinks.cpp), then the one without: the same dq, dk, dv.
          attn.backward(batch, AttentionMask::causal(), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(),
                        l.dout.view(), with.dq.view(), with.dk.view(), with.dv.view(), sinks, dsinks);
          attn.backward(batch, AttentionMask::causal(), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(),
                        l.dout.view(), l.dq.view(), l.dk.view(), l.dv.view());
          double m = 0.0;
          for (auto [x, y] : {std::pair{&l.dq, &with.dq}, {&l.dk, &with.dk}, {&l.dv, &with.dv}})
            for (std::size_t i = 0; i < x->storage.size(); ++i)
              m = std::max(m, std::abs(x->storage[i] - y->storage[i]));
          max_difference[static_cast<std::size_t>(rank)] = m;
        },
        kTimeout);
    for (const std::string& e : frozen.errors) CHECK(e.empty());
    for (double m : max_difference) CHECK(m == 0.0);  // the same kernel calls on the same O and LSE

    const test::WorldOutcome refused = test::run_world(
        2,
        [&](int rank, auto& t) {
          Attn attn(t, shape);
          AttentionTensors<double> l(attn.local_tokens(batch), shape);
          fill_rows(attn, batch, shape, rank, 6, l);
          std::vector<double> dsinks(2);
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
          attn.backward(batch, AttentionMask::causal(), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(),
                        l.dout.view(), l.dq.view(), l.dk.view(), l.dv.view(), sinks, dsinks);
        },
        kTimeout);
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(refused.errors[r]);
      CHECK(refused.invalid[r]);
      CHECK(contains(refused.errors[r],
                     "DistributedAttention::backward: sinks = given: backward with attention sinks, but every forward "
                     "of this batch under "));
      CHECK(contains(refused.errors[r], "dsinks would be the gradient of a softmax that never ran"));
    }
    CHECK(refused.took < kPrompt);
  }
}

TEST_SUITE("adversarial") {
  TEST_CASE("messages: rows that do not match name the batch they were expected from and the one they fit") {
    const AttentionShape shape{2, 1, 4};
    using Even = DistributedAttention<Strategy<partition::Uniform, comm::Ring>, attention::Reference<double>>;
    const DocumentBatch laid({{10, 6}}), called({{12, 6}});  // 8 and 9 rows per rank (Uniform, 2 ranks)
    for (const bool known : {true, false}) {
      CAPTURE(known);
      const test::WorldOutcome w = test::run_world(
          2,
          [&](int, auto& t) {
            Even attn(t, shape);
            AttentionTensors<double> l(attn.local_tokens(laid), shape);  // places `laid` (this object knows it)
            if (known) {
              attn.forward(called, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
            } else {
              AttentionTensors<double> m(l.q.tokens - 1, shape);
              attn.forward(called, m.q.view(), m.k.view(), m.v.view(), m.o.view(), m.lse.view());
            }
          },
          kTimeout);
      for (int r = 0; r < 2; ++r) {
        const std::string& e = w.errors[static_cast<std::size_t>(r)];
        CAPTURE(e);
        CHECK(w.invalid[static_cast<std::size_t>(r)]);
        const std::string rows = known ? "8" : "7";
        CHECK(contains(e, "DistributedAttention::forward: q.tokens = " + rows + ": expected 9, the rows rank " +
                              std::to_string(r) + " holds of this call's batch (fingerprint " +
                              std::to_string(called.fingerprint()) +
                              ": 18 tokens in 2 documents) as this strategy places it on 2 ranks; "));
        if (known)
          CHECK(contains(e, "8 is what this rank holds of another batch this object placed (fingerprint " +
                                std::to_string(laid.fingerprint()) +
                                ": 16 tokens in 2 documents): rows laid out for that batch? Pass the batch the rows "
                                "were taken for (owned_ranges(batch))"));
        else
          CHECK(contains(e,
                         "no batch this object placed gives this rank 7 rows: rows of another batch, strategy or "
                         "world size, or not taken with owned_ranges(batch)"));
      }
      CHECK(w.took < kPrompt);
    }
  }
}

TEST_SUITE("adversarial") {
  TEST_CASE(
      "chunks: ChunkedAttention::begin(batch, ...) refuses another batch's chunks and prefixes cut for another mask") {
    const AttentionShape shape{2, 1, 4};
    const DocumentBatch batch({{30, 10}}), other({{10, 30}});  // the same 40 tokens, documents swapped
    const schedule::ChunkPlan plan =
        schedule::DynamicChunk{{.token_capacity = 12, .time_target = 0, .slices = 0, .cost = {}}}.plan(batch);
    std::vector<Chunk> cut = plan.chunks;  // prefixes cut to what a window of 4 keys sees
    bool shorter = false;
    for (Chunk& c : cut)
      for (Range& p : c.prefix) {
        const Range seen = visible_prefix(p, 4);
        shorter = shorter || seen.size() < p.size();
        p = seen;
      }
    REQUIRE(shorter);
    // c: 0 this batch's chunks (causal); 1 the window's cut chunks under their window; 2 another batch's
    //    chunks; 3 the cut chunks under a causal layer. Only rank 1 errs in 2 and 3.
    for (int c = 0; c < 4; ++c) {
      CAPTURE(c);
      const test::WorldOutcome w = test::run_world(
          2,
          [&](int rank, auto& t) {
            Attn attn(t, shape);
            runtime::ChunkedAttention<attention::Reference<double>> chunked(attn);
            const bool bad = rank == 1;
            if (c == 0) chunked.begin(batch, plan.chunks);
            if (c == 1) chunked.begin(batch, cut, AttentionMask::sliding_window(4));
            if (c == 2) chunked.begin(bad ? other : batch, plan.chunks);
            if (c == 3) chunked.begin(batch, bad ? cut : plan.chunks);
          },
          kTimeout);
      if (c < 2) {
        for (const std::string& e : w.errors) CHECK(e.empty());
        continue;
      }
      CAPTURE(w.errors[1]);
      CHECK(w.invalid[1]);
      CHECK(contains(w.errors[1], "ChunkedAttention::begin: chunks["));
      // Another batch's chunks: a piece crosses one of this batch's document ends, or starts inside a
      // document without its prefix (whichever chunk comes first); the cut prefixes miss causal keys.
      if (c == 2)
        CHECK(contains(w.errors[1], "(the chunks of another batch, of fingerprint other than this batch's " +
                                        std::to_string(other.fingerprint()) + "? or prefixes cut for another mask"));
      else
        CHECK((contains(w.errors[1], "].prefix[") && contains(w.errors[1], "must read the keys ") &&
               contains(w.errors[1], "this layer's causal?)")));
      CHECK(w.codes[0] == static_cast<int>(Errc::kPeerFailed));
      CHECK(contains(w.errors[0], "rank 1 refused its chunks before any communication: ChunkedAttention::begin: "));
      CHECK(w.took < kPrompt);
    }
  }
}
