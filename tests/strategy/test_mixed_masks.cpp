// SPDX-License-Identifier: Apache-2.0
// Placement once per batch, masks per call: a model whose layers alternate sliding-window and full
// attention (gpt-oss's pattern: a window on every other layer, attention sinks on every layer) keeps one
// set of rows per rank for the whole model, on every partitioner x communicator, unchunked and through
// DPP's chunks; every layer's forward and backward equals the fp64 reference of that layer's own mask.
// And the property behind it: the placement of a batch is the same whatever masks its calls use.
#include <doctest/doctest.h>

#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

constexpr double kModelTolerance = 1e-9;
using Ref = attention::Reference<double>;
using Storage = test::HostStorage;

// Layer l of the model: a window of `window` keys on odd layers, full (causal) attention on even ones.
AttentionMask mask_of_layer(int l, std::int64_t window) {
  return l % 2 == 1 ? AttentionMask::sliding_window(window) : AttentionMask::causal();
}

std::vector<double> sinks_for(int heads, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.5);
  std::vector<double> s(static_cast<std::size_t>(heads));
  for (double& x : s) x = u(rng);
  return s;
}

// Two sequences: lognormal short documents and one document longer than the window, so that the window
// binds and every partitioner cuts something.
DocumentBatch model_batch(std::int64_t window, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::int64_t> first = test::lognormal_docs(90, 8.0, 1.0, rng);
  first.push_back(window + 40 + static_cast<std::int64_t>(rng() % 40));
  std::shuffle(first.begin(), first.end(), rng);
  return DocumentBatch({first, test::lognormal_docs(70, 12.0, 1.0, rng)});
}

struct ModelErrors {
  std::vector<test::Errors> layers;  // one per layer
  bool rows_fixed = true;            // every layer's plan had the placement's rows, on every rank
  [[nodiscard]] double max() const {
    double m = 0;
    for (const test::Errors& e : layers) m = std::max(m, e.max());
    return m;
  }
};

// The whole model on `world` ranks: one DistributedAttention for every layer; each rank lays its rows out
// once, by owned_ranges(batch), and runs every layer's forward (in order) then backward (in reverse) on
// them with the layer's mask and sinks; every layer against the fp64 reference of its own mask.
template <class S>
ModelErrors run_model(const DocumentBatch& batch, const AttentionShape& shape, int world, typename S::Arguments args,
                      int layers, std::int64_t window, unsigned seed) {
  std::vector<std::unique_ptr<test::detail::WholeBatch>> whole;
  for (int l = 0; l < layers; ++l)
    whole.push_back(std::make_unique<test::detail::WholeBatch>(
        batch, mask_of_layer(l, window), shape, seed + static_cast<unsigned>(l), std::type_identity<Storage>{},
        std::type_identity<double>{}, sinks_for(shape.heads_q, seed + 100u * static_cast<unsigned>(l))));
  ModelErrors out;
  out.layers.resize(static_cast<std::size_t>(layers));
  std::mutex mu;
  Storage::run(world, [&](backend::inproc::Transport& t) {
    DistributedAttention<S, Ref> attn(t, shape, args);
    const std::vector<Range> owned = attn.owned_ranges(batch);  // the model's rows, for every layer
    const std::int64_t n = attn.local_tokens(batch);
    const HostExec& exec = attn.exec();
    std::vector<std::unique_ptr<test::detail::Shard<Ref, Storage>>> shard;
    std::vector<std::unique_ptr<test::detail::SinkBuffers<double, Storage>>> sinks;
    bool rows_fixed = true;
    const int hq = shape.heads_q, hkv = shape.heads_kv;
    for (int l = 0; l < layers; ++l) {
      const AttentionMask mask = mask_of_layer(l, window);
      rows_fixed = rows_fixed && attn.plan(batch, mask).owned[static_cast<std::size_t>(t.rank())] == owned;
      shard.push_back(
          std::make_unique<test::detail::Shard<Ref, Storage>>(*whole[static_cast<std::size_t>(l)], owned, n, exec));
      sinks.push_back(std::make_unique<test::detail::SinkBuffers<double, Storage>>(
          whole[static_cast<std::size_t>(l)]->sinks, exec));
      auto& s = *shard.back();
      attn.forward(batch, mask, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq), s.lse_view(),
                   sinks.back()->logits());
    }
    for (int l = layers - 1; l >= 0; --l) {
      auto& s = *shard[static_cast<std::size_t>(l)];
      auto& sk = *sinks[static_cast<std::size_t>(l)];
      attn.backward(batch, mask_of_layer(l, window), s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv),
                    s.view(s.o, hq), LseView<const double>(s.lse_view()), s.view(s.dout, hq), s.view(s.dq, hq),
                    s.view(s.dk, hkv), s.view(s.dv, hkv), sk.logits(), sk.grad());
    }
    rows_fixed = rows_fixed && attn.owned_ranges(batch) == owned;
    const std::lock_guard lock(mu);
    out.rows_fixed = out.rows_fixed && rows_fixed;
    for (int l = 0; l < layers; ++l) {
      shard[static_cast<std::size_t>(l)]->scatter(owned, *whole[static_cast<std::size_t>(l)]);
      whole[static_cast<std::size_t>(l)]->dsinks.push_back(sinks[static_cast<std::size_t>(l)]->gradient());
    }
  });
  for (int l = 0; l < layers; ++l) whole[static_cast<std::size_t>(l)]->errors(out.layers[static_cast<std::size_t>(l)]);
  return out;
}

// The same model through DPP's chunks: one DistributedAttention, one ChunkedAttention per layer over the
// same chunks (begin with the layer's mask); every layer's rows of each chunk are the same.
template <class S>
ModelErrors run_chunked_model(const DocumentBatch& batch, const std::vector<Chunk>& chunks, const AttentionShape& shape,
                              int world, typename S::Arguments args, int layers, std::int64_t window, unsigned seed) {
  std::vector<std::unique_ptr<test::detail::WholeBatch>> whole;
  for (int l = 0; l < layers; ++l)
    whole.push_back(std::make_unique<test::detail::WholeBatch>(
        batch, mask_of_layer(l, window), shape, seed + static_cast<unsigned>(l), std::type_identity<Storage>{},
        std::type_identity<double>{}));
  ModelErrors out;
  out.layers.resize(static_cast<std::size_t>(layers));
  std::mutex mu;
  Storage::run(world, [&](backend::inproc::Transport& t) {
    DistributedAttention<S, Ref> attn(t, shape, args);
    std::vector<std::unique_ptr<runtime::ChunkedAttention<Ref>>> chunked;
    bool rows_fixed = true;
    for (int l = 0; l < layers; ++l) {
      chunked.push_back(std::make_unique<runtime::ChunkedAttention<Ref>>(attn));
      chunked.back()->begin(chunks, mask_of_layer(l, window));
      for (int c = 0; c < chunked.back()->num_chunks(); ++c)
        rows_fixed = rows_fixed && chunked.back()->owned_global(c) == chunked.front()->owned_global(c);
    }
    const int nc = chunked.front()->num_chunks(), hq = shape.heads_q, hkv = shape.heads_kv;
    // shard[l][c]: layer l's rows of chunk c.
    std::vector<std::vector<std::unique_ptr<test::detail::Shard<Ref, Storage>>>> shard(
        static_cast<std::size_t>(layers));
    for (int c = 0; c < nc; ++c)  // every chunk through every layer, then backward in reverse
      for (int l = 0; l < layers; ++l) {
        auto& ca = *chunked[static_cast<std::size_t>(l)];
        auto& s = *shard[static_cast<std::size_t>(l)].emplace_back(std::make_unique<test::detail::Shard<Ref, Storage>>(
            *whole[static_cast<std::size_t>(l)], ca.owned_global(c), ca.local_tokens(c), attn.exec()));
        ca.forward(c, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq), s.lse_view());
      }
    for (int c = nc - 1; c >= 0; --c)
      for (int l = layers - 1; l >= 0; --l) {
        auto& ca = *chunked[static_cast<std::size_t>(l)];
        auto& s = *shard[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)];
        ca.backward(c, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq),
                    LseView<const double>(s.lse_view()), s.view(s.dout, hq), s.view(s.dq, hq), s.view(s.dk, hkv),
                    s.view(s.dv, hkv));
      }
    const std::lock_guard lock(mu);
    out.rows_fixed = out.rows_fixed && rows_fixed;
    for (int l = 0; l < layers; ++l)
      for (int c = 0; c < nc; ++c)
        shard[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)]->scatter(
            chunked[static_cast<std::size_t>(l)]->owned_global(c), *whole[static_cast<std::size_t>(l)]);
  });
  for (int l = 0; l < layers; ++l) whole[static_cast<std::size_t>(l)]->errors(out.layers[static_cast<std::size_t>(l)]);
  return out;
}

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("a model alternating window and full layers: one set of rows per rank, every layer exact (all 49)") {
    // gpt-oss's pattern, scaled to the test batches: windows of 16 keys on every other layer, sinks on every
    // layer, the placement balanced for the declared mix {causal: 2, window 16: 2}.
    constexpr std::int64_t kWindow = 16;
    int runs = 0;
    // Worlds 2, 3, 5, 8; under a sanitizer, on strategy_list.hpp's sanitizer sweep.
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      typename S::Arguments args = C::arguments();
      args.masks = {{AttentionMask::causal(), 2}, {AttentionMask::sliding_window(kWindow), 2}};
      for (const int world : {2, 3, 5, 8}) {
        const DocumentBatch batch = model_batch(kWindow, 31u * static_cast<unsigned>(world) + 7u);
        const AttentionShape shape = world == 2 ? AttentionShape{4, 2, 8} : AttentionShape{8, 8, 8};
        args.ranks_per_node = world >= 4 ? world / 2 : world;
        const Topology topo{world, args.ranks_per_node};
        if (!S::can_implement(args, batch, shape, topo).ok ||
            !S::can_implement(args, batch, shape, topo, AttentionMask::sliding_window(kWindow)).ok)
          continue;  // refusals are test_combinations' business
        INFO(C::name() << ": world " << world);
        const ModelErrors e = run_model<S>(batch, shape, world, args, 4, kWindow, 11u + static_cast<unsigned>(world));
        CHECK(e.rows_fixed);
        for (std::size_t l = 0; l < e.layers.size(); ++l) {
          INFO("layer " << l << (l % 2 == 1 ? std::string(" (window)") : std::string(" (full)")));
          CHECK(e.layers[l].max() < kModelTolerance);
        }
        ++runs;
      }
    });
    MESSAGE(runs << " (combination, world) models of 4 layers");
    CHECK(runs >= 150 * static_cast<int>(test::kNumSweptCombinations) / static_cast<int>(test::kNumCombinations));
  }

  TEST_CASE("a model alternating window and full layers through DPP chunks: the same rows per chunk, exact") {
    constexpr std::int64_t kWindow = 12;
    int runs = 0;
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      typename S::Arguments args = C::arguments();
      args.masks = {{AttentionMask::causal(), 1}, {AttentionMask::sliding_window(kWindow), 1}};
      for (const int world : {2, 4}) {
        const DocumentBatch batch = model_batch(kWindow, 53u * static_cast<unsigned>(world) + 3u);
        schedule::DynamicChunk sched{{.token_capacity = 40, .time_target = 0, .slices = 0, .cost = {}}};
        sched.args.cost.masks = args.masks;
        const std::vector<Chunk> chunks = sched.chunks(batch);
        const AttentionShape shape{4, 2, 8};
        args.ranks_per_node = world;
        bool ok = true;
        for (const Chunk& ch : chunks) ok = ok && S::can_implement(args, ch.batch, shape, Topology{world, world}).ok;
        if (!ok) continue;
        INFO(C::name() << ": world " << world << ", " << chunks.size() << " chunks");
        const ModelErrors e = run_chunked_model<S>(batch, chunks, shape, world, args, 2, kWindow, 5u);
        CHECK(e.rows_fixed);
        for (std::size_t l = 0; l < e.layers.size(); ++l) {
          INFO("layer " << l << (l % 2 == 1 ? std::string(" (window)") : std::string(" (full)")));
          CHECK(e.layers[l].max() < kModelTolerance);
        }
        ++runs;
      }
    });
    MESSAGE(runs << " (combination, world) chunked models of 2 layers");
    CHECK(runs >= 60 * static_cast<int>(test::kNumSweptCombinations) / static_cast<int>(test::kNumCombinations));
  }

  TEST_CASE("property: a batch's placement does not depend on the masks of its calls (every partitioner)") {
    // Strategy::plan under any mask has the placement's rows; an engine's owned_ranges are the same before
    // and after calls under other masks; and the placement follows the declared mix, not the call.
    std::mt19937 rng(77);
    int checked = 0;
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      for (int trial = 0; trial < 6; ++trial) {
        const int world = 2 + static_cast<int>(rng() % 7);
        const std::int64_t w = 1 + static_cast<std::int64_t>(rng() % 60);
        const DocumentBatch batch = model_batch(w, static_cast<unsigned>(rng()));
        typename S::Arguments args = C::arguments();
        args.ranks_per_node = world;
        if (trial % 2 == 1) args.masks = {{AttentionMask::causal(), 3}, {AttentionMask::sliding_window(w), 1}};
        const AttentionShape shape{8, 8, 8};
        const Topology topo{world, world};
        const auto placed = S::place(args, batch, topo);
        if (!placed.status) continue;
        for (const AttentionMask m : {AttentionMask::causal(), AttentionMask::sliding_window(w),
                                      AttentionMask::sliding_window(1), AttentionMask::sliding_window(w + 1000)}) {
          const auto planned = S::plan(args, batch, shape, topo, m);
          if (!planned.status) continue;
          CHECK(planned.plan.placement() == placed.placement);
          CHECK_NOTHROW(planned.plan.check_invariants(batch));
          ++checked;
        }
      }
    });
    CHECK(checked > 500 * static_cast<int>(test::kNumSweptCombinations) / static_cast<int>(test::kNumCombinations));
    // Through the engine: owned_ranges before any call equal those after calls under several masks.
    using S = Strategy<partition::PerDoc, comm::AllGather>;
    S::Arguments args;
    args.masks = {{AttentionMask::causal(), 1}, {AttentionMask::sliding_window(9), 1}};
    const DocumentBatch batch = model_batch(9, 5);
    const AttentionShape shape{2, 2, 8};
    backend::inproc::World(3).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, Ref> attn(t, shape, args);
      const std::vector<Range> before = attn.owned_ranges(batch);
      const std::int64_t n = attn.local_tokens(batch);
      AttentionTensors<double> x(n, shape);
      for (const std::int64_t w : {0, 9, 3, 0, 200}) {
        attn.forward(batch, AttentionMask{w}, x.q.view(), x.k.view(), x.v.view(), x.o.view(), x.lse.view());
        CHECK(attn.owned_ranges(batch) == before);
        CHECK(attn.plan(batch, AttentionMask{w}).owned[static_cast<std::size_t>(t.rank())] == before);
      }
    });
  }

  TEST_CASE("the mask mix steers balance: a window model's placement is balanced for the window") {
    // Per-Doc cut for an all-window model balances the windowed work (triangle zigzag, band even); for an
    // all-full model the causal work; for a 50/50 mix the layer-weighted sum of both.
    const DocumentBatch one = DocumentBatch::single({4096});
    const Topology topo{8, 8};
    const AttentionMask w = AttentionMask::sliding_window(256);
    const partition::PerDoc per_doc;
    const auto imbalance = [&](const MaskMix& mix, AttentionMask call) {
      return slice(per_doc.place(one, topo, mix), one, call).balance().compute_imbalance;
    };
    CHECK(imbalance(MaskMix::only(w), w) <= 1.001);
    CHECK(imbalance(MaskMix{}, AttentionMask::causal()) <= 1.001);
    CHECK(imbalance(MaskMix{}, w) > 1.02);  // the zigzag cut for causal work leaves the band uneven (1.032)
    // The 50/50 mix: each layer kind's own imbalance is bounded, and their sum per rank is balanced.
    const MaskMix half{{AttentionMask::causal(), 1}, {w, 1}};
    const Placement p = per_doc.place(one, topo, half);
    const ShardPlan full = slice(p, one, AttentionMask::causal()), window = slice(p, one, w);
    double most = 0, sum = 0;
    for (int r = 0; r < 8; ++r) {
      const double work = static_cast<double>(total_area(full.slices[static_cast<std::size_t>(r)]) +
                                              total_area(window.slices[static_cast<std::size_t>(r)]));
      most = std::max(most, work);
      sum += work;
    }
    CHECK(most / (sum / 8) <= 1.001);
  }

  TEST_CASE("a backward under another mask than its forward is refused, naming o and both masks") {
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const DocumentBatch batch = DocumentBatch({{40, 9}});
    const AttentionShape shape{2, 2, 8};
    std::vector<std::string> errors(2);
    backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, Ref> attn(t, shape);
      const std::int64_t n = attn.local_tokens(batch);
      AttentionTensors<double> x(n, shape);
      std::mt19937 rng(static_cast<unsigned>(t.rank()));
      std::normal_distribution<double> normal;
      for (auto* v : {&x.q, &x.k, &x.v, &x.dout})
        for (double& e : v->storage) e = normal(rng);
      attn.forward(batch, AttentionMask::sliding_window(5), x.q.view(), x.k.view(), x.v.view(), x.o.view(),
                   x.lse.view());
      try {
        attn.backward(batch, x.q.view(), x.k.view(), x.v.view(), x.o.view(), x.lse.view(), x.dout.view(), x.dq.view(),
                      x.dk.view(), x.dv.view());
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(t.rank())] = e.what();
      }
    });
    for (const std::string& e : errors) {
      CAPTURE(e);
      CHECK(e.find("under another mask") != std::string::npos);
      CHECK(e.find("sliding_window(5)") != std::string::npos);
    }
  }

  TEST_CASE("ranks calling with different masks fail with a mismatch naming the mask, before any data moves") {
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const DocumentBatch batch = DocumentBatch({{40, 9}});
    const AttentionShape shape{2, 2, 8};
    std::vector<std::string> errors(3);
    backend::inproc::World(3).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, Ref> attn(t, shape);
      AttentionTensors<double> x(attn.local_tokens(batch), shape);
      try {
        attn.forward(batch, AttentionMask{t.rank() == 1 ? 8 : 0}, x.q.view(), x.k.view(), x.v.view(), x.o.view(),
                     x.lse.view());
      } catch (const Error& e) {
        if (e.errc() == Errc::kMismatch) errors[static_cast<std::size_t>(t.rank())] = e.what();
      }
    });
    for (const std::string& e : errors) {
      CAPTURE(e);
      CHECK(e.find("the call's mask (sliding window, 0 = causal)") != std::string::npos);
    }
  }
}
