// SPDX-License-Identifier: Apache-2.0
// DynamicChunk (DPP's workload-balanced chunking) and ChunkedAttention (chunk-by-chunk attention with
// the KV prefix carried): the chunk plan's invariants on random batches, and, for every partitioner x
// communicator combination on 1..8 in-process ranks, forward and backward over all chunks equal to
// attention over the whole batch (fp64 reference), with long documents split 2-8 ways.
#include <doctest/doctest.h>

#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

// Long documents (a few times the capacity) among lognormal short ones, over `sequences` sequences.
DocumentBatch long_tail_batch(int sequences, std::int64_t capacity, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    std::vector<std::int64_t> docs = test::lognormal_docs(20 + static_cast<std::int64_t>(rng() % 30), 6.0, 1.0, rng);
    if (b % 2 == 0) docs.push_back(capacity + static_cast<std::int64_t>(rng() % static_cast<unsigned>(3 * capacity)));
    std::shuffle(docs.begin(), docs.end(), rng);
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

void check_plan(const DocumentBatch& batch, const schedule::DynamicChunk& sched) {
  const schedule::ChunkPlan plan = sched.plan(batch);
  const auto& a = sched.args;
  std::vector<int> seen(static_cast<std::size_t>(batch.total_tokens()), 0);
  std::vector<std::int64_t> next(batch.documents().size(), 0);  // next row of each document to run
  REQUIRE(plan.chunks.size() == plan.pieces.size());
  const double slice_cost = a.cost.of(0, plan.mesh.back()) / static_cast<double>(plan.mesh.size());
  for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
    const schedule::Chunk& ch = plan.chunks[c];
    REQUIRE(ch.tokens.size() == ch.prefix.size());
    CHECK(ch.batch.total_tokens() <= a.token_capacity);
    std::int64_t tokens = 0;
    for (std::size_t i = 0; i < ch.tokens.size(); ++i) {
      const schedule::ChunkPiece& p = plan.pieces[c][i];
      const Document& d = batch.documents()[static_cast<std::size_t>(p.document)];
      CHECK(ch.tokens[i] == Range{d.tokens.begin + p.begin, d.tokens.begin + p.end});
      CHECK(ch.prefix[i] == Range{d.tokens.begin, d.tokens.begin + p.begin});
      CHECK(next[static_cast<std::size_t>(p.document)] == p.begin);  // a document's slices run in order
      next[static_cast<std::size_t>(p.document)] = p.end;
      for (std::int64_t t = ch.tokens[i].begin; t < ch.tokens[i].end; ++t) ++seen[static_cast<std::size_t>(t)];
      tokens += ch.tokens[i].size();
      CHECK(ch.batch.documents()[i].tokens.size() == ch.tokens[i].size());
    }
    CHECK(tokens == ch.batch.total_tokens());
    if (ch.kind == schedule::ChunkKind::kSplit) {
      REQUIRE(ch.tokens.size() == 1);
      const auto& p = plan.pieces[c][0];
      // Equal cost up to one token's worth (mesh positions are whole tokens).
      CHECK(std::abs(a.cost.of(p.begin, p.end) - slice_cost) <= a.cost.of(p.end - 1, p.end + 1) + 1e-9);
    } else {
      CHECK(ch.cost <= plan.time_target * (1 + 1e-12));
      int tails = 0;
      for (const Range& pre : ch.prefix) tails += pre.empty() ? 0 : 1;
      CHECK(tails == (ch.kind == schedule::ChunkKind::kHybrid ? 1 : 0));
    }
  }
  for (int s : seen) CHECK(s == 1);
  for (std::size_t d = 0; d < next.size(); ++d) CHECK(next[d] == batch.documents()[d].tokens.size());
}

}  // namespace

// The reference kernel, failing when `fail` is set and it is asked for a full-mask slice (the prefix
// term's call): a fault in the middle of a chunk's prefix program.
struct FailingPrefixKernel : attention::Reference<double> {
  bool fail = false;
  template <class... Args>
  void forward(const HostExec& e, const AttentionShape& shape, ThdView<const double> q, ThdView<const double> k,
               ThdView<const double> v, std::span<const AttnSlice> slices, Args&&... rest) const {
    for (const AttnSlice& s : slices)
      if (fail && s.mask == Mask::full()) throw std::runtime_error("injected kernel fault");
    Reference<double>::forward(e, shape, q, k, v, slices, std::forward<Args>(rest)...);
  }
};

TEST_SUITE("schedule") {
  TEST_CASE("DynamicChunk: the mesh has equal-cost slices; the plan covers every token once, in order") {
    std::mt19937 rng(5);
    for (int trial = 0; trial < 60; ++trial) {
      const std::int64_t cap = 16 + static_cast<std::int64_t>(rng() % 48);
      const DocumentBatch batch = long_tail_batch(1 + trial % 4, cap, 100u + static_cast<unsigned>(trial));
      schedule::DynamicChunk sched;
      sched.args.token_capacity = cap;
      sched.args.slices = trial % 3 == 0 ? 0 : 0;
      sched.args.cost = trial % 2 == 0 ? schedule::ChunkCost{0.0, 1.0} : schedule::ChunkCost{24.0, 1.0};
      INFO("trial " << trial << ", capacity " << cap);
      check_plan(batch, sched);
    }
  }

  TEST_CASE("DynamicChunk: explicit K, split 2-8 ways; later slices are shorter; bad arguments are named") {
    const DocumentBatch batch({{400, 3, 9, 17}, {250, 40, 1, 2}});
    for (int k = 2; k <= 8; ++k) {
      schedule::DynamicChunk sched{{.token_capacity = 400, .time_target = 0, .slices = k, .cost = {}}};
      const auto plan = sched.plan(batch);
      CHECK(plan.mesh.size() == static_cast<std::size_t>(k));
      for (std::size_t i = 1; i + 1 < plan.mesh.size(); ++i)
        CHECK(plan.mesh[i] - plan.mesh[i - 1] >= plan.mesh[i + 1] - plan.mesh[i]);
      check_plan(batch, sched);
    }
    CHECK_THROWS_WITH_AS((schedule::DynamicChunk{{.token_capacity = 0}}.plan(batch)),
                         doctest::Contains("args.token_capacity"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        (schedule::DynamicChunk{{.token_capacity = 100, .time_target = 0, .slices = 2, .cost = {}}}.plan(batch)),
        doctest::Contains("args.slices"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        (schedule::DynamicChunk{{.token_capacity = 100, .time_target = 0, .slices = 0, .cost = {-1.0, 1.0}}}.plan(
            batch)),
        doctest::Contains("args.cost.per_token"), std::invalid_argument);
  }

  TEST_CASE("DynamicChunk: the automatic K is the fewest slices that fit, found without a growing search") {
    // Against the definition (grow K until the mesh's first slice fits) on small ratios.
    std::mt19937 rng(11);
    for (int trial = 0; trial < 200; ++trial) {
      const std::int64_t cap = 1 + static_cast<std::int64_t>(rng() % 64);
      const std::int64_t longest = cap + static_cast<std::int64_t>(rng() % static_cast<unsigned>(8 * cap));
      const schedule::ChunkCost cost =
          trial % 2 == 0 ? schedule::ChunkCost{0.0, 1.0} : schedule::ChunkCost{static_cast<double>(rng() % 50), 1.0};
      const schedule::DynamicChunk sched{{.token_capacity = cap, .time_target = 0, .slices = 0, .cost = cost}};
      int k = 1;
      while (k <= schedule::DynamicChunk::kMaxSlices && sched.mesh(longest, k).front() > cap) ++k;
      INFO("trial " << trial << ": longest " << longest << ", capacity " << cap);
      if (k > schedule::DynamicChunk::kMaxSlices) {
        CHECK_THROWS_AS((void)sched.plan(DocumentBatch({{longest}})), std::invalid_argument);
        continue;
      }
      CHECK(sched.plan(DocumentBatch({{longest}})).slices == k);
    }
  }

  TEST_CASE("DynamicChunk at 1M tokens: bounded K, every slice within capacity, every token once") {
    // One 1M-token document among 200 short ones. (The old search built ~K^2 / 2 meshes' worth of
    // positions: minutes here; the bisection is O(log kMaxSlices). bench/plan_scale times it.)
    std::mt19937 rng(3);
    std::vector<std::int64_t> docs{1'000'000};
    for (int i = 0; i < 200; ++i) docs.push_back(1 + static_cast<std::int64_t>(rng() % 4000));
    const DocumentBatch batch({docs});
    const schedule::DynamicChunk sched{{.token_capacity = 32768, .time_target = 0, .slices = 0, .cost = {}}};
    const schedule::ChunkPlan plan = sched.plan(batch);
    CHECK(plan.slices <= schedule::DynamicChunk::kMaxSlices);
    CHECK(sched.mesh(1'000'000, plan.slices).front() <= 32768);
    CHECK(sched.mesh(1'000'000, plan.slices - 1).front() > 32768);  // the fewest
    check_plan(batch, sched);
    // Beyond the slice limit: refused by name, with the capacity that would fit (was minutes and
    // tens of thousands of 8-12-token slices; capacity 1 ran out of memory in seqpar-plan).
    for (const std::int64_t cap : {std::int64_t{4096}, std::int64_t{1}}) {
      const std::string message = [&] {
        try {
          (void)schedule::DynamicChunk{{.token_capacity = cap, .time_target = 0, .slices = 0, .cost = {}}}.plan(batch);
        } catch (const std::invalid_argument& e) {
          return std::string(e.what());
        }
        return std::string("no exception");
      }();
      CAPTURE(message);
      CHECK(message.find("args.token_capacity = " + std::to_string(cap)) != std::string::npos);
      CHECK(message.find("kMaxSlices = 8192") != std::string::npos);
    }
    CHECK_THROWS_WITH_AS(
        (schedule::DynamicChunk{{.token_capacity = 32768, .time_target = 0, .slices = 2147483647, .cost = {}}}.plan(
            batch)),
        doctest::Contains("args.slices = 2147483647: must be in [0, kMaxSlices = 8192]"), std::invalid_argument);
  }

  TEST_CASE("ChunkedAttention refuses an order that would lose prefix gradients, naming the chunks") {
    const DocumentBatch batch({{90, 5, 7}});
    const auto chunks =
        schedule::DynamicChunk{{.token_capacity = 40, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch);
    REQUIRE(chunks.size() >= 3);
    backend::inproc::World(1).run([&](backend::inproc::Transport& t) {
      const AttentionShape shape{2, 2, 8};
      DistributedAttention<Strategy<partition::Uniform, comm::AllToAll>, attention::Reference<double>> attn(t, shape);
      runtime::ChunkedAttention<attention::Reference<double>> chunked(attn);
      chunked.begin(chunks);
      std::vector<ThdTensor<double>> x, o;  // o apart: an output may not share memory with q, k, v
      std::vector<LseTensor<double>> l;
      for (int c = 0; c < chunked.num_chunks(); ++c) {
        x.emplace_back(chunked.local_tokens(c), 2, 8);
        o.emplace_back(chunked.local_tokens(c), 2, 8);
        l.emplace_back(2, chunked.local_tokens(c));
      }
      CHECK_THROWS_WITH_AS(chunked.forward(1, x[1].view(), x[1].view(), x[1].view(), x[1].view(), l[1].view()),
                           doctest::Contains("whose forward has not run"), std::invalid_argument);
      for (int c = 0; c < chunked.num_chunks(); ++c)
        chunked.forward(c, x[static_cast<std::size_t>(c)].view(), x[static_cast<std::size_t>(c)].view(),
                        x[static_cast<std::size_t>(c)].view(), o[static_cast<std::size_t>(c)].view(),
                        l[static_cast<std::size_t>(c)].view());
      CHECK_THROWS_WITH_AS(chunked.backward(0, x[0].view(), x[0].view(), x[0].view(), x[0].view(), l[0].view(),
                                            x[0].view(), x[0].view(), x[0].view(), x[0].view()),
                           doctest::Contains("must run backward first"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(chunked.forward(99, x[0].view(), x[0].view(), x[0].view(), x[0].view(), l[0].view()),
                           doctest::Contains("num_chunks()"), std::invalid_argument);
    });
  }

  TEST_CASE(
      "ChunkedAttention refuses, before any message of a chunk, a prefix no chunk holds and a world of another size") {
    const DocumentBatch batch({{50, 10}});
    // Chunk 0: tokens [30, 50) reading prefix [0, 30) that no chunk holds; chunk 1: [50, 60).
    std::vector<Chunk> chunks{{DocumentBatch({{20}}), {Range{30, 50}}, {Range{0, 30}}, ChunkKind::kSplit, 0},
                              {DocumentBatch({{10}}), {Range{50, 60}}, {Range{50, 50}}, ChunkKind::kBatched, 0}};
    std::vector<std::string> errors(2);
    std::mutex mu;
    try {
      backend::inproc::World(2, {.timeout = std::chrono::milliseconds(5000)}).run([&](backend::inproc::Transport& t) {
        DistributedAttention<Strategy<partition::Uniform, comm::AllToAll>, attention::Reference<double>> attn(
            t, {2, 2, 8});
        runtime::ChunkedAttention<attention::Reference<double>> chunked(attn);
        try {
          chunked.begin(t.rank() == 0 ? chunks : std::vector<Chunk>{chunks[1]});
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          errors[static_cast<std::size_t>(t.rank())] = e.what();
          throw;
        }
      });
    } catch (const std::exception&) {
    }
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CHECK(errors[0].find("chunks[0].prefix[0]") != std::string::npos);  // rank 0 names its bad argument
    CHECK(errors[0].find("no chunk holds") != std::string::npos);
    CHECK(errors[1].find("rank 0 refused its chunks") != std::string::npos);  // rank 1: its peer failed
  }

  TEST_CASE("ChunkCarry refuses a prefix that only a later chunk holds (chunks run in the given order)") {
    // Chunk 0 = the document's second half reading the first half as prefix; chunk 1 = the first half.
    // Every prefix row is some chunk's token, but its forward would run after the reader's.
    const std::vector<Chunk> chunks{{DocumentBatch({{20}}), {Range{20, 40}}, {Range{0, 20}}, ChunkKind::kSplit, 0},
                                    {DocumentBatch({{20}}), {Range{0, 20}}, {Range{0, 0}}, ChunkKind::kSplit, 0}};
    const auto owned = [](const std::vector<Chunk>& cs) {
      std::vector<std::vector<std::vector<Range>>> o;
      for (const Chunk& c : cs) o.push_back({c.tokens});  // one rank holds every row
      return o;
    };
    CHECK_THROWS_WITH_AS(comm::ChunkCarry(chunks, owned(chunks), AttentionShape{2, 2, 8}),
                         doctest::Contains("chunks[0].prefix[0] = [0, 20): reads tokens that only a later chunk holds"),
                         std::invalid_argument);
    const std::vector<Chunk> in_order{chunks[1], chunks[0]};
    CHECK_NOTHROW(comm::ChunkCarry(in_order, owned(in_order), AttentionShape{2, 2, 8}));
  }

  TEST_CASE("ChunkedAttention: ranks that run different chunks of the same shape fail with a mismatch") {
    const DocumentBatch batch({{12, 12}});  // two chunks of one 12-token document each: the same shape
    const auto chunks =
        schedule::DynamicChunk{{.token_capacity = 12, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch);
    REQUIRE(chunks.size() == 2);
    REQUIRE(chunks[0].batch.cu_seqlens().size() == chunks[1].batch.cu_seqlens().size());
    std::vector<std::string> errors(2);
    std::mutex mu;
    try {
      backend::inproc::World(2, {.timeout = std::chrono::milliseconds(5000)}).run([&](backend::inproc::Transport& t) {
        DistributedAttention<Strategy<partition::Uniform, comm::AllToAll>, attention::Reference<double>> attn(
            t, {2, 2, 8});
        runtime::ChunkedAttention<attention::Reference<double>> chunked(attn);
        chunked.begin(chunks);
        const int c = t.rank();  // rank 0 runs chunk 0, rank 1 chunk 1
        ThdTensor<double> x(chunked.local_tokens(c), 2, 8), o(chunked.local_tokens(c), 2, 8);
        LseTensor<double> l(2, chunked.local_tokens(c));
        try {
          chunked.forward(c, x.view(), x.view(), x.view(), o.view(), l.view());
        } catch (const Error& e) {
          std::lock_guard lock(mu);
          errors[static_cast<std::size_t>(t.rank())] = e.what();
          throw;
        }
      });
    } catch (const std::exception&) {
    }
    for (const std::string& e : errors) {
      CAPTURE(e);
      CHECK(e.find("disagree on the chunk of the call") != std::string::npos);
    }
  }

  TEST_CASE("ChunkedAttention: a failure in a prefix program names the chunk, the pass and the step") {
    const DocumentBatch batch({{90, 5, 7}});
    const auto chunks =
        schedule::DynamicChunk{{.token_capacity = 40, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch);
    int with_prefix = -1;
    for (std::size_t c = 0; c < chunks.size() && with_prefix < 0; ++c)
      for (const Range& p : chunks[c].prefix)
        if (!p.empty()) with_prefix = static_cast<int>(c);
    REQUIRE(with_prefix > 0);
    std::string message;
    std::mutex mu;
    try {
      backend::inproc::World(2, {.timeout = std::chrono::milliseconds(5000)}).run([&](backend::inproc::Transport& t) {
        const AttentionShape shape{2, 2, 8};
        FailingPrefixKernel k;  // fails on the ranks holding queries of a piece with a prefix
        k.fail = true;
        DistributedAttention<Strategy<partition::Uniform, comm::AllToAll>, FailingPrefixKernel> attn(t, shape, {}, k);
        runtime::ChunkedAttention<FailingPrefixKernel> chunked(attn);
        chunked.begin(chunks);
        std::vector<ThdTensor<double>> x, o;
        std::vector<LseTensor<double>> l;
        for (int c = 0; c < chunked.num_chunks(); ++c) {
          x.emplace_back(chunked.local_tokens(c), 2, 8);
          o.emplace_back(chunked.local_tokens(c), 2, 8);
          l.emplace_back(2, chunked.local_tokens(c));
        }
        try {
          for (int c = 0; c < chunked.num_chunks(); ++c) {
            const auto i = static_cast<std::size_t>(c);
            chunked.forward(c, x[i].view(), x[i].view(), x[i].view(), o[i].view(), l[i].view());
          }
        } catch (const Error& e) {
          if (std::string(e.what()).find("injected") != std::string::npos) {
            std::lock_guard lock(mu);
            message = e.what();
          }
          throw;
        }
      });
    } catch (const std::exception&) {
    }
    CAPTURE(message);
    CHECK(message.find("chunk " + std::to_string(with_prefix) + " (prefix forward)") != std::string::npos);
    CHECK(message.find(", step ") != std::string::npos);
    CHECK(message.find("(compute)") != std::string::npos);
    CHECK(message.find("injected kernel fault") != std::string::npos);
  }

  TEST_CASE("ChunkedAttention over every strategy equals attention over the whole batch (fp64, 1..8 ranks)") {
    int runs = 0;
    std::uint64_t prefix_bytes = 0;
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      typename S::Arguments args = C::arguments();
      for (int world : {1, 2, 3, 4, 6, 8}) {
        const std::int64_t cap = 24 + 4 * world;
        const DocumentBatch batch = long_tail_batch(1 + world % 3, cap, 7u * static_cast<unsigned>(world) + 3u);
        schedule::DynamicChunk sched;
        sched.args.token_capacity = cap;
        sched.args.slices = 2 + (world + static_cast<int>(C::name().size())) % 7;  // 2..8 ways
        // The longest document may need more slices than asked to fit the capacity.
        try {
          (void)sched.plan(batch);
        } catch (const std::invalid_argument&) {
          sched.args.slices = 0;
        }
        const schedule::ChunkPlan plan = sched.plan(batch);
        const auto& chunks = plan.chunks;
        // Even worlds: all forwards, then all backwards in reverse. Odd: the first stage's 1F1B order of
        // a 3-stage pipeline, split documents backward last slice first (schedule::backward_order).
        std::vector<int> all(chunks.size());
        std::iota(all.begin(), all.end(), 0);
        std::vector<schedule::StageOp> ops;
        if (world % 2 == 0) {
          for (int c : all) ops.push_back({false, c});
          for (auto it = all.rbegin(); it != all.rend(); ++it) ops.push_back({true, *it});
        } else {
          ops = schedule::one_f_one_b(schedule::backward_order(plan, all), 3)[0];
        }
        const AttentionShape shape = world % 2 == 0 ? AttentionShape{4, 2, 8} : AttentionShape{2, 2, 8};
        args.ranks_per_node = world >= 4 ? world / 2 : world;
        bool ok = true;
        for (const auto& ch : chunks)
          ok = ok && S::can_implement(args, ch.batch, shape, Topology{world, args.ranks_per_node}).ok;
        if (!ok) continue;  // refusals are the strategy tests' business
        INFO(C::name() << ": world " << world << ", " << chunks.size() << " chunks, " << batch.documents().size()
                       << " documents");
        const auto err = test::distributed_check<attention::Reference<double>>(
            batch, chunks, ops, shape, world,
            [&](backend::inproc::Transport& t)
                -> std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>> {
              return std::make_unique<DistributedAttention<S, attention::Reference<double>>>(t, shape, args);
            },
            11u * static_cast<unsigned>(world));
        CHECK(err.max() < 1e-9);
        CHECK(err.bytes_match);  // each call's transport count equals what its prefix program declares
        prefix_bytes += err.bytes_forward + err.bytes_backward;
        ++runs;
      }
    });
    CHECK(runs > 100);
    CHECK(prefix_bytes > 0);  // the prefix carry moved bytes
  }
}
