// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Batch-level schedulers: policies that sit *above* `DistributedAttention` and decide how a training
/// batch is cut into chunks and in what order the chunks run (DPP's DynamicChunk: packed, split and
/// hybrid chunks that carry a KV prefix, ordered for a pipeline). A scheduler calls the attention it is
/// given once per chunk; the strategy underneath plans and runs each chunk.
///
/// `Static` is the scheduler that does not chunk: the batch as given, in one call.
///
/// @code
/// seqpar::schedule::Static sched;
/// for (const auto& chunk : sched.chunks(batch))          // one chunk: the whole batch
///   attn.forward(chunk.batch, q, k, v, o, lse);
/// @endcode

#include <concepts>
#include <cstdint>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::schedule {

/// Opt-in tag of batch-level schedulers.
struct scheduler_tag {};

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
/// a prefix is one document piece of the chunk batch, and its prefix is that document's tokens before it.
struct Chunk {
  DocumentBatch batch;
  std::vector<Range> tokens;
  std::vector<Range> prefix;  ///< same size as tokens
  ChunkKind kind = ChunkKind::kWhole;
  double cost = 0;  ///< the scheduler's cost estimate (DynamicChunk: its cost model's units)
};

template <class S>
concept Scheduler = std::derived_from<typename S::policy_category, scheduler_tag> &&
    requires(const S& s, const DocumentBatch& batch) {
  typename S::Arguments;
  { s.chunks(batch) } -> std::convertible_to<std::vector<Chunk>>;
};

/// Runs the batch as given, in one chunk.
struct Static {
  using policy_category = scheduler_tag;
  struct Arguments {};
  Arguments args;
  [[nodiscard]] std::vector<Chunk> chunks(const DocumentBatch& batch) const {
    return {Chunk{batch, {Range{0, batch.total_tokens()}}, {Range{0, 0}}, ChunkKind::kWhole, 0.0}};
  }
};

static_assert(Scheduler<Static>);

}  // namespace seqpar::schedule
