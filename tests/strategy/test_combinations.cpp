// SPDX-License-Identifier: Apache-2.0
// Every partitioner x communicator combination (tests/support/strategy_list.hpp), forward and
// backward against the fp64 reference
// on the unsharded batch, on world sizes 1..8, micro-batches of 1..4 sequences of unequal length,
// lognormal and long-tail document mixes, MHA and GQA. Combinations that can_implement refuses are
// checked to be refused with a reason, and to throw before any communication.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <random>
#include <stdexcept>
#include <string>

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
}
