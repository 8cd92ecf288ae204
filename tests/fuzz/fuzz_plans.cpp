// SPDX-License-Identifier: Apache-2.0
// Randomized checking of partitioners and program compilation, bounded in time.
//
// Draws random packed batches (1 to 4 sequences, lognormal / long-tail / tiny documents), world
// sizes 1 to 12, ranks per node, head shapes and every partitioner x communicator configuration of
// tests/support/strategy_list.hpp, and checks on the compiled programs of all ranks, without moving data:
//  - the plan's invariants (every token owned exactly once, slices inside owned tokens, slice area =
//    the batch's document-causal area);
//  - can_implement either accepts, or refuses with a reason, never crashes;
//  - compute coverage: over all ranks, (query, key) pairs x query heads computed = causal area x Hq
//    (every pair of every head computed exactly once);
//  - byte accounting: what rank r's exchange sends to p equals what p expects from r, and every
//    point-to-point send has a receive of the same size on its peer (same level group and tag);
//  - every compute step's slices are valid for its buffers (disjoint queries, in range).
// Exits non-zero on the first violation, printing the seed that reproduces it.
//   fuzz_plans [--seconds S] [--seed N] [--replay A,B,...]
#include <seqpar/core/overloaded.hpp>
#include <seqpar/seqpar.hpp>

#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "fuzz_driver.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void expect(bool ok, const std::string& what) {
  if (!ok) throw Failure(what);
}

DocumentBatch random_batch(std::mt19937& rng) {
  const int sequences = 1 + static_cast<int>(rng() % 4);
  const int kind = static_cast<int>(rng() % 3);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    const std::int64_t tokens = 1 + static_cast<std::int64_t>(rng() % 300);
    std::vector<std::int64_t> docs;
    std::lognormal_distribution<double> lognormal(std::log(kind == 2 ? 2.0 : 12.0), 1.0);
    for (std::int64_t left = tokens; left > 0;) {
      std::int64_t len = std::max<std::int64_t>(1, static_cast<std::int64_t>(lognormal(rng)));
      if (kind == 1 && rng() % 5 == 0) len = left;  // long tail: a document to the end
      len = std::min(len, left);
      docs.push_back(len);
      left -= len;
    }
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

template <class S>
void check(const std::string& name, const DocumentBatch& batch, const AttentionShape& shape, int world,
           typename S::Arguments args) {
  const Topology topo{world, args.ranks_per_node};
  const Status status = S::can_implement(args, batch, shape, topo);
  if (!status.ok) {
    expect(!status.reason.empty(), name + ": refused without a reason");
    return;
  }
  const typename S::partitioner_type partitioner{args.partition};
  const typename S::communicator_type communicator{args.comm};
  const ShardPlan plan = partitioner.plan(batch, topo);
  plan.check_invariants(batch);
  std::vector<comm::CompiledAttention> programs;
  for (int r = 0; r < world; ++r) programs.push_back(communicator.compile(plan, shape, r));
  for (int pass = 0; pass < 2; ++pass) {
    std::int64_t pairs = 0;
    // (level members, tag, from, to) -> bytes sent / expected
    std::map<std::tuple<std::vector<int>, int, int, int>, std::int64_t> sent, expected;
    std::vector<std::vector<const comm::ExchangeStep*>> exchanges(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) {
      const comm::Program& p =
          pass == 0 ? programs[static_cast<std::size_t>(r)].forward : programs[static_cast<std::size_t>(r)].backward;
      pairs += p.head_pairs();
      // Bytes as the executor and the replay count them (2-byte values, 4-byte LSE).
      const auto bytes_of = [&](comm::BufferId b, const comm::Piece& piece) {
        return static_cast<std::int64_t>(comm::piece_bytes(b, piece, p.widths(), 2, 4));
      };
      for (const comm::Step& step : p.steps) {
        std::visit(
            Overloaded{[&](const comm::ComputeStep& c) {
                         for (const auto& wave : c.waves) {
                           std::int64_t q_rows = 0, k_rows = 0;
                           for (const AttnSlice& s : wave)
                             q_rows = std::max(q_rows, s.q_range.end), k_rows = std::max(k_rows, s.k_range.end);
                           validate_slices(wave, q_rows, k_rows, name.c_str());
                         }
                       },
                       [&](const comm::PostStep& post) {
                         const auto& members = p.level_members[static_cast<std::size_t>(post.level)];
                         const int me =
                             static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
                         for (const comm::Transfer& t : post.sends) {
                           std::int64_t n = 0;
                           for (const auto& bp : t.pieces) n += bytes_of(bp.buffer, bp.piece);
                           sent[{members, post.tag, me, t.peer}] += n;
                         }
                         for (const comm::Transfer& t : post.recvs) {
                           std::int64_t n = 0;
                           for (const auto& bp : t.pieces) n += bytes_of(bp.buffer, bp.piece);
                           expected[{members, post.tag, t.peer, me}] += n;
                         }
                       },
                       [&](const comm::ExchangeStep& ex) {
                         exchanges[static_cast<std::size_t>(r)].push_back(&ex);
                         const auto& members = p.level_members[static_cast<std::size_t>(ex.level)];
                         for (const comm::Move& m : ex.moves)
                           for (std::size_t peer = 0; peer < m.send.size(); ++peer) {
                             std::int64_t sb = 0, eb = 0;
                             for (const auto& piece : m.send[peer]) sb += bytes_of(m.src, piece);
                             for (const auto& piece : m.recv[peer]) eb += bytes_of(m.dst, piece);
                             sent[{members, -1 - static_cast<int>(m.src), ex.self, static_cast<int>(peer)}] += sb;
                             expected[{members, -1 - static_cast<int>(m.src), static_cast<int>(peer), ex.self}] += eb;
                           }
                       },
                       [](const comm::ZeroStep&) {}, [](const comm::WaitStep&) {}, [](const comm::CopyStep&) {}},
            step);
      }
    }
    expect(pairs == batch.causal_area() * shape.heads_q,
           name + ": computed " + std::to_string(pairs) + " head-pairs, expected " +
               std::to_string(batch.causal_area() * shape.heads_q) + (pass ? " (backward)" : " (forward)"));
    expect(sent == expected, name + ": bytes sent and bytes expected differ between peers");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const test::FuzzRun run = test::run_fuzz(argc, argv, [](std::mt19937& rng) {
    const DocumentBatch batch = random_batch(rng);
    const int world = 1 + static_cast<int>(rng() % 12);
    const int rpn = 1 + static_cast<int>(rng() % static_cast<std::uint32_t>(world));
    const int hkv = 1 + static_cast<int>(rng() % 4);
    const AttentionShape shape{hkv * (1 + static_cast<int>(rng() % 3)), hkv, 8};
    try {
      test::for_each_combination([&]<class C>(C) {
        typename C::strategy::Arguments args = C::arguments();
        args.ranks_per_node = rpn;
        check<typename C::strategy>(C::name(), batch, shape, world, args);
      });
    } catch (const std::exception& e) {
      throw std::runtime_error("world " + std::to_string(world) + ", " + std::to_string(rpn) + " per node, heads " +
                               std::to_string(shape.heads_q) + ":" + std::to_string(shape.heads_kv) + ", " +
                               std::to_string(batch.documents().size()) + " documents: " + e.what());
    }
  });
  if (run.status != 0) return run.status;
  std::printf(
      "fuzz_plans: %ld random batches x %zu partitioners x %zu communicator configurations checked in %.0f s "
      "(%s)\n",
      run.cases, test::kNumPartitioners, test::kNumCommunicators, run.seconds, run.seeds().c_str());
  return run.cases > 0 ? 0 : 1;
}
