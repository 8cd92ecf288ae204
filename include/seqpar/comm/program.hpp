// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/overloaded.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::comm {

/// Buffers a program reads and writes. The first ones are the caller's sequence-sharded tensors
/// (local rows = the rank's owned tokens, in plan order); then the carry (K/V rows a chunked run keeps
/// for later chunks, and their gradients: bound by the chunked runner, rows = Program::carry_rows);
/// the rest are staging buffers the program declares and the executor places in its workspace.
enum class BufferId : std::uint8_t {
  kQ,
  kK,
  kV,
  kO,
  kLse,
  kDout,
  kDq,
  kDk,
  kDv,  // caller's views
  kKCarry,
  kVCarry,
  kDkCarry,
  kDvCarry,  // carried rows (chunked attention), bound like the caller's views
  kQHeads,
  kKHeads,
  kVHeads,
  kOHeads,
  kLseHeads,  // head-sharded (Ulysses) staging
  kDoutHeads,
  kDqHeads,
  kDkHeads,
  kDvHeads,
  kOPart,
  kLsePart,  // partial results merged into O, LSE
  kKRing0,
  kVRing0,
  kKRing1,
  kVRing1,  // KV received in ring steps (two slots)
  kDkPart,
  kDvPart,  // dK, dV of a received KV block
  kKGather,
  kVGather,
  kDkGather,
  kDvGather,  // all-gathered KV and its gradients
  kKPrefix,
  kVPrefix,
  kDkPrefix,
  kDvPrefix,  // a chunk's prefix K/V gathered from the carry, and its gradients
  kCount
};
inline constexpr int kNumBuffers = static_cast<int>(BufferId::kCount);

[[nodiscard]] constexpr bool is_lse(BufferId b) noexcept {
  return b == BufferId::kLse || b == BufferId::kLseHeads || b == BufferId::kLsePart;
}
[[nodiscard]] constexpr bool is_caller_buffer(BufferId b) noexcept {
  return static_cast<int>(b) <= static_cast<int>(BufferId::kDv);
}
[[nodiscard]] constexpr bool is_carry_buffer(BufferId b) noexcept {
  return static_cast<int>(b) >= static_cast<int>(BufferId::kKCarry) &&
         static_cast<int>(b) <= static_cast<int>(BufferId::kDvCarry);
}
/// Buffers that hold values, outputs or their gradients (V, O, dO, dV and their staging copies): rows of
/// AttentionShape::v_dim() values per head; the others hold q/k-sized rows (or LSE entries).
[[nodiscard]] constexpr bool has_v_width(BufferId b) noexcept {
  switch (b) {
    case BufferId::kV:
    case BufferId::kO:
    case BufferId::kDout:
    case BufferId::kDv:
    case BufferId::kVCarry:
    case BufferId::kDvCarry:
    case BufferId::kVHeads:
    case BufferId::kOHeads:
    case BufferId::kDoutHeads:
    case BufferId::kDvHeads:
    case BufferId::kOPart:
    case BufferId::kVRing0:
    case BufferId::kVRing1:
    case BufferId::kDvPart:
    case BufferId::kVGather:
    case BufferId::kDvGather:
    case BufferId::kVPrefix:
    case BufferId::kDvPrefix:
      return true;
    default:
      return false;
  }
}

/// The head sizes of a program's buffers: `qk` for Q, K and their gradients, `v` for V, O, dO, dV
/// (AttentionShape::qk_dim, v_dim).
struct HeadWidths {
  int qk = 0;
  int v = 0;
  /// Values per head of a row of THD buffer `b`.
  [[nodiscard]] constexpr int of(BufferId b) const noexcept { return has_v_width(b) ? v : qk; }
  friend bool operator==(const HeadWidths&, const HeadWidths&) = default;
};

/// Buffers whose memory the program's runner binds (not placed in the executor's workspace).
[[nodiscard]] constexpr bool is_bound_buffer(BufferId b) noexcept {
  return is_caller_buffer(b) || is_carry_buffer(b);
}

/// A staging buffer: rows x heads (x its HeadWidths::of width, unless it holds LSE values).
struct BufferSpec {
  BufferId id{};
  std::int64_t rows = 0;
  int heads = 0;
};

/// A box of a buffer: rows x heads (x the buffer's head width). Moved as one contiguous run in the packed message,
/// rows outer, heads inner for THD buffers; heads outer, rows inner for LSE buffers.
struct Piece {
  Range rows;
  Range heads;
  [[nodiscard]] std::int64_t elements(int head_dim, bool lse) const noexcept {
    return rows.size() * heads.size() * (lse ? 1 : head_dim);
  }
};

/// One tensor's part of an exchange: what this rank sends each peer out of `src`, and where what each
/// peer sends lands in `dst`. Sender and receiver enumerate the same pieces in the same order, so the
/// packed bytes need no header. With `accumulate`, received values are added (in peer order, so the
/// reduction is deterministic) instead of assigned: used for gradients of replicated KV heads.
struct Move {
  BufferId src{};
  BufferId dst{};
  bool accumulate = false;
  std::vector<std::vector<Piece>> send;  ///< [peer] pieces of src
  std::vector<std::vector<Piece>> recv;  ///< [peer] pieces of dst
};

/// Communication level a step runs on: the plan's group (BASP group, or the world), later the
/// inner (node) and outer (across nodes) levels of a hierarchical communicator.
enum class Level : std::uint8_t { kGroup, kInner, kOuter };
inline constexpr int kNumLevels = 3;

/// All moves of one step travel in one all_to_all_v over the level's transport.
struct ExchangeStep {
  Level level = Level::kGroup;
  int self = 0;  ///< this rank in the level's transport: its pieces are local copies, not traffic
  std::vector<Move> moves;
};

/// Zero-fill buffers (gradient accumulators).
struct ZeroStep {
  std::vector<BufferId> buffers;
};

/// One kernel call over head sub-ranges of the step's buffers (query heads [q_heads) read KV heads
/// [kv_heads); the kernel maps them uniformly: q head i -> kv head i / (|q_heads| / |kv_heads|)).
struct HeadGroup {
  Range q_heads;
  Range kv_heads;
};

/// A piece of a buffer, for point-to-point transfers that mix tensors.
struct BufferPiece {
  BufferId buffer{};
  Piece piece;
};

/// One message of a point-to-point step: to or from `peer` (rank in the level's transport), made of
/// pieces packed back to back in order.
struct Transfer {
  int peer = 0;
  std::vector<BufferPiece> pieces;
};

/// Posts non-blocking sends (packed now) and receives (unpacked at the matching WaitStep) in a
/// transfer slot, so that the compute steps between post and wait overlap the transfer (ring double
/// buffering). With `accumulate`, received values are added to the destination pieces.
struct PostStep {
  Level level = Level::kGroup;
  int slot = 0;
  int tag = 0;
  bool accumulate = false;
  std::vector<Transfer> sends;
  std::vector<Transfer> recvs;
};

/// Completes the transfers of a slot and unpacks what it received.
struct WaitStep {
  int slot = 0;
};
inline constexpr int kNumSlots = 4;

/// Attention over local rows. Forward: `waves` are kernel calls whose slices have disjoint query rows;
/// the first wave writes o/lse (or, with `merge`, every wave is merged into the o/lse already there,
/// through the kOPart/kLsePart staging buffers); rows no wave covers are O = 0, LSE = -inf.
/// Backward: every wave accumulates into dq/dk/dv.
struct ComputeStep {
  bool backward = false;
  bool merge = false;
  BufferId q = BufferId::kQ, k = BufferId::kK, v = BufferId::kV, o = BufferId::kO, lse = BufferId::kLse;
  BufferId dout = BufferId::kDout, dq = BufferId::kDq, dk = BufferId::kDk, dv = BufferId::kDv;
  std::vector<std::vector<AttnSlice>> waves;  ///< local rows of q (and o, lse) x local rows of k, v
  std::vector<HeadGroup> head_groups;

  [[nodiscard]] std::int64_t area() const noexcept {
    std::int64_t a = 0;
    for (const auto& w : waves) a += total_area(w);
    return a;
  }
};

/// One buffer's part of a local copy: the pieces of `src` in order land in the pieces of `dst` in
/// order (equal element counts; like an exchange's pieces for its own rank, without the collective).
/// With `accumulate` the values are added.
struct LocalMove {
  BufferId src{};
  BufferId dst{};
  bool accumulate = false;
  std::vector<Piece> from;  ///< pieces of src
  std::vector<Piece> to;    ///< pieces of dst
};

/// Copies between this rank's buffers, no communication (a chunked run keeping K/V rows in the carry,
/// and adding the gradients later chunks returned for them).
struct CopyStep {
  std::vector<LocalMove> moves;
};

using Step = std::variant<ExchangeStep, ZeroStep, ComputeStep, PostStep, WaitStep, CopyStep>;

/// The step's kind as error messages and traces name it.
[[nodiscard]] inline const char* step_name(const Step& step) noexcept {
  return std::visit(Overloaded{[](const ExchangeStep&) { return "exchange"; }, [](const ZeroStep&) { return "zero"; },
                               [](const ComputeStep&) { return "compute"; }, [](const PostStep&) { return "post"; },
                               [](const WaitStep&) { return "wait"; }, [](const CopyStep&) { return "copy"; }},
                    step);
}

/// Bytes of one piece of buffer `b` in a message: elements of `value_bytes` (LSE entries of
/// `lse_bytes`; a THD row of `widths.of(b)` values per head). The one definition the executor, the byte
/// accounting and the simulator share.
[[nodiscard]] inline std::uint64_t piece_bytes(BufferId b, const Piece& p, HeadWidths widths, std::size_t value_bytes,
                                               std::size_t lse_bytes) noexcept {
  return static_cast<std::uint64_t>(p.elements(widths.of(b), is_lse(b))) * (is_lse(b) ? lse_bytes : value_bytes);
}

/// Calls fn(peer, buffer, piece) for every piece this step sends to another rank of its level
/// (exchange pieces for `self` are local copies, not traffic).
template <class Fn>
void for_each_sent_piece(const Step& step, Fn&& fn) {
  std::visit(Overloaded{[&](const PostStep& post) {
                          for (const Transfer& t : post.sends)
                            for (const BufferPiece& bp : t.pieces) fn(post.level, t.peer, bp.buffer, bp.piece);
                        },
                        [&](const ExchangeStep& ex) {
                          for (const Move& m : ex.moves)
                            for (std::size_t peer = 0; peer < m.send.size(); ++peer) {
                              if (static_cast<int>(peer) == ex.self) continue;
                              for (const Piece& p : m.send[peer]) fn(ex.level, static_cast<int>(peer), m.src, p);
                            }
                        },
                        [](const ZeroStep&) {}, [](const ComputeStep&) {}, [](const WaitStep&) {},
                        [](const CopyStep&) {}},  // every kind named: a new sending step must be counted here
             step);
}

/// The per-rank list of steps a communicator compiles from a plan; run by `Executor`, or replayed by
/// the simulator. Depends only on document lengths, plan and shape: compiled once per batch shape.
struct Program {
  int rank = 0;        ///< rank in the world
  int head_dim = 0;    ///< q/k head size (AttentionShape::qk_dim)
  int head_dim_v = 0;  ///< v/o head size (AttentionShape::v_dim; 0 = head_dim)
  double softmax_scale = 0;
  std::int64_t local_tokens = 0;
  std::int64_t carry_rows = 0;  ///< rows of the carry buffers (kKCarry..kDvCarry) on this rank
  std::vector<BufferSpec> staging;
  std::vector<Step> steps;
  /// Sub-communicators the inner and outer levels run on, as a split of the world: this rank's
  /// color (-1: level unused) and key. Level::kGroup is the plan's group.
  struct LevelSplit {
    int color = -1;
    int key = 0;
  };
  std::array<LevelSplit, kNumLevels> splits{};
  /// World ranks of each level's transport, by level rank (empty: level unused).
  std::array<std::vector<int>, kNumLevels> level_members{};

  /// The head sizes of this program's buffers.
  [[nodiscard]] HeadWidths widths() const noexcept { return {head_dim, head_dim_v != 0 ? head_dim_v : head_dim}; }

  /// Bytes this rank sends to each world rank (index), for link-class accounting (intra/inter node).
  [[nodiscard]] std::vector<std::uint64_t> bytes_to(int world_size, std::size_t value_bytes,
                                                    std::size_t lse_bytes) const {
    std::vector<std::uint64_t> out(static_cast<std::size_t>(world_size), 0);
    for (const Step& step : steps)
      for_each_sent_piece(step, [&](Level l, int peer, BufferId b, const Piece& p) {
        const auto world = level_members[static_cast<std::size_t>(l)].at(static_cast<std::size_t>(peer));
        out[static_cast<std::size_t>(world)] += piece_bytes(b, p, widths(), value_bytes, lse_bytes);
      });
    return out;
  }

  /// Attention (query, key) pairs this rank computes, summed over its query heads: FLOPs are
  /// 2 * (head_dim + head_dim_v) * pairs forward, 2.5x that backward.
  [[nodiscard]] std::int64_t head_pairs() const noexcept {
    std::int64_t total = 0;
    for (const Step& step : steps)
      if (const auto* c = std::get_if<ComputeStep>(&step)) {
        std::int64_t heads = 0;
        for (const HeadGroup& g : c->head_groups) heads += g.q_heads.size();
        total += c->area() * heads;
      }
    return total;
  }

  [[nodiscard]] const BufferSpec* staging_spec(BufferId id) const noexcept {
    for (const auto& s : staging)
      if (s.id == id) return &s;
    return nullptr;
  }

  /// Bytes this rank sends to other ranks when the program runs with elements of `value_bytes` and
  /// LSE entries of `lse_bytes`: must equal what the transport counts.
  [[nodiscard]] std::uint64_t bytes_sent(std::size_t value_bytes, std::size_t lse_bytes) const {
    std::uint64_t total = 0;
    for (const Step& step : steps)
      for_each_sent_piece(step, [&](Level, int, BufferId b, const Piece& p) {
        total += piece_bytes(b, p, widths(), value_bytes, lse_bytes);
      });
    return total;
  }

  [[nodiscard]] std::size_t num_steps() const noexcept { return steps.size(); }
};

/// Forward and backward programs of one rank.
struct CompiledAttention {
  Program forward;
  Program backward;
};

}  // namespace seqpar::comm
