// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/train/shard.hpp"

namespace seqpar::train {

/// What each local row of a rank is, for the parts of a trainer around attention: RoPE positions,
/// next-token labels, loss masks, varlen kernels of the user's own. Vectors have one entry per local
/// row (plan order), except cu_seqlens.
///
/// After zigzag, Per-Doc or hybrid cuts a rank's rows are pieces of documents: positions restart at 0
/// at each document's first token (not at each piece, not at each rank), and a token's label is the
/// next token of its document, which may be held by another rank (`labels` fetches it). The last
/// token of a document has no label: a packed batch never predicts across documents.
///
/// @code
/// const train::TokenMeta meta = train::token_meta(batch, attn.plan(batch), rank);
/// rope(q, meta.position);  // (local tokens, Hq, D), rotated by position within the document
/// const auto y = train::labels(transport, attn.plan(batch), meta, std::span<const int>(ids), -100);
/// @endcode
struct TokenMeta {
  std::vector<std::int64_t> global_index;       ///< the row's token in the whole batch
  std::vector<int> sequence;                    ///< the sequence (packed row of the batch) it lies in
  std::vector<std::int64_t> document;           ///< index into batch.documents()
  std::vector<std::int64_t> position;           ///< position within its document, from 0 (for RoPE)
  std::vector<std::int64_t> label_index;        ///< global index of its next-token label; -1: none
  std::vector<unsigned char> last_in_document;  ///< 1 for a document's last token (label_index -1)
  /// Local row boundaries of the contiguous pieces (each one document's consecutive tokens):
  /// cu_seqlens[0] = 0, cu_seqlens.back() = local rows (FlashAttention varlen convention).
  std::vector<std::int64_t> cu_seqlens;
  std::int64_t max_seqlen = 0;   ///< longest piece
  std::int64_t label_count = 0;  ///< rows with a label (the loss's token count on this rank)
  /// DocumentBatch::fingerprint() of the batch described: labels(transport, plan, ...) refuses a meta
  /// whose batch is not the plan's.
  std::uint64_t batch_fingerprint = 0;

  [[nodiscard]] std::int64_t rows() const noexcept { return static_cast<std::int64_t>(global_index.size()); }
};

[[nodiscard]] inline TokenMeta token_meta(const DocumentBatch& batch, std::span<const Range> rows);

/// The metadata of rank `rank`'s local rows under `plan` (a plan of `batch`).
[[nodiscard]] inline TokenMeta token_meta(const DocumentBatch& batch, const Placement& plan, int rank) {
  constexpr const char* where = "train::token_meta";
  detail_shard::check_rank(plan, rank, where);
  detail_shard::check_batch(batch, plan, where);
  return token_meta(batch, std::span<const Range>(plan.owned[static_cast<std::size_t>(rank)]));
}

/// The metadata of rows listed by their global ranges, in that order: a DPP chunk's rows on this rank
/// (runtime::ChunkedAttention::owned_global(c)), so that a pipelined trainer gets RoPE positions and
/// labels per chunk as a sharded one gets them per rank. Each range must lie inside the batch.
[[nodiscard]] inline TokenMeta token_meta(const DocumentBatch& batch, std::span<const Range> rows) {
  (void)detail_shard::rows_in(rows, batch.total_tokens(), "train::token_meta");
  TokenMeta m;
  m.batch_fingerprint = batch.fingerprint();
  std::size_t n = 0;
  for (const Range& r : rows) n += static_cast<std::size_t>(r.size());
  m.global_index.reserve(n), m.sequence.reserve(n), m.document.reserve(n), m.position.reserve(n);
  m.label_index.reserve(n), m.last_in_document.reserve(n);
  m.cu_seqlens.push_back(0);
  const auto docs = batch.documents();
  for (const Range& piece : rows) {
    if (piece.empty()) continue;
    // First document that ends after piece.begin; then each document the piece overlaps.
    auto it = std::upper_bound(docs.begin(), docs.end(), piece.begin,
                               [](std::int64_t t, const Document& d) { return t < d.tokens.end; });
    for (; it != docs.end() && it->tokens.begin < piece.end; ++it) {
      const Range part = intersect(piece, it->tokens);
      const auto doc = static_cast<std::int64_t>(it - docs.begin());
      for (std::int64_t t = part.begin; t < part.end; ++t) {
        const bool last = t + 1 == it->tokens.end;
        m.global_index.push_back(t);
        m.sequence.push_back(it->sequence);
        m.document.push_back(doc);
        m.position.push_back(t - it->tokens.begin);
        m.label_index.push_back(last ? -1 : t + 1);
        m.last_in_document.push_back(last ? 1 : 0);
        m.label_count += last ? 0 : 1;
      }
      m.cu_seqlens.push_back(m.cu_seqlens.back() + part.size());
      m.max_seqlen = std::max(m.max_seqlen, part.size());
    }
  }
  return m;
}

/// The metadata of every token of `batch`, as one rank holding the whole batch would see it
/// (TokenBatch and the single-device reference step use it).
[[nodiscard]] inline TokenMeta whole_batch_meta(const DocumentBatch& batch) {
  const Range all{0, batch.total_tokens()};
  return token_meta(batch, std::span<const Range>(&all, 1));
}

/// Next-token labels of the local rows from the whole batch's token ids (every rank has them):
/// ids[label_index], or `ignore` where a row has no label.
template <class Id>
[[nodiscard]] std::vector<Id> labels(const TokenMeta& meta, std::span<const Id> global_ids, Id ignore) {
  std::vector<Id> out(meta.label_index.size(), ignore);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::int64_t j = meta.label_index[i];
    if (j < 0) continue;
    seqpar::detail::require(j < static_cast<std::int64_t>(global_ids.size()), "train::labels", "global_ids.size()",
                            global_ids.size(), "shorter than the batch (label index " + std::to_string(j) + ")");
    out[i] = global_ids[static_cast<std::size_t>(j)];
  }
  return out;
}

/// Next-token labels when each rank holds only its own rows' ids (`local_ids`, plan order): the ids
/// are gathered over `transport` (the plan's ranks; one all_gather_v of one id per token) and picked.
template <Transport Tr, class Id>
[[nodiscard]] std::vector<Id> labels(Tr& transport, const Placement& plan, const TokenMeta& meta,
                                     std::span<const Id> local_ids, Id ignore) {
  constexpr const char* where = "train::labels";
  // meta must describe this rank's rows of this plan (a meta of another plan or rank picks wrong ids).
  detail_shard::check_rank(plan, transport.rank(), where);
  if (plan.batch_fingerprint != 0 && meta.batch_fingerprint != 0 && meta.batch_fingerprint != plan.batch_fingerprint)
    seqpar::detail::throw_invalid(where, "meta.batch_fingerprint", meta.batch_fingerprint,
                                  "is not the plan's batch (" + std::to_string(plan.batch_fingerprint) +
                                      "): meta of another plan, batch or rank");
  std::size_t row = 0;
  for (const Range& r : detail_shard::owned(plan, transport.rank()))
    for (std::int64_t t = r.begin; t < r.end; ++t, ++row)
      if (row >= meta.global_index.size() || meta.global_index[row] != t)
        seqpar::detail::throw_invalid(where, "meta", "global_index[" + std::to_string(row) + "]",
                                      "is not rank " + std::to_string(transport.rank()) + "'s row " +
                                          std::to_string(row) + " of the plan (global token " + std::to_string(t) +
                                          "): meta of another plan, batch or rank");
  seqpar::detail::require(
      row == meta.global_index.size(), where, "meta.rows()", meta.rows(),
      "expected the plan's " + std::to_string(row) + " rows of rank " + std::to_string(transport.rank()));
  seqpar::detail::require(static_cast<std::int64_t>(local_ids.size()) == meta.rows(), where, "local_ids.size()",
                          local_ids.size(), "expected " + std::to_string(meta.rows()));
  std::vector<Id> all(static_cast<std::size_t>(detail_shard::total_tokens(plan)));
  unshard(transport, plan, local_ids, std::span<Id>(all));
  return labels(meta, std::span<const Id>(all), ignore);
}

}  // namespace seqpar::train
