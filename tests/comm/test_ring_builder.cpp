// SPDX-License-Identifier: Apache-2.0
// The ring's schedule and program pieces (seqpar/comm/detail/ring_builder.hpp), plain and
// sharding-aware, on seeded random rings: members owning random token pieces in random order (some
// owning nothing), slices of packed causal documents or of arbitrary masks. Checked: whose KV each
// member holds at each step (every (member, source) pair once), the key sets against keys_needed,
// every visible pair computed exactly once over the steps, and that every KV and dK/dV transfer
// carries the same global tokens on both ends.
#include <doctest/doctest.h>

#include <seqpar/comm/detail/ring_builder.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <variant>
#include <vector>

#include "comm/brute_force.hpp"

using namespace seqpar;
using comm::BufferId;
using comm::detail::RingSchedule;
using comm::detail::RingSpec;

namespace {

// Causal slices of packed documents `docs` (consecutive ranges covering the tokens) whose queries
// are the member's tokens `mine`.
std::vector<AttnSlice> document_slices(const std::vector<Range>& mine, const std::vector<Range>& docs) {
  std::vector<AttnSlice> out;
  for (const Range& r : mine)
    for (const Range& d : docs) {
      const Range q = intersect(r, d);
      if (!q.empty()) out.push_back({q, {d.begin, q.end}, Mask::causal(q.begin - d.begin)});
    }
  return out;
}

// A ring of k members over n tokens: every token owned by exactly one member.
RingSpec random_spec(std::mt19937& rng, int k, bool aware) {
  const std::int64_t n = test::uniform(rng, 1, 36);
  RingSpec spec;
  spec.tokens.resize(static_cast<std::size_t>(k));
  for (const Range& piece : test::random_cuts(rng, n, 1 + n / 4))
    spec.tokens[static_cast<std::size_t>(test::uniform(rng, 0, k - 1))].push_back(piece);
  for (auto& mine : spec.tokens)
    if (rng() % 2 == 0) std::shuffle(mine.begin(), mine.end(), rng);
  if (rng() % 2 == 0) {  // packed causal documents
    const std::vector<Range> docs = test::random_cuts(rng, n, 12);
    for (const auto& mine : spec.tokens) spec.slices.push_back(document_slices(mine, docs));
  } else {  // arbitrary slices, cut to each member's queries
    std::vector<AttnSlice> global;
    for (int i = static_cast<int>(test::uniform(rng, 1, 4)); i > 0; --i) global.push_back(test::random_slice(rng, n));
    for (const auto& mine : spec.tokens) {
      std::vector<AttnSlice> member;
      for (const AttnSlice& g : global)
        for (const Range& r : mine)
          if (const AttnSlice c = clip_slice(g, r, {0, n}); !c.q_range.empty()) member.push_back(c);
      spec.slices.push_back(std::move(member));
    }
  }
  spec.sharding_aware = aware;
  spec.q_heads = 4;
  spec.kv_heads = 2;
  spec.head_groups = {comm::HeadGroup{{0, 4}, {0, 2}}};
  return spec;
}

std::vector<Range> nonempty(const std::vector<Range>& v) {
  std::vector<Range> out;
  std::copy_if(v.begin(), v.end(), std::back_inserter(out), [](Range r) { return !r.empty(); });
  return out;
}

// Global tokens of the pieces of `t` in buffer `b`, through that buffer's row -> token table.
std::vector<std::int64_t> piece_tokens(const comm::Transfer& t, BufferId b, const std::vector<std::int64_t>& table) {
  std::vector<std::int64_t> out;
  for (const comm::BufferPiece& bp : t.pieces) {
    if (bp.buffer != b) continue;
    for (std::int64_t row = bp.piece.rows.begin; row < bp.piece.rows.end; ++row)
      out.push_back(row >= 0 && row < static_cast<std::int64_t>(table.size()) ? table[static_cast<std::size_t>(row)]
                                                                              : -1);
  }
  return out;
}

// Every piece of t is in buffer k or v and spans the KV heads.
bool only_kv_pieces(const comm::Transfer& t, BufferId k, BufferId v, int kv_heads) {
  return std::all_of(t.pieces.begin(), t.pieces.end(), [&](const comm::BufferPiece& bp) {
    return (bp.buffer == k || bp.buffer == v) && bp.piece.heads == Range{0, kv_heads} && !bp.piece.rows.empty();
  });
}

const comm::Transfer* with_peer(const std::vector<comm::Transfer>& ts, int peer) {
  for (const auto& t : ts)
    if (t.peer == peer) return &t;
  return nullptr;
}

std::int64_t compute_area(const comm::Program& p) {
  std::int64_t a = 0;
  for (const comm::Step& s : p.steps)
    if (const auto* c = std::get_if<comm::ComputeStep>(&s)) a += c->area();
  return a;
}

// All checks on one ring; returns the number of (member, step) pairs whose compute was non-empty.
int check_ring(const RingSpec& base) {
  const int k = base.size();
  std::vector<RingSpec> specs(static_cast<std::size_t>(k), base);
  for (int m = 0; m < k; ++m) specs[static_cast<std::size_t>(m)].me = m;
  std::vector<RingSchedule> sched;
  sched.reserve(specs.size());
  for (const RingSpec& s : specs) sched.emplace_back(s);
  const auto S = [&](int m) -> const RingSchedule& { return sched[static_cast<std::size_t>(m)]; };
  const auto tokens = [&](int m) { return base.tokens[static_cast<std::size_t>(m)]; };
  const auto slices = [&](int m) { return base.slices[static_cast<std::size_t>(m)]; };
  int busy = 0;

  // Owners: member m holds its own KV at step 0 and every other member's at exactly one step; at
  // every step each member's KV is held by exactly one member.
  for (int m = 0; m < k; ++m) {
    std::vector<int> sources;
    for (int s = 0; s < k; ++s) sources.push_back(S(0).owner(m, s));
    CHECK(sources[0] == m);
    std::sort(sources.begin(), sources.end());
    std::vector<int> all(static_cast<std::size_t>(k));
    std::iota(all.begin(), all.end(), 0);
    CHECK(sources == all);
  }
  for (int s = 0; s < k; ++s) {
    std::vector<int> holders(static_cast<std::size_t>(k), 0);
    for (int m = 0; m < k; ++m) ++holders[static_cast<std::size_t>(S(0).owner(m, s))];
    CHECK(std::all_of(holders.begin(), holders.end(), [](int h) { return h == 1; }));
  }

  for (int m = 0; m < k; ++m) {
    INFO("member " << m << " of " << k << (base.sharding_aware ? ", sharding-aware" : ", plain"));
    std::vector<test::Pair> computed;
    for (int s = 0; s < k; ++s) {
      INFO("step " << s);
      const int src = S(m).owner(m, s);
      const std::vector<Range> needed = keys_needed(slices(m), tokens(src));
      if (s > 0) {
        // Key sets: exactly what m's slices read of src (aware), or all of src's tokens (plain).
        CHECK(S(m).received(m, s) == (base.sharding_aware ? needed : nonempty(tokens(src))));
        CHECK(S(m).computes(m, s) == !needed.empty());
        // Every member answers the same for every member: sender and receiver agree without talking.
        for (int other = 0; other < k; ++other) CHECK(S(other).received(m, s) == S(m).received(m, s));
        // Plain: what m holds at step s is what its predecessor held at s - 1.
        if (!base.sharding_aware && s > 1) CHECK(S(m).received(m, s) == S(m).received((m - 1 + k) % k, s - 1));
      }
      const auto local = S(m).slices(m, s);
      busy += !local.empty();
      const auto step_pairs = test::global_pairs(local, test::tokens_of(tokens(m)),
                                                 test::tokens_of(s == 0 ? tokens(m) : S(m).received(m, s)));
      computed.insert(computed.end(), step_pairs.begin(), step_pairs.end());
    }
    // Every visible pair of m's slices computed exactly once over the k steps.
    std::sort(computed.begin(), computed.end());
    CHECK(computed == test::pair_multiset(slices(m)));

    // The programs compute the same area, forward and backward.
    comm::Program fwd, bwd;
    comm::detail::append_ring_forward(fwd, S(m));
    comm::detail::append_ring_backward(bwd, S(m));
    CHECK(compute_area(fwd) == static_cast<std::int64_t>(computed.size()));
    CHECK(compute_area(bwd) == static_cast<std::int64_t>(computed.size()));
    // Staging: ring slots hold the largest block received.
    comm::Program staged;
    comm::detail::add_ring_staging(staged, S(m), false);
    std::int64_t block = 0;
    for (int s = 1; s < k; ++s) block = std::max(block, RingSchedule::rows(S(m).received(m, s)));
    for (const auto& b : staged.staging)
      if (b.id == BufferId::kKRing0 || b.id == BufferId::kVRing1) CHECK(b.rows == block);
  }

  // KV transfers, step by step: what m sends is what its peer receives, token for token.
  const int kv = base.kv_heads;
  for (int s = 1; s < k; ++s) {
    INFO("KV post of step " << s << (base.sharding_aware ? ", sharding-aware" : ", plain"));
    std::vector<comm::PostStep> posts;
    for (int m = 0; m < k; ++m) posts.push_back(comm::detail::ring_kv_post(S(m), s));
    const BufferId rk = comm::detail::kRingK[s % 2], rv = comm::detail::kRingV[s % 2];
    for (int m = 0; m < k; ++m) {
      INFO("member " << m);
      const comm::PostStep& p = posts[static_cast<std::size_t>(m)];
      CHECK(p.slot == s % 2);
      CHECK(p.tag == base.tag_base + s);
      CHECK_FALSE(p.accumulate);
      // Receive: the block of step s, back to back in the slot.
      const std::vector<Range> in = S(m).received(m, s);
      REQUIRE(p.recvs.size() == (in.empty() ? 0u : 1u));
      if (!in.empty()) {
        const comm::Transfer& r = p.recvs[0];
        CHECK(r.peer == (base.sharding_aware ? S(m).owner(m, s) : (m - 1 + k) % k));
        CHECK(only_kv_pieces(r, rk, rv, kv));
        CHECK(piece_tokens(r, rk, test::tokens_of(in)) == test::tokens_of(in));
        CHECK(piece_tokens(r, rv, test::tokens_of(in)) == test::tokens_of(in));
      }
      // Send: to the member that holds a block of mine (aware) or my predecessor's (plain) at step s.
      const int to = base.sharding_aware ? (m + s) % k : (m + 1) % k;
      const std::vector<Range> out = S(m).received(to, s);
      REQUIRE(p.sends.size() == (out.empty() ? 0u : 1u));
      if (out.empty()) continue;
      const comm::Transfer& snd = p.sends[0];
      CHECK(snd.peer == to);
      const bool from_own = base.sharding_aware || s == 1;
      const BufferId sk = from_own ? base.k : comm::detail::kRingK[(s - 1) % 2];
      const BufferId sv = from_own ? base.v : comm::detail::kRingV[(s - 1) % 2];
      const std::vector<std::int64_t> table = test::tokens_of(from_own ? tokens(m) : S(m).received(m, s - 1));
      CHECK(only_kv_pieces(snd, sk, sv, kv));
      CHECK(piece_tokens(snd, sk, table) == test::tokens_of(out));
      CHECK(piece_tokens(snd, sv, table) == test::tokens_of(out));
      // The peer posts the matching receive.
      const comm::Transfer* match = with_peer(posts[static_cast<std::size_t>(to)].recvs, m);
      CHECK(match != nullptr);
    }
  }

  // dK, dV returns (backward): each computed block goes back to its owner, into its own rows.
  std::vector<std::vector<comm::PostStep>> returns(static_cast<std::size_t>(k));
  for (int m = 0; m < k; ++m) {
    comm::Program bwd;
    comm::detail::append_ring_backward(bwd, S(m));
    for (const comm::Step& st : bwd.steps)
      if (const auto* p = std::get_if<comm::PostStep>(&st); p && p->accumulate)
        returns[static_cast<std::size_t>(m)].push_back(*p);
    CHECK(returns[static_cast<std::size_t>(m)].size() == static_cast<std::size_t>(k - 1));
  }
  for (int s = 1; s < k; ++s)
    for (int m = 0; m < k; ++m) {
      INFO("dK/dV return of step " << s << ", member " << m << (base.sharding_aware ? ", sharding-aware" : ", plain"));
      const comm::PostStep& p = returns[static_cast<std::size_t>(m)][static_cast<std::size_t>(s - 1)];
      CHECK(p.tag == base.tag_base + k + s);
      const std::vector<Range> held = S(m).received(m, s);
      REQUIRE(p.sends.size() == (S(m).computes(m, s) ? 1u : 0u));
      if (!p.sends.empty()) {
        CHECK(p.sends[0].peer == S(m).owner(m, s));
        CHECK(only_kv_pieces(p.sends[0], BufferId::kDkPart, BufferId::kDvPart, kv));
        CHECK(piece_tokens(p.sends[0], BufferId::kDkPart, test::tokens_of(held)) == test::tokens_of(held));
        CHECK(piece_tokens(p.sends[0], BufferId::kDvPart, test::tokens_of(held)) == test::tokens_of(held));
      }
      const int holder = (m + s) % k;
      REQUIRE(p.recvs.size() == (S(holder).computes(holder, s) ? 1u : 0u));
      if (!p.recvs.empty()) {
        CHECK(p.recvs[0].peer == holder);
        CHECK(S(holder).owner(holder, s) == m);
        const std::vector<std::int64_t> mine = test::tokens_of(tokens(m));
        CHECK(only_kv_pieces(p.recvs[0], base.dk, base.dv, kv));
        CHECK(piece_tokens(p.recvs[0], base.dk, mine) == test::tokens_of(S(holder).received(holder, s)));
        CHECK(piece_tokens(p.recvs[0], base.dv, mine) == test::tokens_of(S(holder).received(holder, s)));
      }
    }
  return busy;
}

}  // namespace

TEST_SUITE("comm") {
  TEST_CASE("ring schedule: hand example, three members, two documents") {
    // Tokens [0, 4) [4, 8) [8, 12) on members 0, 1, 2; documents [0, 6) and [6, 12).
    RingSpec spec;
    spec.tokens = {{{0, 4}}, {{4, 8}}, {{8, 12}}};
    for (const auto& mine : spec.tokens) spec.slices.push_back(document_slices(mine, {{0, 6}, {6, 12}}));
    spec.kv_heads = spec.q_heads = 1;
    spec.sharding_aware = true;
    const RingSchedule aware(spec);
    CHECK(aware.owner(0, 1) == 2);
    CHECK(aware.owner(0, 2) == 1);
    CHECK(aware.received(1, 1) == std::vector<Range>{{0, 4}});  // queries [4, 6) read document [0, 6)
    CHECK(aware.received(1, 2).empty());                        // nothing of [8, 12)
    CHECK(aware.received(2, 1) == std::vector<Range>{{6, 8}});  // document [6, 12) only
    CHECK(aware.received(2, 2).empty());
    CHECK_FALSE(aware.computes(0, 1));
    CHECK_FALSE(aware.computes(0, 2));
    CHECK(aware.slices(2, 1) == std::vector<AttnSlice>{{{0, 4}, {0, 2}, Mask::causal(2)}});
    spec.sharding_aware = false;
    const RingSchedule plain(spec);
    CHECK(plain.received(2, 1) == std::vector<Range>{{4, 8}});
    CHECK(plain.received(2, 2) == std::vector<Range>{{0, 4}});
    CHECK_FALSE(plain.computes(2, 2));  // the block travels, nothing in it is read
    CHECK(check_ring(spec) > 0);
  }

  TEST_CASE("ring schedule (property): owners, key sets, coverage and transfers on random rings") {
    std::mt19937 rng(31337);
    int busy = 0;
    for (int iter = 0; iter < 1000; ++iter) {
      const int k = static_cast<int>(test::uniform(rng, 1, 6));
      const bool aware = iter % 2 == 0;
      const RingSpec spec = random_spec(rng, k, aware);
      INFO("iteration " << iter << ": " << k << " members");
      busy += check_ring(spec);
    }
    CHECK(busy > 1500);
  }
}
