// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/slice_algebra.hpp"

namespace seqpar::comm::detail {

/// What a ring runs over: its members (ranks of one level's transport), the global tokens whose Q
/// and KV each member holds (rows of its buffers, in order), the global slices of each member's
/// queries, and the buffers and heads to use. Flat Ring fills it from the plan with the caller's
/// buffers; Hierarchical fills it with the head-sharded buffers of its inner all-to-all.
struct RingSpec {
  Level level = Level::kGroup;
  int me = 0;
  std::vector<std::vector<Range>> tokens;
  std::vector<std::vector<AttnSlice>> slices;
  bool sharding_aware = false;
  BufferId q = BufferId::kQ, k = BufferId::kK, v = BufferId::kV, o = BufferId::kO, lse = BufferId::kLse;
  BufferId dout = BufferId::kDout, dq = BufferId::kDq, dk = BufferId::kDk, dv = BufferId::kDv;
  int q_heads = 0, kv_heads = 0;
  std::vector<HeadGroup> head_groups;
  int tag_base = 0;
  /// When set, the members' tokens and slices where they already live (flat Ring: the plan's), read
  /// instead of `tokens` and `slices`: every rank copying a plan of a million pieces into its spec
  /// cost more than compiling it.
  std::vector<const std::vector<Range>*> token_views;
  std::vector<const std::vector<AttnSlice>*> slice_views;

  [[nodiscard]] int size() const noexcept {
    return static_cast<int>(token_views.empty() ? tokens.size() : token_views.size());
  }
  [[nodiscard]] const std::vector<Range>& member_tokens(int m) const {
    const auto i = static_cast<std::size_t>(m);
    return token_views.empty() ? tokens[i] : *token_views[i];
  }
  [[nodiscard]] const std::vector<AttnSlice>& member_slices(int m) const {
    const auto i = static_cast<std::size_t>(m);
    return slice_views.empty() ? slices[i] : *slice_views[i];
  }
};

/// The ring's plan, step by step, as every member computes it: whose KV a member holds at step s and
/// which global ranges of it, so that sender and receiver agree without talking. One schedule serves a
/// rank's forward and backward programs and memoizes what it works out: building a program asks for the
/// same (member, source) key sets several times per step, and at 1024 ranks the repeated keys_needed
/// scans were most of the planner's time (bench/plan_scale).
class RingSchedule {
 public:
  explicit RingSchedule(const RingSpec& spec) : spec_(spec), k_(spec.size()) {}
  RingSchedule(const RingSpec&&) = delete;  // holds a reference: the spec must outlive it

  [[nodiscard]] const RingSpec& spec() const noexcept { return spec_; }

  /// Member whose KV `member` receives at step s (1 <= s < size).
  [[nodiscard]] int owner(int member, int s) const noexcept { return (member - s + k_) % k_; }

  /// Global KV ranges `member` holds at step s (of owner(member, s)).
  [[nodiscard]] const std::vector<Range>& received(int member, int s) const {
    const int src = owner(member, s);
    return spec_.sharding_aware ? needed(member, src) : nonempty(src);
  }

  /// Whether `member` computes anything at step s (its slices read keys of owner(member, s)).
  [[nodiscard]] bool computes(int member, int s) const { return !needed(member, owner(member, s)).empty(); }

  /// Slices `member` computes at step s (0: its own KV), in its local rows.
  [[nodiscard]] std::vector<AttnSlice> slices(int member, int s) const {
    const auto& mine = spec_.member_tokens(member);
    if (s != 0 && received(member, s).empty()) return {};
    const RowMap q_map = member == spec_.me ? own_map() : RowMap::concat(mine);
    const RowMap k_map = s == 0 ? q_map : RowMap::concat(received(member, s));
    return localize(spec_.member_slices(member), q_map, k_map);
  }

  /// Rows of spec.me's own buffers (its tokens back to back), built once.
  [[nodiscard]] const RowMap& own_map() const {
    if (!own_map_) own_map_ = RowMap::concat(spec_.member_tokens(spec_.me));
    return *own_map_;
  }

  [[nodiscard]] static std::int64_t rows(const std::vector<Range>& ranges) noexcept {
    std::int64_t n = 0;
    for (const Range& r : ranges) n += r.size();
    return n;
  }

 private:
  // Keys of src's tokens that member's slices read.
  const std::vector<Range>& needed(int member, int src) const {
    const std::int64_t key = static_cast<std::int64_t>(member) * k_ + src;
    auto it = needed_.find(key);
    if (it == needed_.end())
      it = needed_.emplace(key, keys_needed(spec_.member_slices(member), spec_.member_tokens(src))).first;
    return it->second;
  }
  const std::vector<Range>& nonempty(int src) const {
    auto it = nonempty_.find(src);
    if (it == nonempty_.end()) {
      std::vector<Range> out;
      for (const Range& r : spec_.member_tokens(src))
        if (!r.empty()) out.push_back(r);
      it = nonempty_.emplace(src, std::move(out)).first;
    }
    return it->second;
  }
  const RingSpec& spec_;
  int k_;
  mutable std::unordered_map<std::int64_t, std::vector<Range>> needed_;
  mutable std::unordered_map<int, std::vector<Range>> nonempty_;
  mutable std::optional<RowMap> own_map_;
};

inline constexpr BufferId kRingK[2] = {BufferId::kKRing0, BufferId::kKRing1};
inline constexpr BufferId kRingV[2] = {BufferId::kVRing0, BufferId::kVRing1};

/// Staging buffers a ring needs on member `spec.me`.
inline void add_ring_staging(Program& p, const RingSchedule& sched, bool backward) {
  const RingSpec& spec = sched.spec();
  std::int64_t block = 0;
  for (int s = 1; s < spec.size(); ++s) block = std::max(block, sched.rows(sched.received(spec.me, s)));
  const std::int64_t mine = sched.rows(spec.member_tokens(spec.me));
  for (int slot = 0; slot < 2; ++slot) {
    p.staging.push_back({kRingK[slot], block, spec.kv_heads});
    p.staging.push_back({kRingV[slot], block, spec.kv_heads});
  }
  if (!backward) {
    p.staging.push_back({BufferId::kOPart, mine, spec.q_heads});
    p.staging.push_back({BufferId::kLsePart, mine, spec.q_heads});
  } else {
    p.staging.push_back({BufferId::kDkPart, block, spec.kv_heads});
    p.staging.push_back({BufferId::kDvPart, block, spec.kv_heads});
  }
}

/// Pieces of K and V (heads [0, kv_heads)) covering `ranges`, located through `map` in buffers k, v.
inline std::vector<BufferPiece> kv_pieces(const std::vector<Range>& ranges, const RowMap& map, BufferId k, BufferId v,
                                          int kv_heads) {
  std::vector<BufferPiece> out;
  for (BufferId b : {k, v}) {
    std::size_t hint = 0;
    for (const Range& r : ranges) out.push_back({b, {map.to_local(r, hint), {0, kv_heads}}});
  }
  return out;
}

/// The KV transfer of step s (post into slot s % 2): what spec.me receives, and what it sends.
inline PostStep ring_kv_post(const RingSchedule& sched, int s) {
  const RingSpec& spec = sched.spec();
  const int k = spec.size(), me = spec.me;
  const int slot = s % 2;
  PostStep post{spec.level, slot, spec.tag_base + s, false, {}, {}};
  // Receive: the ranges I hold at step s, back to back in the slot.
  const std::vector<Range> in = sched.received(me, s);
  if (!in.empty()) {
    const int from = spec.sharding_aware ? sched.owner(me, s) : (me - 1 + k) % k;
    post.recvs.push_back({from, kv_pieces(in, RowMap::concat(in), kRingK[slot], kRingV[slot], spec.kv_heads)});
  }
  // Send: sharding-aware, my own KV that owner-of-step-s' receiver needs; plain, what I held at s - 1.
  if (spec.sharding_aware) {
    const int to = (me + s) % k;
    const std::vector<Range>& out = sched.received(to, s);
    if (!out.empty()) post.sends.push_back({to, kv_pieces(out, sched.own_map(), spec.k, spec.v, spec.kv_heads)});
  } else {
    const int to = (me + 1) % k;
    const std::vector<Range>& out = sched.received(to, s);  // = what I held at s - 1
    if (!out.empty()) {
      if (s == 1)
        post.sends.push_back({to, kv_pieces(out, RowMap::concat(out), spec.k, spec.v, spec.kv_heads)});
      else
        post.sends.push_back(
            {to, kv_pieces(out, RowMap::concat(out), kRingK[(s - 1) % 2], kRingV[(s - 1) % 2], spec.kv_heads)});
    }
  }
  return post;
}

inline ComputeStep ring_compute(const RingSchedule& sched, int s, bool backward) {
  const RingSpec& spec = sched.spec();
  ComputeStep c;
  c.backward = backward;
  c.merge = s > 0;
  c.q = spec.q, c.o = spec.o, c.lse = spec.lse, c.dout = spec.dout, c.dq = spec.dq;
  c.k = s == 0 ? spec.k : kRingK[s % 2];
  c.v = s == 0 ? spec.v : kRingV[s % 2];
  c.dk = s == 0 ? spec.dk : BufferId::kDkPart;
  c.dv = s == 0 ? spec.dv : BufferId::kDvPart;
  c.waves = waves(sched.slices(spec.me, s));
  c.head_groups = spec.head_groups;
  return c;
}

/// Forward: the first transfer is posted, then local attention (it writes O, LSE) runs while it flies;
/// for each later step the next transfer is posted before the current compute (double buffering);
/// partial results merge into O, LSE in fp32. (Posting step 1 after the local compute left the first
/// transfer exposed; the simulator showed it as one step of wait on every rank.)
inline void append_ring_forward(Program& p, const RingSchedule& sched) {
  const int k = sched.spec().size();
  if (k > 1) p.steps.push_back(ring_kv_post(sched, 1));
  p.steps.push_back(ring_compute(sched, 0, false));
  for (int s = 1; s < k; ++s) {
    p.steps.push_back(WaitStep{s % 2});
    if (s + 1 < k) p.steps.push_back(ring_kv_post(sched, s + 1));
    ComputeStep c = ring_compute(sched, s, false);
    if (!c.waves.empty()) p.steps.push_back(std::move(c));
  }
}

/// Backward: the same KV transfers; each received block's dK, dV go straight back to its owner, who
/// adds them in step order (deterministic). dQ accumulates locally.
inline void append_ring_backward(Program& p, const RingSchedule& sched) {
  const RingSpec& spec = sched.spec();
  const int k = spec.size(), me = spec.me;
  p.steps.push_back(ZeroStep{{spec.dq, spec.dk, spec.dv}});
  if (k > 1) p.steps.push_back(ring_kv_post(sched, 1));  // sends read K, V only: overlaps the local step
  p.steps.push_back(ring_compute(sched, 0, true));
  std::vector<bool> return_pending(2, false);
  for (int s = 1; s < k; ++s) {
    p.steps.push_back(WaitStep{s % 2});
    if (s + 1 < k) p.steps.push_back(ring_kv_post(sched, s + 1));
    ComputeStep c = ring_compute(sched, s, true);
    const int rslot = 2 + s % 2;
    PostStep ret{spec.level, rslot, spec.tag_base + k + s, true, {}, {}};
    if (!c.waves.empty()) {
      p.steps.push_back(ZeroStep{{BufferId::kDkPart, BufferId::kDvPart}});
      p.steps.push_back(std::move(c));
      const std::vector<Range>& in = sched.received(me, s);
      ret.sends.push_back(
          {sched.owner(me, s), kv_pieces(in, RowMap::concat(in), BufferId::kDkPart, BufferId::kDvPart, spec.kv_heads)});
    }
    // The member that held my KV at step s returns its gradient, if it computed on it.
    const int holder = (me + s) % k;
    if (sched.computes(holder, s)) {
      const std::vector<Range>& out = sched.received(holder, s);
      ret.recvs.push_back({holder, kv_pieces(out, sched.own_map(), spec.dk, spec.dv, spec.kv_heads)});
    }
    if (return_pending[static_cast<std::size_t>(s % 2)]) p.steps.push_back(WaitStep{rslot});
    return_pending[static_cast<std::size_t>(s % 2)] = true;
    p.steps.push_back(std::move(ret));
  }
  // Remaining returns, in step order.
  for (int s = std::max(1, k - 2); s < k; ++s)
    if (return_pending[static_cast<std::size_t>(s % 2)]) p.steps.push_back(WaitStep{2 + s % 2});
}

}  // namespace seqpar::comm::detail
