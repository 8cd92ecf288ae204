// SPDX-License-Identifier: Apache-2.0
// Sliding windows through DPP's chunked attention (schedule::DynamicChunk, runtime::ChunkedAttention,
// comm::ChunkCarry): the chunks are cut once per batch for every layer (a prefix is the whole of its
// document before the piece), and each layer's carry cuts the prefixes to its mask (the w - 1 tokens
// before the piece under a window of w); chunk-by-chunk attention under a window equals the fp64
// reference over the whole batch under that window (every partitioner x communicator, 1..6 ranks,
// forward and backward; CpuFlash in float at its tolerance), with windows of one key, shorter than a
// chunk, longer than a chunk and longer than every document; and the carry bounded by the window.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

// Every sequence holds a long document (one to four capacities: split 2+ ways) among lognormal short
// ones, so that chunks are split, hybrid and batched alike.
DocumentBatch split_heavy_batch(int sequences, std::int64_t capacity, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    std::vector<std::int64_t> docs = test::lognormal_docs(15 + static_cast<std::int64_t>(rng() % 20), 5.0, 1.0, rng);
    docs.push_back(capacity + static_cast<std::int64_t>(rng() % static_cast<unsigned>(3 * capacity)));
    std::shuffle(docs.begin(), docs.end(), rng);
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

std::int64_t longest(const DocumentBatch& b) {
  std::int64_t n = 0;
  for (const Document& d : b.documents()) n = std::max(n, d.tokens.size());
  return n;
}

// One key; shorter than a chunk; longer than a chunk (a prefix then spans several earlier chunks);
// longer than every document (no pair is cut, the prefixes stay whole).
std::vector<std::int64_t> windows_for(std::int64_t capacity, const DocumentBatch& b) {
  return {1, 4, capacity + capacity / 2, longest(b) + 3};
}

// DynamicChunk's plan with its cost model for a model of `mask` layers (the chunks themselves serve any mask).
schedule::ChunkPlan plan_of(const DocumentBatch& batch, std::int64_t capacity, int slices, AttentionMask mask = {}) {
  schedule::DynamicChunk sched;
  sched.args.token_capacity = capacity;
  sched.args.slices = slices;
  sched.args.cost.masks = MaskMix::only(mask);
  try {  // the longest document may need more slices than asked to fit the capacity
    return sched.plan(batch);
  } catch (const std::invalid_argument&) {
    sched.args.slices = 0;
    return sched.plan(batch);
  }
}

// Chunk forwards in order then backwards in reverse (even worlds), or the first stage's 1F1B order of a
// 3-stage pipeline, split documents backward last slice first (odd worlds).
std::vector<schedule::StageOp> order_for(const schedule::ChunkPlan& plan, int world) {
  if (world % 2 == 0) return test::forward_then_backward(plan.chunks.size());
  std::vector<int> all(plan.chunks.size());
  std::iota(all.begin(), all.end(), 0);
  return schedule::one_f_one_b(schedule::backward_order(plan, all), 3)[0];
}

// The carry of `plan` under `mask` as one strategy's placement of every chunk on `world` ranks places it
// (what ChunkedAttention::begin compiles on every rank).
template <class S>
comm::ChunkCarry carry_of(const schedule::ChunkPlan& plan, const AttentionShape& shape, int world,
                          const typename S::Arguments& args, AttentionMask mask = {}) {
  std::vector<std::vector<std::vector<Range>>> owned;
  for (const Chunk& ch : plan.chunks) {
    const auto planned = S::plan(args, ch.batch, shape, Topology{world, world});
    REQUIRE(planned.status.ok);
    owned.emplace_back();
    for (int r = 0; r < world; ++r)
      owned.back().push_back(comm::ChunkCarry::to_global(ch, planned.plan.owned[static_cast<std::size_t>(r)]));
  }
  return comm::ChunkCarry(plan.chunks, std::move(owned), shape, mask);
}

// Rows of the carry over all ranks, and the pieces that have a prefix.
std::int64_t total_carry_rows(const comm::ChunkCarry& carry) {
  std::int64_t n = 0;
  for (int r = 0; r < carry.world_size(); ++r) n += carry.carry_rows(r);
  return n;
}

}  // namespace

TEST_SUITE("schedule") {
  TEST_CASE("ChunkCost with a window: the windowed pairs, and position_of inverts the cost exactly") {
    for (const std::int64_t w : {1, 3, 10, 1000})
      for (const double per_token : {0.0, 5.0}) {
        CAPTURE(w);
        CAPTURE(per_token);
        const schedule::ChunkCost cost{per_token, 1.0, MaskMix::only(AttentionMask{w})};
        for (std::int64_t a = 0; a < 60; a += 7)
          for (std::int64_t b = a; b <= 60; ++b)
            CHECK(schedule::ChunkCost::pairs(a, b, w) ==
                  static_cast<double>(document_area(b, w) - document_area(a, w)));
        for (const double target : {0.5, 3.0, 17.0, 100.0, 900.0, 5000.0, 1e9}) {
          std::int64_t want = 0;  // the first x with of(0, x) >= target, by walking
          while (want < 200 && cost.of(0, want) < target) ++want;
          CHECK(cost.position_of(target, 200) == want);
        }
      }
    // A mix of full and window layers: the layer-weighted mean of the two costs, inverted exactly too.
    const schedule::ChunkCost mixed{2.0, 1.0, {{AttentionMask::causal(), 3}, {AttentionMask{7}, 1}}};
    for (std::int64_t a = 0; a < 40; a += 5)
      for (std::int64_t b = a; b <= 40; ++b)
        CHECK(mixed.of(a, b) ==
              doctest::Approx(2.0 * static_cast<double>(b - a) +
                              (3.0 * schedule::ChunkCost::pairs(a, b) + schedule::ChunkCost::pairs(a, b, 7)) / 4.0));
    for (const double target : {0.5, 30.0, 400.0}) {
      std::int64_t want = 0;
      while (want < 100 && mixed.of(0, want) < target) ++want;
      CHECK(mixed.position_of(target, 100) == want);
    }
    schedule::DynamicChunk bad{{.token_capacity = 8}};
    bad.args.cost.masks = {{AttentionMask{-2}, 1}};
    try {
      (void)bad.plan(DocumentBatch({{20}}));
      FAIL("a negative cost window was accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("args.cost.masks[0].mask.window = -2") != std::string::npos);
    }
  }

  TEST_CASE("DynamicChunk for a window model: a prefix is the whole document before its piece, the carry cuts it") {
    const DocumentBatch batch = split_heavy_batch(3, 32, 5);
    bool spans_chunks = false;
    for (std::int64_t w : windows_for(32, batch)) {
      CAPTURE(w);
      const AttentionMask mask{w};
      const schedule::ChunkPlan plan = plan_of(batch, 32, 4, mask);
      // The cost model counts the windowed pairs: the mesh's slices cost the same under the window.
      const schedule::ChunkCost cost{0.0, 1.0, MaskMix::only(mask)};
      const comm::ChunkCarry carry = carry_of<Strategy<partition::Zigzag, comm::Ring>>(plan, {2, 2, 8}, 2, {}, mask);
      const double slice_cost = cost.of(0, plan.mesh.back()) / static_cast<double>(plan.mesh.size());
      std::vector<int> seen(static_cast<std::size_t>(batch.total_tokens()), 0);
      std::int64_t area = 0;
      for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
        const Chunk& ch = plan.chunks[c];
        CHECK(ch.batch.total_tokens() <= 32);
        double chunk_cost = 0;
        for (std::size_t i = 0; i < ch.tokens.size(); ++i) {
          const schedule::ChunkPiece& p = plan.pieces[c][i];
          chunk_cost += cost.of(p.begin, p.end);
          if (ch.kind == schedule::ChunkKind::kSplit)  // equal cost up to one token's worth
            CHECK(std::abs(cost.of(p.begin, p.end) - slice_cost) <= cost.of(p.end - 1, p.end + 1) + 1e-9);
          for (std::int64_t t = ch.tokens[i].begin; t < ch.tokens[i].end; ++t) ++seen[static_cast<std::size_t>(t)];
          const Document& d = batch.documents()[static_cast<std::size_t>(plan.pieces[c][i].document)];
          const std::int64_t begin = ch.tokens[i].begin;
          CHECK(ch.prefix[i] == Range{d.tokens.begin, begin});  // whole: the chunks serve every layer
          const Range kept = carry.prefix(static_cast<int>(c), i);
          CHECK(kept == Range{std::max(d.tokens.begin, begin - (w - 1)), begin});  // this layer's cut
          CHECK(kept.size() <= w - 1);
          // The piece's own pairs under the window plus the pairs of its rows with the prefix keys: the
          // document's windowed pairs of those rows, so the chunks cover the batch's attention exactly.
          const std::int64_t a = begin - d.tokens.begin, b = ch.tokens[i].end - d.tokens.begin;
          const std::int64_t pre = kept.size();
          area += AttnSlice{{0, b - a}, {0, b - a}, Mask::sliding_window(w)}.area() +
                  AttnSlice{{0, b - a}, {0, pre}, Mask::sliding_window(w, pre)}.area();
          CHECK(document_area(b, w) - document_area(a, w) ==
                AttnSlice{{0, b - a}, {0, b - a}, Mask::sliding_window(w)}.area() +
                    AttnSlice{{0, b - a}, {0, pre}, Mask::sliding_window(w, pre)}.area());
        }
        CHECK(ch.cost == doctest::Approx(chunk_cost).epsilon(1e-12));
      }
      for (int x : seen) CHECK(x == 1);
      CHECK(area == batch.attention_area(mask));
      for (int c = 0; c < carry.num_chunks(); ++c) spans_chunks = spans_chunks || carry.reads(c).size() >= 2;
      if (w == 1)
        for (int c = 0; c < carry.num_chunks(); ++c) CHECK_FALSE(carry.has_prefix(c));  // one key: its own
    }
    CHECK(spans_chunks);  // a window longer than a chunk reads several earlier chunks
  }

  TEST_CASE(
      "ChunkedAttention with a sliding window equals windowed attention over the whole batch (fp64, 1..6 ranks)") {
    int runs = 0;
    std::uint64_t prefix_bytes = 0;
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      typename S::Arguments args = C::arguments();
      for (int world : {1, 2, 3, 4, 6}) {
        const std::int64_t cap = 20 + 4 * world;
        const DocumentBatch plain = split_heavy_batch(1 + world % 2, cap, 13u * static_cast<unsigned>(world) + 1u);
        const AttentionShape shape = world % 2 == 0 ? AttentionShape{4, 2, 8} : AttentionShape{2, 2, 8};
        args.ranks_per_node = world >= 4 ? world / 2 : world;
        for (std::int64_t w : windows_for(cap, plain)) {
          const test::MaskedBatch batch = test::windowed(plain, w);
          const schedule::ChunkPlan plan =
              plan_of(plain, cap, 2 + (world + static_cast<int>(C::name().size())) % 4, batch.mask);
          bool ok = true;
          for (const auto& ch : plan.chunks)
            ok = ok && S::can_implement(args, ch.batch, shape, Topology{world, args.ranks_per_node}).ok;
          if (!ok) continue;  // refusals are the strategy tests' business
          INFO(C::name() << ": world " << world << ", window " << w << ", " << plan.chunks.size() << " chunks");
          const auto err = test::distributed_check<attention::Reference<double>>(
              batch, plan.chunks, order_for(plan, world), shape, world,
              [&](backend::inproc::Transport& t)
                  -> std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>> {
                return std::make_unique<DistributedAttention<S, attention::Reference<double>>>(t, shape, args);
              },
              17u * static_cast<unsigned>(world) + static_cast<unsigned>(w));
          CHECK(err.max() < 1e-9);  // o, lse, dq, dk, dv
          CHECK(err.bytes_match);   // each call's counted bytes equal what its prefix program declares
          if (w == 1) CHECK(err.bytes_forward + err.bytes_backward == 0);  // nothing to carry
          prefix_bytes += err.bytes_forward + err.bytes_backward;
          ++runs;
        }
      }
    });
    CHECK(runs > 200);
    CHECK(prefix_bytes > 0);
  }

  TEST_CASE("ChunkedAttention with a sliding window: CpuFlash in float within its tolerance") {
    using Kernel = attention::CpuFlash<float>;
    for (int world : {1, 2, 4}) {
      const std::int64_t cap = 48;
      const DocumentBatch plain = split_heavy_batch(2, cap, 29u + static_cast<unsigned>(world));
      const AttentionShape shape{4, 2, 16};
      for (std::int64_t w : windows_for(cap, plain)) {
        const test::MaskedBatch batch = test::windowed(plain, w);
        const schedule::ChunkPlan plan = plan_of(plain, cap, 3, batch.mask);
        const auto run = [&]<class S>(std::type_identity<S>, typename S::Arguments args) {
          INFO("world " << world << ", window " << w);
          const auto err = test::distributed_check<Kernel>(
              batch, plan.chunks, order_for(plan, world), shape, world,
              [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
                return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args, Kernel({.threads = 1}));
              },
              31u + static_cast<unsigned>(w));
          CHECK(err.max() < 1e-4);  // fp32 accumulation against fp64 on float-rounded inputs (as the strategy tests)
          CHECK(err.bytes_match);
        };
        using Zr = Strategy<partition::Zigzag, comm::Ring>;
        Zr::Arguments aware;
        aware.comm.sharding_aware = true;
        run(std::type_identity<Zr>{}, aware);
        run(std::type_identity<Strategy<partition::Uniform, comm::AllToAll>>{}, {});
      }
    }
  }

  TEST_CASE("ChunkCarry with a window: at most w - 1 rows per piece kept and fetched, fewer bytes than without") {
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch plain = split_heavy_batch(2, 40, 3);
    for (int world : {1, 2, 4}) {
      const comm::ChunkCarry full = carry_of<S>(plan_of(plain, 40, 4), shape, world, {});
      for (std::int64_t w : {2, 5, 9}) {
        CAPTURE(world);
        CAPTURE(w);
        const schedule::ChunkPlan plan = plan_of(plain, 40, 4, AttentionMask{w});
        const comm::ChunkCarry carry = carry_of<S>(plan, shape, world, {}, AttentionMask{w});
        std::int64_t pieces = 0;  // pieces with a prefix: each reads at most w - 1 keys
        for (int c = 0; c < carry.num_chunks(); ++c)
          for (std::size_t i = 0; i < plan.chunks[static_cast<std::size_t>(c)].tokens.size(); ++i)
            if (!carry.prefix(c, i).empty()) ++pieces;
        REQUIRE(pieces > 0);
        CHECK(total_carry_rows(carry) <= pieces * (w - 1));
        CHECK(total_carry_rows(carry) < total_carry_rows(full));
        // The carry's buffers follow: K, V, dK, dV of its rows (every head of the group, each head_dim wide).
        for (int r = 0; r < world; ++r) {
          CHECK(carry.carry_rows(r) <= full.carry_rows(r));
          for (int c = 0; c < carry.num_chunks(); ++c) {
            const comm::Program fwd = carry.forward(c, r, true);
            std::int64_t fetched = 0;
            for (const comm::BufferSpec& b : fwd.staging)
              if (b.id == comm::BufferId::kKPrefix) fetched += b.rows;
            std::int64_t own = 0;  // pieces of chunk c with a prefix
            for (std::size_t i = 0; i < plan.chunks[static_cast<std::size_t>(c)].tokens.size(); ++i)
              own += carry.prefix(c, i).empty() ? 0 : 1;
            CHECK(fetched <= own * (w - 1));
            CHECK(fwd.bytes_sent(sizeof(double), sizeof(double)) <=
                  full.forward(c, r, true).bytes_sent(sizeof(double), sizeof(double)));
          }
        }
      }
    }
  }

  TEST_CASE("ChunkedAttention with a window moves fewer carry bytes than without, both exact") {
    // Uniform rows: a chunk's first rows (which read the prefix) and the previous chunk's last rows (the
    // prefix) sit on different ranks, so the prefix moves (Zigzag keeps both on rank 0).
    using S = Strategy<partition::Uniform, comm::Ring>;
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch plain = split_heavy_batch(2, 40, 3);
    const auto run = [&](const test::MaskedBatch& batch) {
      const schedule::ChunkPlan plan = plan_of(batch.batch, 40, 4, batch.mask);
      return test::distributed_check<attention::Reference<double>>(
          batch, plan.chunks, order_for(plan, 2), shape, 2,
          [&](backend::inproc::Transport& t)
              -> std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>> {
            return std::make_unique<DistributedAttention<S, attention::Reference<double>>>(t, shape, S::Arguments{});
          },
          9);
    };
    const test::Errors full = run(plain), windowed = run(test::windowed(plain, 5));
    CHECK(full.max() < 1e-9);
    CHECK(windowed.max() < 1e-9);
    CHECK(windowed.bytes_match);
    CHECK(windowed.bytes_forward > 0);
    CHECK(windowed.bytes_forward < full.bytes_forward);
    CHECK(windowed.bytes_backward < full.bytes_backward);
  }

  TEST_CASE("ChunkedAttention with a window: a prefix cut by hand to the window carries what the whole one does") {
    // DynamicChunk's prefixes are whole (the chunks serve every layer); chunks made by hand may name only
    // the w - 1 keys a query can see. The carry keeps the same rows either way, and both are exact.
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const AttentionShape shape{2, 2, 8};
    const DocumentBatch plain = split_heavy_batch(2, 30, 41);
    for (const std::int64_t w : {3, 45}) {
      CAPTURE(w);
      const AttentionMask mask{w};
      const schedule::ChunkPlan whole = plan_of(plain, 30, 4, mask);
      schedule::ChunkPlan cut = whole;
      int shorter = 0;
      for (std::size_t c = 0; c < cut.chunks.size(); ++c)
        for (std::size_t i = 0; i < cut.chunks[c].tokens.size(); ++i) {
          cut.chunks[c].prefix[i] = visible_prefix(whole.chunks[c].prefix[i], w);
          shorter += cut.chunks[c].prefix[i] == whole.chunks[c].prefix[i] ? 0 : 1;
        }
      if (w == 3) REQUIRE(shorter > 0);
      for (int world : {1, 3}) {
        CAPTURE(world);
        const comm::ChunkCarry a = carry_of<S>(cut, shape, world, {}, mask),
                               b = carry_of<S>(whole, shape, world, {}, mask);
        for (int r = 0; r < world; ++r) CHECK(a.carry_rows(r) == b.carry_rows(r));
        const auto err = test::distributed_check<attention::Reference<double>>(
            {plain, mask}, cut.chunks, order_for(cut, world), shape, world,
            [&](backend::inproc::Transport& t)
                -> std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>> {
              return std::make_unique<DistributedAttention<S, attention::Reference<double>>>(t, shape, S::Arguments{});
            },
            5);
        CHECK(err.max() < 1e-9);
        CHECK(err.bytes_match);
      }
    }
  }

  TEST_CASE("ChunkedAttention::begin recompiles when only the mask changes (same chunks)") {
    // The same chunks under another mask are other programs: begin must compile again, and equal a fresh
    // object's compile of that mask.
    using S = Strategy<partition::Zigzag, comm::Ring>;
    using K = attention::Reference<double>;
    const AttentionShape shape{2, 2, 8};
    const DocumentBatch plain = split_heavy_batch(1, 30, 43);
    const std::vector<Chunk> chunks = plan_of(plain, 30, 4).chunks;
    const AttentionMask window{4};
    backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, K> attn(t, shape);
      runtime::ChunkedAttention<K> reused(attn), fresh(attn);
      reused.begin(chunks);
      const std::int64_t full_rows = reused.carry_rows();
      reused.begin(chunks, window);
      fresh.begin(chunks, window);
      CHECK(reused.carry().window() == 4);
      CHECK(reused.mask() == window);
      CHECK(reused.carry_rows() == fresh.carry_rows());
      CHECK(reused.carry_rows() <= full_rows);
      for (int c = 0; c < reused.num_chunks(); ++c)
        CHECK(reused.program(c, 0).bytes_sent(8, 8) == fresh.program(c, 0).bytes_sent(8, 8));
    });
  }

  TEST_CASE("ChunkedAttention::begin refuses a negative window by name on every rank") {
    using S = Strategy<partition::Zigzag, comm::Ring>;
    using K = attention::Reference<double>;
    const std::vector<Chunk> chunks = plan_of(DocumentBatch({{30, 10}}), 16, 0).chunks;
    std::vector<std::string> errors(2);
    backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, K> attn(t, {2, 2, 8});
      runtime::ChunkedAttention<K> chunked(attn);
      try {
        chunked.begin(chunks, AttentionMask{t.rank() == 0 ? -7 : 0});
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(t.rank())] = e.what();
      }
    });
    CHECK(errors[0].find("mask.window = -7") != std::string::npos);
    CHECK(errors[1].find("rank 0 refused") != std::string::npos);
  }
}
