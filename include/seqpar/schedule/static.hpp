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

#include "seqpar/core/chunk.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::schedule {

/// Opt-in tag of batch-level schedulers.
struct scheduler_tag {};

// The chunk a scheduler produces is core data (the runtime runs it): seqpar::Chunk, core/chunk.hpp.
using seqpar::Chunk;
using seqpar::ChunkKind;
using seqpar::kind_name;

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
