// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::comm {

/// Buffers a program reads and writes. The first ones are the caller's sequence-sharded tensors
/// (local rows = the rank's owned tokens, in plan order); the rest are staging buffers the program
/// declares and the executor places in its workspace.
enum class BufferId : std::uint8_t {
  kQ, kK, kV, kO, kLse, kDout, kDq, kDk, kDv,                 // caller's views
  kQHeads, kKHeads, kVHeads, kOHeads, kLseHeads,              // head-sharded (Ulysses) staging
  kDoutHeads, kDqHeads, kDkHeads, kDvHeads,
  kCount
};
inline constexpr int kNumBuffers = static_cast<int>(BufferId::kCount);

[[nodiscard]] constexpr bool is_lse(BufferId b) noexcept { return b == BufferId::kLse || b == BufferId::kLseHeads; }
[[nodiscard]] constexpr bool is_caller_buffer(BufferId b) noexcept {
  return static_cast<int>(b) <= static_cast<int>(BufferId::kDv);
}

/// A staging buffer: rows x heads (x head_dim, unless it holds LSE values).
struct BufferSpec {
  BufferId id{};
  std::int64_t rows = 0;
  int heads = 0;
};

/// A box of a buffer: rows x heads (x head_dim). Moved as one contiguous run in the packed message,
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
enum class Level : std::uint8_t { kGroup };

/// All moves of one step travel in one all_to_all_v over the level's transport.
struct ExchangeStep {
  Level level = Level::kGroup;
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

/// Attention over local rows: forward writes o/lse, backward accumulates dq/dk/dv.
struct ComputeStep {
  bool backward = false;
  BufferId q = BufferId::kQ, k = BufferId::kK, v = BufferId::kV, o = BufferId::kO, lse = BufferId::kLse;
  BufferId dout = BufferId::kDout, dq = BufferId::kDq, dk = BufferId::kDk, dv = BufferId::kDv;
  std::vector<AttnSlice> slices;  ///< local rows of q (and o, lse) x local rows of k, v
  std::vector<HeadGroup> head_groups;
};

using Step = std::variant<ExchangeStep, ZeroStep, ComputeStep>;

/// The per-rank list of steps a communicator compiles from a plan; run by `Executor`, or replayed by
/// the simulator. Depends only on document lengths, plan and shape: compiled once per batch shape.
struct Program {
  int rank = 0;            ///< rank in the world
  int level_rank = 0;      ///< rank inside the group transport
  int head_dim = 0;
  double softmax_scale = 0;
  std::int64_t local_tokens = 0;
  std::vector<BufferSpec> staging;
  std::vector<Step> steps;

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
      if (const auto* ex = std::get_if<ExchangeStep>(&step))
        for (const Move& m : ex->moves)
          for (std::size_t peer = 0; peer < m.send.size(); ++peer) {
            if (static_cast<int>(peer) == level_rank) continue;
            for (const Piece& p : m.send[peer])
              total += static_cast<std::uint64_t>(p.elements(head_dim, is_lse(m.src))) *
                       (is_lse(m.src) ? lse_bytes : value_bytes);
          }
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
