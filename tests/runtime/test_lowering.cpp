// SPDX-License-Identifier: Apache-2.0
// runtime::lower: the flat tables a program becomes. Bytes the tables move equal the bytes the program
// declares; every op reads only what the caller gave or an earlier op wrote (the declared accesses are
// what a two-stream executor will order by); posts and waits pair up; workspace regions do not overlap;
// a kernel call's slices have disjoint query rows.
#include <doctest/doctest.h>

#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <random>
#include <string>
#include <variant>
#include <vector>

using namespace seqpar;
using namespace seqpar::runtime;

namespace {

DocumentBatch lowering_batch(std::mt19937& rng) {
  std::vector<std::vector<std::int64_t>> seqs;
  const int sequences = std::uniform_int_distribution<int>(1, 3)(rng);
  for (int s = 0; s < sequences; ++s) {
    std::vector<std::int64_t> docs;
    const int n = std::uniform_int_distribution<int>(1, 6)(rng);
    for (int i = 0; i < n; ++i) docs.push_back(std::uniform_int_distribution<std::int64_t>(1, 120)(rng));
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

constexpr std::uint64_t bit(BufferId b) {
  return access::bit(b);
}

/// Checks one lowered program; `inputs` are the buffers the caller provides.
void check_lowered(const comm::Program& program, std::uint64_t inputs) {
  const LoweredProgram lp =
      lower(program, sizeof(float), sizeof(float),
            [](const AttentionShape&, std::int64_t q, std::int64_t k) { return static_cast<std::uint64_t>(q + k); });
  // Bytes sent to other ranks.
  std::uint64_t sent = 0;
  std::uint64_t written = inputs;
  std::array<bool, comm::kNumSlots> posted{};
  for (const LoweredOp& op : lp.ops) {
    CAPTURE(op.kind);
    CAPTURE(op.step);
    const std::uint64_t buffers_read = op.access.reads & ((std::uint64_t{1} << comm::kNumBuffers) - 1);
    // Message regions are written and read inside one op (exchange) or between a post and its wait.
    CHECK((buffers_read & ~written) == 0);
    written |= op.access.writes;
    std::visit(
        Overloaded{[&](const ExchangeOp& ex) {
                     const auto counts = lp.view(lp.counts, ex.send_counts);
                     const int self = std::get<comm::ExchangeStep>(program.steps[op.step]).self;
                     std::uint64_t total = 0;
                     for (std::size_t p = 0; p < counts.size(); ++p) {
                       total += counts[p];
                       if (static_cast<int>(p) != self) sent += counts[p];
                     }
                     CHECK(total == ex.send_bytes);
                     CHECK(ex.send_bytes <= lp.layout.pack_send_bytes);
                     CHECK(ex.recv_bytes <= lp.layout.pack_recv_bytes);
                   },
                   [&](const PostOp& post) {
                     CHECK_FALSE(posted[static_cast<std::size_t>(post.slot)]);
                     posted[static_cast<std::size_t>(post.slot)] = true;
                     for (const TransferEntry& t : lp.view(lp.transfers, post.sends)) {
                       sent += t.bytes;
                       CHECK(t.offset + t.bytes <= lp.layout.slot_send_bytes[static_cast<std::size_t>(post.slot)]);
                     }
                   },
                   [&](const WaitOp& w) {
                     CHECK(posted[static_cast<std::size_t>(w.slot)]);
                     posted[static_cast<std::size_t>(w.slot)] = false;
                   },
                   [&](const AttentionOp& a) {
                     const auto slices = lp.view(lp.slices, a.slices);
                     CHECK_NOTHROW(validate_slices(slices, 1 << 30, 1 << 30, "test"));
                     if (!a.backward) CHECK((op.access.writes & (bit(a.o) | bit(BufferId::kOPart))) != 0);
                   },
                   [&](const MergeOp&) { CHECK((op.access.reads & bit(BufferId::kOPart)) != 0); }, [](const ZeroOp&) {},
                   [](const FillEmptyOp&) {},
                   [&](const CopyOp& c) {
                     CHECK(c.bytes <= lp.layout.pack_send_bytes);
                     CHECK(c.pack.count > 0);
                     CHECK(c.unpack.count > 0);
                   }},
        op.op);
  }
  for (bool p : posted) CHECK_FALSE(p);  // every post waited for
  CHECK(sent == program.bytes_sent(sizeof(float), sizeof(float)));
  // Regions in order and disjoint.
  const WorkspaceLayout& l = lp.layout;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> regions{
      {l.pack_send, l.pack_send_bytes}, {l.pack_recv, l.pack_recv_bytes}, {l.kernel, l.kernel_bytes}};
  for (int s = 0; s < comm::kNumSlots; ++s) {
    regions.push_back({l.slot_send[static_cast<std::size_t>(s)], l.slot_send_bytes[static_cast<std::size_t>(s)]});
    regions.push_back({l.slot_recv[static_cast<std::size_t>(s)], l.slot_recv_bytes[static_cast<std::size_t>(s)]});
  }
  for (const comm::BufferSpec& s : lp.staging)
    regions.push_back({l.staging[static_cast<std::size_t>(s.id)],
                       static_cast<std::uint64_t>(s.rows) * static_cast<std::uint64_t>(s.heads) *
                           (comm::is_lse(s.id) ? 1u : static_cast<std::uint64_t>(lp.widths().of(s.id))) *
                           sizeof(float)});
  std::sort(regions.begin(), regions.end());
  for (std::size_t i = 1; i < regions.size(); ++i)
    CHECK(regions[i - 1].first + regions[i - 1].second <= regions[i].first);
  CHECK(regions.back().first + regions.back().second <= l.total);
}

template <class S>
void check_strategy_lowering(std::mt19937& rng, typename S::Arguments args = {}) {
  for (int trial = 0; trial < 6; ++trial) {
    const DocumentBatch batch = lowering_batch(rng);
    const int world = std::uniform_int_distribution<int>(1, 8)(rng);
    const AttentionShape shape{8, 4, 16};
    const Topology topo{world, args.ranks_per_node == 0 ? world : args.ranks_per_node};
    const auto planned = S::plan(args, batch, shape, topo);
    if (!planned.status) continue;
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const comm::CompiledAttention c = S::compile(args, planned.plan, shape, r);
      using B = BufferId;
      check_lowered(c.forward, bit(B::kQ) | bit(B::kK) | bit(B::kV));
      check_lowered(c.backward, bit(B::kQ) | bit(B::kK) | bit(B::kV) | bit(B::kO) | bit(B::kLse) | bit(B::kDout));
    }
  }
}

// The prefix-carry programs of a chunked run (comm::ChunkCarry) on every rank: the caller binds its
// chunk tensors and the carry buffers.
void check_carry_lowering(std::mt19937& rng) {
  using B = BufferId;
  const std::uint64_t carry = bit(B::kKCarry) | bit(B::kVCarry) | bit(B::kDkCarry) | bit(B::kDvCarry);
  const std::uint64_t forward_in = bit(B::kQ) | bit(B::kK) | bit(B::kV) | bit(B::kO) | bit(B::kLse) | carry;
  const std::uint64_t backward_in = forward_in | bit(B::kDout) | bit(B::kDq) | bit(B::kDk) | bit(B::kDv);
  for (int trial = 0; trial < 20; ++trial) {
    const DocumentBatch batch({{std::uniform_int_distribution<std::int64_t>(60, 200)(rng), 5, 9}, {31, 2}});
    const auto chunks =
        schedule::DynamicChunk{{.token_capacity = 48, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch);
    const int world = std::uniform_int_distribution<int>(1, 6)(rng);
    const AttentionShape shape{4, 2, 8};
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const Topology topo{world, world};
    std::vector<std::vector<std::vector<Range>>> owned;
    for (const Chunk& ch : chunks) {
      const auto planned = S::plan({}, ch.batch, shape, topo);
      REQUIRE(planned.status);
      owned.emplace_back();
      for (int r = 0; r < world; ++r)
        owned.back().push_back(comm::ChunkCarry::to_global(ch, planned.plan.owned[static_cast<std::size_t>(r)]));
    }
    const comm::ChunkCarry cc(chunks, owned, shape);
    std::int64_t declared = 0;
    for (int c = 0; c < cc.num_chunks(); ++c)
      for (int r = 0; r < world; ++r) {
        CAPTURE(c);
        CAPTURE(r);
        check_lowered(cc.forward(c, r, true), forward_in);
        check_lowered(cc.forward(c, r, false), forward_in);
        check_lowered(cc.backward(c, r), backward_in);
        declared += static_cast<std::int64_t>(cc.forward(c, r, true).bytes_sent(4, 4));
      }
    if (world > 1) CHECK(declared > 0);  // a split document's prefix crosses ranks
  }
}

}  // namespace

TEST_SUITE("runtime") {
  TEST_CASE("lowered prefix-carry programs of chunked runs: bytes, accesses, local copies") {
    std::mt19937 rng(5);
    check_carry_lowering(rng);
  }

  TEST_CASE("lowered programs: bytes, accesses, post/wait pairs, workspace regions") {
    std::mt19937 rng(11);
    using partition::Uniform, partition::Zigzag, partition::PerDoc, partition::Hybrid, partition::WholeDoc;
    check_strategy_lowering<Strategy<Uniform, comm::AllToAll>>(rng);
    check_strategy_lowering<Strategy<Zigzag, comm::Ring>>(rng);
    Strategy<PerDoc, comm::Ring>::Arguments aware;
    aware.comm.sharding_aware = true;
    check_strategy_lowering<Strategy<PerDoc, comm::Ring>>(rng, aware);
    Strategy<Hybrid, comm::AllGather>::Arguments gather;
    gather.comm.sharding_aware = true;
    check_strategy_lowering<Strategy<Hybrid, comm::AllGather>>(rng, gather);
    using Hier = comm::Hierarchical<comm::AllToAll, comm::Ring>;
    Strategy<WholeDoc, Hier>::Arguments hier;
    hier.ranks_per_node = 2;
    check_strategy_lowering<Strategy<WholeDoc, Hier>>(rng, hier);
  }

  TEST_CASE("Strategy's default step order is the compiled order") {
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    static_assert(std::is_same_v<Ulysses::step_order_type, runtime::StaticOrder>);
    static_assert(std::is_same_v<Strategy<partition::Uniform, comm::AllToAll, runtime::StaticOrder>, Ulysses>);
    const DocumentBatch batch = DocumentBatch::single({40, 24});
    const auto compiled = Ulysses::compile({}, batch, {4, 4, 8}, {2, 2}, 0);
    REQUIRE(compiled.status);
    const auto unordered = comm::AllToAll{}.compile(compiled.plan, {4, 4, 8}, 0);
    CHECK(compiled.program.forward.steps.size() == unordered.forward.steps.size());
    CHECK(schedule::Static{}.chunks(batch).size() == 1);
    CHECK(schedule::Static{}.chunks(batch)[0].tokens == std::vector<Range>{{0, 64}});
  }

  TEST_CASE("Strategy::compile reports a refusal instead of throwing") {
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    const auto c = Ulysses::compile({}, DocumentBatch::single({64}), {4, 4, 8}, {8, 8}, 0);  // 4 heads, 8 ranks
    CHECK_FALSE(c.status);
    CHECK(std::string(c.refused_by) == "communicator refuses the plan");
    CHECK(c.status.reason.find("heads_q = 4") != std::string::npos);
  }
}
