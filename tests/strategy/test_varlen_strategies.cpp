// SPDX-License-Identifier: Apache-2.0
// The torch-flash kernel's slice-to-varlen-call mapping under the real engine (issue 38): every
// partitioner x communicator combination of tests/support/strategy_list.hpp runs DistributedAttention on
// the in-process world with test::VarlenStandin as every rank's kernel (the mapping of
// attention/detail/varlen_calls.hpp executed by an fp64 stand-in of FlashAttention's varlen call,
// tests/support/varlen_standin.hpp), forward and backward against the fp64 reference over the whole
// batch: worlds 1-8, causal and
// sliding windows, MHA and GQA, random lognormal document mixes and runs of length-1 documents. So every
// strategy's slice tables (ring steps, all-gather blocks, Ulysses head groups, windows clipped at shard
// edges) reach the mapping on the CPU. Under a sanitizer the sweep visits the sanitizer diagonal only.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"
#include "support/varlen_standin.hpp"

using namespace seqpar;

namespace {

// The stand-in rounds its LSE to float, as FA returns it; the engine merges partial results with it, so
// outputs and gradients carry that rounding (~1e-7 relative); everything else is fp64.
constexpr double kVarlenTolerance = 1e-5;

// Small batches: the stand-in is naive fp64 attention, and 49 combinations x 8 worlds x 2 masks run (~3 s).
DocumentBatch varlen_batch(int sequences, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    const std::int64_t tokens = 30 + 11 * b + static_cast<std::int64_t>(rng() % 13);
    std::vector<std::int64_t> docs = test::lognormal_docs(tokens, 6.0, 1.0, rng);
    if (b == 0) docs.insert(docs.begin(), 3, 1);  // length-1 documents in every batch
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

void check_varlen_errors(const test::Errors& err) {
  CHECK(err.o < kVarlenTolerance);
  CHECK(err.lse < kVarlenTolerance);
  CHECK(err.dq < kVarlenTolerance);
  CHECK(err.dk < kVarlenTolerance);
  CHECK(err.dv < kVarlenTolerance);
  CHECK(err.bytes_match);
}

int varlen_combination_index = 0;
int varlen_world_runs = 0;  // (combination, world) pairs that ran, over the sweep

template <class Combination>
void check_varlen_combination(Combination) {
  using S = typename Combination::strategy;
  const std::string name = Combination::name();
  const int index = varlen_combination_index++;
  typename S::Arguments args = Combination::arguments();
  int accepted = 0;
  for (int world = 1; world <= 8; ++world) {
    const AttentionShape shape = (index + world) % 2 == 0 ? AttentionShape{4, 4, 8} : AttentionShape{6, 2, 8};
    const DocumentBatch batch = varlen_batch(1 + (index + world) % 3, 97u * static_cast<unsigned>(index) + 13u);
    args.ranks_per_node = world >= 4 ? world / 2 : world;
    const Topology topo{world, args.ranks_per_node};
    INFO(name << ": world " << world << ", " << batch.documents().size() << " documents, heads " << shape.heads_q << ":"
              << shape.heads_kv);
    if (!S::can_implement(args, batch, shape, topo).ok) continue;
    ++accepted;
    ++varlen_world_runs;
    check_varlen_errors(test::check_strategy<S, test::VarlenStandin>(batch, shape, world, args));
    const std::int64_t windows[] = {1, 2, 3, 5, 9, 17, 40};  // 40: longer than most shards and documents
    const AttentionMask window{windows[(index + world) % 7]};
    INFO("window " << window.window);
    auto wargs = args;
    wargs.masks = MaskMix::only(window);
    if (!S::can_implement(wargs, batch, shape, topo, window).ok) continue;
    check_varlen_errors(test::check_strategy<S, test::VarlenStandin>({batch, window}, shape, world, wargs));
  }
  MESSAGE(name << ": " << accepted << " of 8 world sizes run");
  // WholeDoc keeps documents whole within a token capacity and refuses most worlds of these small batches with
  // long documents; the other partitioners run nearly every world.
  CHECK(accepted >= 2);
}

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("VarlenStandin (the torch-flash mapping on the CPU): every combination against fp64, worlds 1-8") {
    test::for_each_combination([](auto combination) { check_varlen_combination(combination); });
    CHECK(varlen_world_runs >= 5 * static_cast<int>(test::kNumSweptCombinations));  // ~7.5 per combination here
  }
}
