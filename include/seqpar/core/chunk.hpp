// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `Chunk`: a piece of a batch that a batch-level scheduler (schedule/) hands to the attention, and
/// that the chunked runner (runtime::ChunkedAttention) runs. Data only: planners produce it, the
/// runtime consumes it, so it lives below both.

#include <cstdint>
#include <span>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar {

/// What a chunk is made of (DPP's chunk types).
enum class ChunkKind : std::uint8_t {
  kWhole,    ///< the batch as given (Static)
  kSplit,    ///< one balanced slice of a long document
  kBatched,  ///< short documents packed together
  kHybrid,   ///< a long document's tail slice plus short documents
};

/// "whole", "split", "batched", "hybrid": how tools and examples print a chunk's kind.
[[nodiscard]] constexpr const char* kind_name(ChunkKind k) noexcept {
  switch (k) {
    case ChunkKind::kSplit:
      return "split";
    case ChunkKind::kBatched:
      return "batched";
    case ChunkKind::kHybrid:
      return "hybrid";
    case ChunkKind::kWhole:
      break;
  }
  return "whole";
}

/// A piece of work a batch-level scheduler hands to the attention: a batch of its own, the global
/// token ranges of the scheduled batch it covers (in the chunk's token order; concatenated they are
/// the chunk batch's tokens), and for each range the global keys its queries also attend to, carried
/// from earlier chunks (a split document's earlier slices; empty for a whole document). A range with
/// a prefix is one document piece of the chunk batch, and its prefix is that document's tokens before it:
/// all of them (a scheduler's chunks serve every layer); a layer with a sliding window of w keys reads at
/// most the last w - 1 (the carry cuts each prefix to its layer's mask: comm::ChunkCarry).
struct Chunk {
  DocumentBatch batch;
  std::vector<Range> tokens;
  std::vector<Range> prefix;  ///< same size as tokens
  ChunkKind kind = ChunkKind::kWhole;
  double cost = 0;  ///< the scheduler's cost estimate (DynamicChunk: its cost model's units)
};

/// The chunks' ranges, prefixes and batches as one Hash64: what ranks compare so that two ranks never run
/// different chunks of the same shape (ChunkedAttention's calls, the DPP step's agreement).
[[nodiscard]] inline std::uint64_t chunks_fingerprint(std::span<const Chunk> chunks) noexcept {
  Hash64 h;
  h.add(static_cast<std::int64_t>(chunks.size()));
  for (const Chunk& c : chunks) {
    for (const Range& r : c.tokens) h.add(r.begin).add(r.end);
    h.add(std::int64_t{-1});
    for (const Range& r : c.prefix) h.add(r.begin).add(r.end);
    h.add(std::int64_t{-2}).add(c.batch.fingerprint());
  }
  return h.value();
}

/// The part of `before` (a piece's document keys before its first query) that the piece's queries can
/// see under a sliding window of `window` keys: all of it without a window (0), else its last window - 1
/// keys (none for window 1). The one rule the scheduler's prefixes, the carry and the planner's slices share.
[[nodiscard]] constexpr Range visible_prefix(Range before, std::int64_t window) noexcept {
  if (window > 0 && before.end - before.begin > window - 1) before.begin = before.end - (window - 1);
  return before;
}

}  // namespace seqpar
