// SPDX-License-Identifier: Apache-2.0
// Every partitioner x communicator combination (tests/support/strategy_list.hpp), forward and
// backward against the fp64 reference
// on the unsharded batch, on world sizes 1..8, micro-batches of 1..4 sequences of unequal length,
// lognormal and long-tail document mixes, MHA and GQA, each without and with a sliding window (windows
// of 1..64 keys: shorter and longer than the shards, shorter and longer than the documents). Combinations that
// can_implement refuses are checked to be refused with a reason, and to throw before any communication.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

// fp64 arithmetic everywhere: only summation order differs from the reference (~1e-15).
constexpr double kFp64Tolerance = 1e-10;

enum class Mix { kLognormal, kLongTail };

// B sequences of unequal lengths; lognormal documents (median 9), or a long tail: one document of
// most of the sequence plus short ones (lengths from 1 to the whole sequence).
DocumentBatch make_batch(int sequences, Mix mix, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    const std::int64_t tokens = 40 + 13 * b + static_cast<std::int64_t>(rng() % 17);
    if (mix == Mix::kLognormal) {
      seqs.push_back(test::lognormal_docs(tokens, 9.0, 1.0, rng));
    } else {
      const std::int64_t big = tokens - static_cast<std::int64_t>(rng() % 8);
      std::vector<std::int64_t> docs{big};
      for (std::int64_t left = tokens - big; left > 0;) {
        const std::int64_t len = std::min<std::int64_t>(left, 1 + static_cast<std::int64_t>(rng() % 3));
        docs.push_back(len);
        left -= len;
      }
      std::shuffle(docs.begin(), docs.end(), rng);
      seqs.push_back(docs);
    }
  }
  return DocumentBatch(seqs);
}

// Runs of one-token documents between longer ones, in two sequences: the planners merge such runs
// into diagonal slices (a sliding window of one key) and the waves merge them again after
// localization, so this batch pins those merges to the fp64 reference.
DocumentBatch one_token_runs() {
  const auto ones = [](std::vector<std::int64_t>& docs, int n) {
    docs.insert(docs.end(), static_cast<std::size_t>(n), 1);
  };
  std::vector<std::int64_t> a, b;
  ones(a, 20), a.push_back(7), ones(a, 9), a.push_back(3), ones(a, 12);
  ones(b, 17), b.push_back(5), ones(b, 8);
  return DocumentBatch({a, b});
}

// One combination of tests/support/strategy_list.hpp.
template <class Combination>
void check_combination(Combination) {
  using S = typename Combination::strategy;
  const std::string name = Combination::name();
  typename S::Arguments args = Combination::arguments();
  int accepted = 0, refused = 0;
  for (int world = 1; world <= 8; ++world) {
    const int sequences = 1 + (world + static_cast<int>(name.size())) % 4;
    const Mix mix = world % 2 == 0 ? Mix::kLognormal : Mix::kLongTail;
    const AttentionShape shape = world % 3 == 0 ? AttentionShape{4, 4, 8} : AttentionShape{8, 2, 8};
    const DocumentBatch batch = make_batch(sequences, mix, 1000u * static_cast<unsigned>(world) + 17u);
    args.ranks_per_node = world >= 4 ? world / 2 : world;  // two "nodes" from 4 ranks up
    INFO(name << ": world " << world << ", " << sequences << " sequences, " << batch.documents().size()
              << " documents, heads " << shape.heads_q << ":" << shape.heads_kv);
    const Status status = S::can_implement(args, batch, shape, Topology{world, args.ranks_per_node});
    if (!status.ok) {
      ++refused;
      CHECK_FALSE(status.reason.empty());
      CHECK_THROWS_AS((test::check_strategy<S, attention::Reference<double>>(batch, shape, world, args)),
                      std::invalid_argument);
      continue;
    }
    ++accepted;
    const auto err = test::check_strategy<S, attention::Reference<double>>(batch, shape, world, args);
    CHECK(err.o < kFp64Tolerance);
    CHECK(err.lse < kFp64Tolerance);
    CHECK(err.dq < kFp64Tolerance);
    CHECK(err.dk < kFp64Tolerance);
    CHECK(err.dv < kFp64Tolerance);
    CHECK(err.bytes_match);
    // The same rows as a window layer. Shards hold about 300 / world tokens and lognormal documents ~9:
    // w = 1..5 is shorter than both, w = 40..64 longer than most shards and documents.
    constexpr std::int64_t kWindows[] = {3, 16, 5, 40, 9, 24, 1, 64};
    const AttentionMask window{kWindows[world - 1]};
    INFO("window " << window.window);
    auto wargs = args;  // placed for an all-window model, as a window model would declare
    wargs.masks = MaskMix::only(window);
    if (!S::can_implement(wargs, batch, shape, Topology{world, args.ranks_per_node}, window).ok) continue;
    const auto werr = test::check_strategy<S, attention::Reference<double>>({batch, window}, shape, world, wargs);
    CHECK(werr.o < kFp64Tolerance);
    CHECK(werr.lse < kFp64Tolerance);
    CHECK(werr.dq < kFp64Tolerance);
    CHECK(werr.dk < kFp64Tolerance);
    CHECK(werr.dv < kFp64Tolerance);
    CHECK(werr.bytes_match);
    // On the same owned rows a window never adds traffic, it only removes keys from the slices (the
    // planners that weigh the windowed area may place the rows differently).
    const Topology topo{world, args.ranks_per_node};
    if (S::plan(args, batch, shape, topo).plan.owned == S::plan(wargs, batch, shape, topo, window).plan.owned) {
      CHECK(werr.bytes_forward <= err.bytes_forward);
      CHECK(werr.bytes_backward <= err.bytes_backward);
    }
  }
  const DocumentBatch tiny = one_token_runs();
  for (const int world : {2, 4}) {
    args.ranks_per_node = world;
    const AttentionShape shape{8, 2, 8};
    INFO(name << ": one-token runs, world " << world);
    if (!S::can_implement(args, tiny, shape, Topology{world, world}).ok) continue;
    const auto err = test::check_strategy<S, attention::Reference<double>>(tiny, shape, world, args);
    CHECK(err.max() < kFp64Tolerance);
    CHECK(err.bytes_match);
    const auto werr =
        test::check_strategy<S, attention::Reference<double>>(test::windowed(tiny, 2), shape, world, args);
    CHECK(werr.max() < kFp64Tolerance);
    CHECK(werr.bytes_match);
  }
  MESSAGE(name << ": " << accepted << " world sizes run, " << refused << " refused");
  CHECK(accepted >= 4);  // a combination that refuses most worlds is not being tested
}

struct ShardingAwareRuns {
  test::Errors plain, smart;
};

// Zigzag x C plain and sharding-aware, and WholeDoc x C sharding-aware, on one 120-token lognormal
// sequence over 4 ranks: all exact, and Whole-Doc (every document local) moves nothing at all.
template <class C>
ShardingAwareRuns check_sharding_aware(unsigned seed) {
  std::mt19937 rng(seed);
  const DocumentBatch batch = DocumentBatch({test::lognormal_docs(120, 5.0, 0.5, rng)});
  using Zig = Strategy<partition::Zigzag, C>;
  typename Zig::Arguments aware;
  aware.comm.sharding_aware = true;
  ShardingAwareRuns r{test::check_strategy<Zig, attention::Reference<double>>(batch, {4, 4, 8}, 4),
                      test::check_strategy<Zig, attention::Reference<double>>(batch, {4, 4, 8}, 4, aware)};
  CHECK(r.plain.max() < kFp64Tolerance);
  CHECK(r.smart.max() < kFp64Tolerance);
  using Whole = Strategy<partition::WholeDoc, C>;
  typename Whole::Arguments whole_aware;
  whole_aware.comm.sharding_aware = true;
  const auto whole = test::check_strategy<Whole, attention::Reference<double>>(batch, {4, 4, 8}, 4, whole_aware);
  CHECK(whole.bytes_forward == 0);
  CHECK(whole.bytes_backward == 0);
  CHECK(whole.max() < kFp64Tolerance);
  return r;
}

// Forward KV bytes each rank receives under S (the programs' declared bytes, which the exact runs check
// against the transport), and the ranks each rank receives anything from.
template <class S>
std::vector<std::pair<std::uint64_t, int>> received(const typename S::Arguments& args, const DocumentBatch& batch,
                                                    const AttentionShape& shape, int world, AttentionMask mask = {}) {
  const Topology topo{world, world};
  const ShardPlan plan = S::plan(args, batch, shape, topo, mask).plan;
  std::vector<std::vector<std::uint64_t>> to(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r)
    to[static_cast<std::size_t>(r)] = S::compile(args, plan, shape, r).forward.bytes_to(world, sizeof(double), 8);
  std::vector<std::pair<std::uint64_t, int>> out(static_cast<std::size_t>(world));
  for (int from = 0; from < world; ++from)
    for (int r = 0; r < world; ++r) {
      const std::uint64_t b = to[static_cast<std::size_t>(from)][static_cast<std::size_t>(r)];
      out[static_cast<std::size_t>(r)].first += b;
      out[static_cast<std::size_t>(r)].second += b > 0 ? 1 : 0;
    }
  return out;
}

// With a window w, a sharding-aware communicator gives each rank only keys inside some query's window:
// per owned range at most the w - 1 tokens before it, however long the document (the bound of issue 29:
// the queries' span + w). Exact vs fp64 as well, and far below the unwindowed volume on long documents.
template <class P, class C>
void check_window_bound() {
  using S = Strategy<P, C>;
  typename S::Arguments args;
  args.comm.sharding_aware = true;
  const AttentionShape shape{4, 2, 8};
  const std::uint64_t row_bytes = 2u * 2u * 8u * sizeof(double);  // K and V, 2 KV heads, d 8
  const DocumentBatch batch = DocumentBatch({{700, 5, 2, 60}, {300, 9}});
  for (const int world : {2, 4, 8})
    for (const std::int64_t w : {1, 6, 40}) {
      const AttentionMask window{w};
      INFO(test::partitioner_name<P> << ": world " << world << ", window " << w);
      const ShardPlan plan = S::plan(args, batch, shape, Topology{world, world}, window).plan;
      const auto got = received<S>(args, batch, shape, world, window);
      const auto full = received<S>(args, batch, shape, world);
      std::uint64_t total = 0, total_full = 0;
      for (int r = 0; r < world; ++r) {
        const auto ranges = static_cast<std::uint64_t>(plan.owned[static_cast<std::size_t>(r)].size());
        CHECK(got[static_cast<std::size_t>(r)].first <= ranges * static_cast<std::uint64_t>(w - 1) * row_bytes);
        total += got[static_cast<std::size_t>(r)].first;
        total_full += full[static_cast<std::size_t>(r)].first;
      }
      if (w <= 6) CHECK(4 * total <= total_full);
      const auto err = test::check_strategy<S, attention::Reference<double>>({batch, window}, shape, world, args);
      CHECK(err.max() < kFp64Tolerance);
      CHECK(err.bytes_match);
    }
}

}  // namespace

TEST_SUITE("strategy") {
  // One test case per partitioner of test::Partitioners (named after its type), each running every
  // communicator configuration of test::Communicators.
  TEST_CASE_TEMPLATE_DEFINE("partitioner x every communicator", P, every_communicator) {
    test::for_each_communicator<P>([](auto combination) { check_combination(combination); });
  }
  TEST_CASE_TEMPLATE_APPLY(every_communicator, test::Partitioners);

  TEST_CASE("refused combinations say why and throw before communicating") {
    const DocumentBatch batch = DocumentBatch({{50, 3}});
    // Ulysses over 8 ranks with 4 query heads: a head-sharded step with more ranks than heads.
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    const Status s = Ulysses::can_implement({}, batch, {4, 4, 8}, Topology{8, 8});
    CHECK_FALSE(s.ok);
    CHECK(s.reason.find("heads_q = 4") != std::string::npos);
    CHECK_THROWS_AS((test::check_strategy<Ulysses, attention::Reference<double>>(batch, {4, 4, 8}, 8)),
                    std::invalid_argument);
    // Hierarchical with an inner size that does not divide the group.
    using Usp = Strategy<partition::Zigzag, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Usp::Arguments args;
    args.comm.inner_size = 3;
    const Status h = Usp::can_implement(args, batch, {8, 8, 8}, Topology{8, 4});
    CHECK_FALSE(h.ok);
    CHECK(h.reason.find("inner_size = 3") != std::string::npos);
    // Whole-Doc with a document longer than a rank's token capacity.
    using Whole = Strategy<partition::WholeDoc, comm::Ring>;
    const Status w = Whole::can_implement({}, batch, {4, 4, 8}, Topology{4, 4});
    CHECK_FALSE(w.ok);
    CHECK_FALSE(w.reason.empty());
  }

  TEST_CASE("sharding-aware ring moves no more than the plain ring, and nothing for whole documents") {
    const auto r = check_sharding_aware<comm::Ring>(5);
    CHECK(r.smart.bytes_forward < r.plain.bytes_forward);
  }

  TEST_CASE(
      "sharding-aware all-gather moves only the keys read: less than the plain gather, nothing for whole documents") {
    const auto r = check_sharding_aware<comm::AllGather>(9);
    CHECK(r.smart.bytes_forward < r.plain.bytes_forward);
    CHECK(r.smart.bytes_backward < r.plain.bytes_backward);
    // Plain: every rank sends its K and V rows to the 3 others (fp64, 4 KV heads, d 8).
    CHECK(r.plain.bytes_forward == 3 * 120 * 2 * 4 * 8 * sizeof(double));
  }

  TEST_CASE_TEMPLATE("windowed: sharding-aware ring and all-gather receive at most w - 1 keys per owned range", P,
                     partition::Uniform, partition::Zigzag, partition::PerDoc, partition::Hybrid) {
    check_window_bound<P, comm::Ring>();
    check_window_bound<P, comm::AllGather>();
  }

  TEST_CASE("windowed: CpuFlash (double and float) through ring, all-gather, Ulysses and hierarchical") {
    // The Reference kernel above walks masks row by row; CpuFlash tiles them, and the windowed slices
    // reach it clipped and localized (causal offsets of pieces, windows cut at shard edges).
    const DocumentBatch batch = make_batch(2, Mix::kLongTail, 4242);
    const AttentionShape shape{8, 2, 8};
    for (const std::int64_t w : {5, 40}) {
      const test::MaskedBatch windowed = test::windowed(batch, w);
      INFO("window " << w);
      const auto run = [&]<class S>(std::type_identity<S>, typename S::Arguments args) {
        args.ranks_per_node = 2;
        // CpuFlash owns its workspace and is not copyable: each rank's engine makes its own.
        const auto check = [&]<class K>(std::type_identity<K>) {
          return test::check_attention<K>(
              windowed, shape, 4,
              [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<K>> {
                return std::make_unique<DistributedAttention<S, K>>(t, shape, args);
              },
              7);
        };
        const auto d = check(std::type_identity<attention::CpuFlash<double>>{});
        CHECK(d.max() < kFp64Tolerance);
        CHECK(d.bytes_match);
        const auto f = check(std::type_identity<attention::CpuFlash<float>>{});
        CHECK(f.max() < 1e-4);  // fp32 accumulation against fp64 on float-rounded inputs
      };
      using Zr = Strategy<partition::Zigzag, comm::Ring>;
      Zr::Arguments zr;
      zr.comm.sharding_aware = true;
      run(std::type_identity<Zr>{}, zr);
      using Pa = Strategy<partition::PerDoc, comm::AllGather>;
      Pa::Arguments pa;
      pa.comm.sharding_aware = true;
      run(std::type_identity<Pa>{}, pa);
      run(std::type_identity<Strategy<partition::Uniform, comm::AllToAll>>{}, {});
      run(std::type_identity<Strategy<partition::Hybrid, test::communicators::HierarchicalA2aRing>>{}, {});
    }
  }

  TEST_CASE("windowed: the sharding-aware ring talks only to the ranks inside the windows") {
    // One 400-token document on 4 Uniform ranks of 100 tokens and w = 30: every rank's window reaches
    // only its left neighbour, so the ring's other steps move nothing and compute nothing.
    using S = Strategy<partition::Uniform, comm::Ring>;
    S::Arguments args;
    args.comm.sharding_aware = true;
    const DocumentBatch batch = DocumentBatch({{400}});
    const AttentionMask window{30};
    const auto got = received<S>(args, batch, {4, 4, 8}, 4, window);
    CHECK(got[0].second == 0);
    for (int r = 1; r < 4; ++r) {
      CHECK(got[static_cast<std::size_t>(r)].second == 1);
      CHECK(got[static_cast<std::size_t>(r)].first == 29u * 2u * 4u * 8u * sizeof(double));
    }
    const S::Compiled c = S::compile(args, batch, {4, 4, 8}, Topology{4, 4}, 2, window);
    int computes = 0;
    for (const auto& step : c.program.forward.steps)
      computes += std::holds_alternative<comm::ComputeStep>(step) ? 1 : 0;
    CHECK(computes == 2);  // the local block and the left neighbour's, not 4
  }

  TEST_CASE("one engine serves window and full layers over the same rows (plans cached per mask)") {
    // A model alternating window and full layers calls one DistributedAttention with the batch and each
    // layer's mask: the rows are the placement's (the same for both masks, balanced for the declared mix),
    // the plan cache tells the masks apart (different slices), and results equal a fresh engine's.
    using S = Strategy<partition::PerDoc, comm::AllGather>;
    S::Arguments args;
    args.comm.sharding_aware = true;
    args.masks = {{AttentionMask::causal(), 1}, {AttentionMask::sliding_window(6), 1}};
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch batch = DocumentBatch({{90, 7, 30}});
    const AttentionMask window = AttentionMask::sliding_window(6);
    std::mutex mu;
    bool same = true, window_matters = false;
    backend::inproc::World(3).run([&](backend::inproc::Transport& t) {
      DistributedAttention<S, attention::Reference<double>> shared(t, shape, args), fresh(t, shape, args);
      const std::int64_t n = shared.local_tokens(batch);
      REQUIRE(shared.plan(batch).owned == shared.plan(batch, window).owned);  // the same rows
      REQUIRE(shared.plan(batch).slices != shared.plan(batch, window).slices);
      ThdTensor<double> q(n, 4, 8), k(n, 2, 8), v(n, 2, 8), o_full(n, 4, 8), o_win(n, 4, 8), o_fresh(n, 4, 8);
      LseTensor<double> lse(4, n);
      std::mt19937 rng(static_cast<std::uint32_t>(t.rank()) + 3);
      std::normal_distribution<double> normal;
      for (auto* x : {&q, &k, &v})
        for (double& e : x->storage) e = normal(rng);
      shared.forward(batch, q.view(), k.view(), v.view(), o_full.view(), lse.view());
      shared.forward(batch, window, q.view(), k.view(), v.view(), o_win.view(), lse.view());
      fresh.forward(batch, window, q.view(), k.view(), v.view(), o_fresh.view(), lse.view());
      const std::lock_guard lock(mu);
      same = same && o_win.storage == o_fresh.storage;
      window_matters = window_matters || o_win.storage != o_full.storage;
    });
    CHECK(same);
    CHECK(window_matters);
  }

  TEST_CASE("AttentionMask: areas, slices, and a negative window refused by name") {
    const DocumentBatch b = DocumentBatch({{10, 3}, {1}});
    const AttentionMask w = AttentionMask::sliding_window(4);
    CHECK(b.attention_area() == b.causal_area());
    CHECK(b.attention_area(AttentionMask::causal()) == b.causal_area());
    // 10 tokens, w 4: rows see 1, 2, 3, 4, 4, 4, 4, 4, 4, 4 keys = 34; 3 tokens: 6; 1 token: 1.
    CHECK(b.attention_area(w) == 34 + 6 + 1);
    CHECK(total_area(b.document_causal_slices(w)) == b.attention_area(w));
    CHECK(document_area(10, 100) == 55);
    CHECK(w.to_string() == "sliding_window(4)");
    // DPP chunks are cut once for every layer: a split document's prefix is all of its earlier tokens, and
    // each layer's carry cuts it to its mask (tests/schedule/test_chunked_window.cpp runs them against fp64).
    const schedule::ChunkPlan plan = schedule::DynamicChunk{{.token_capacity = 4}}.plan(b);
    for (const Chunk& c : plan.chunks)
      for (std::size_t i = 0; i < c.tokens.size(); ++i) CHECK(c.prefix[i].end == c.tokens[i].begin);
    for (const std::int64_t bad : {std::int64_t{-3}, std::int64_t{0}}) {
      try {
        (void)AttentionMask::sliding_window(bad);
        FAIL("a window < 1 was accepted");
      } catch (const std::invalid_argument& e) {
        CHECK(std::string(e.what()).find("window") != std::string::npos);
        CHECK(std::string(e.what()).find(std::to_string(bad)) != std::string::npos);
      }
    }
    CHECK_THROWS_WITH_AS(AttentionMask{-3}.validate("here"), doctest::Contains("mask.window = -3"),
                         std::invalid_argument);
  }
}
