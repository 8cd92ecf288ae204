// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar {

/// One packed document: its global token range and the sequence it belongs to.
struct Document {
  Range tokens;
  int sequence = 0;
};

/// B packed sequences, each a list of document lengths (>= 1 token each). Tokens are laid out THD:
/// sequence 0's documents, then sequence 1's, ... `cu_seqlens` has one entry per document boundary
/// (FlashAttention varlen convention: cu_seqlens[0] = 0, cu_seqlens.back() = total tokens).
/// Attention never crosses a document boundary (document-causal) unless a full mask is asked for.
/// No length has to be divisible by anything.
///
/// The batch is the layout only: where tokens live (the placement) is made from it once for every
/// layer, and the mask (causal, or a sliding window) is an argument of each attention call
/// (AttentionMask), never part of the batch.
class DocumentBatch {
 public:
  /// No sequences: a placeholder to assign to. Planning and attention refuse it (num_sequences() == 0).
  DocumentBatch() = default;

  /// `DocumentBatch({{4096}})`: one sequence of one document; `DocumentBatch({{3, 5}, {8}})`: two.
  /// (Without this overload a braced list is ambiguous between the vector and the copy constructor.)
  explicit DocumentBatch(std::initializer_list<std::initializer_list<std::int64_t>> sequences)
      : DocumentBatch(std::vector<std::vector<std::int64_t>>(sequences.begin(), sequences.end())) {}

  /// `sequences[b]` lists the document lengths of sequence b.
  explicit DocumentBatch(const std::vector<std::vector<std::int64_t>>& sequences) {
    detail::require(!sequences.empty(), "DocumentBatch", "sequences.size()", 0, "need at least one sequence");
    cu_seqlens_.push_back(0);
    sequence_offsets_.push_back(0);
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const auto& docs = sequences[b];
      detail::require(!docs.empty(), "DocumentBatch", "sequences[" + std::to_string(b) + "].size()", 0,
                      "a sequence needs at least one document");
      for (std::size_t i = 0; i < docs.size(); ++i) {
        const std::int64_t len = docs[i];
        const std::int64_t area = len >= 1 && len <= kMaxDocumentTokens ? detail::triangle(len) : 0;
        if (len < 1 || len > kMaxTokens - total_ || len > kMaxDocumentTokens ||
            area > std::numeric_limits<std::int64_t>::max() - area_) {
          // names built only to fail: a million documents is common
          const auto name = "sequences[" + std::to_string(b) + "][" + std::to_string(i) + "]";
          detail::require(len >= 1, "DocumentBatch", name, len, "document lengths must be >= 1");
          detail::require(len <= kMaxTokens - total_, "DocumentBatch", name, len,
                          "total token count would overflow (limit " + std::to_string(kMaxTokens) + ")");
          detail::require(len <= kMaxDocumentTokens, "DocumentBatch", name, len,
                          "its causal area s(s+1)/2 would overflow int64 (longest document: " +
                              std::to_string(kMaxDocumentTokens) + " tokens)");
          detail::require(false, "DocumentBatch", name, len,
                          "the batch's causal area (sum of s(s+1)/2) would overflow int64");
        }
        area_ += area;
        documents_.push_back({{total_, total_ + len}, static_cast<int>(b)});
        total_ += len;
        cu_seqlens_.push_back(total_);
      }
      sequence_offsets_.push_back(total_);
    }
  }

  /// One sequence of the given document lengths.
  [[nodiscard]] static DocumentBatch single(const std::vector<std::int64_t>& doc_lengths) {
    return DocumentBatch({doc_lengths});
  }

  /// Gone: a window on the batch moved where tokens live, so a window layer silently got other tokens
  /// than the rows a rank held for the model's full layers. The mask is an argument of the call.
  template <class W>
  DocumentBatch with_window(W) const {
    static_assert(sizeof(W) == 0,
                  "DocumentBatch::with_window is gone: a mask is per call, not per batch. Pass "
                  "AttentionMask::sliding_window(w) to DistributedAttention::forward/backward (and to "
                  "ChunkedAttention::begin), and declare the model's mask mix once in the strategy's "
                  "Arguments (.masks) so that the one placement of the batch is balanced for it");
    return *this;
  }

  /// 0 for a default-constructed batch.
  [[nodiscard]] int num_sequences() const noexcept {
    return sequence_offsets_.empty() ? 0 : static_cast<int>(sequence_offsets_.size()) - 1;
  }
  [[nodiscard]] std::int64_t total_tokens() const noexcept { return total_; }
  [[nodiscard]] std::span<const Document> documents() const noexcept { return documents_; }
  [[nodiscard]] std::span<const std::int64_t> cu_seqlens() const noexcept { return cu_seqlens_; }
  [[nodiscard]] Range sequence(int b) const noexcept { return {sequence_offsets_[b], sequence_offsets_[b + 1]}; }

  /// Documents of sequence b, as a sub-span of documents().
  [[nodiscard]] std::span<const Document> documents_of(int b) const noexcept {
    std::size_t first = 0;
    while (first < documents_.size() && documents_[first].sequence < b) ++first;
    std::size_t last = first;
    while (last < documents_.size() && documents_[last].sequence == b) ++last;
    return std::span<const Document>(documents_).subspan(first, last - first);
  }

  /// Document-causal attention of the whole batch under `mask` as slices (one slice per document):
  /// causal, or a sliding window where the mask has one shorter than the document.
  [[nodiscard]] std::vector<AttnSlice> document_causal_slices(AttentionMask mask = {}) const {
    std::vector<AttnSlice> out;
    out.reserve(documents_.size());
    for (const auto& d : documents_)
      out.push_back(
          {d.tokens, d.tokens, mask.binds(d.tokens.size()) ? Mask::sliding_window(mask.window) : Mask::causal(0)});
    return out;
  }

  /// Sum over documents of s(s+1)/2: the visible (query, key) pairs of document-causal attention
  /// without a window. Fits in int64: the constructor refuses batches where it would not.
  [[nodiscard]] std::int64_t causal_area() const noexcept { return area_; }

  /// A 64-bit hash (Hash64) of the layout: sequence and document boundaries, what a placement and the
  /// token metadata depend on. Plans carry it (Placement::batch_fingerprint) so that a plan of another
  /// batch, even one of the same token count, is refused where it is consumed. Never 0 (0 on a plan
  /// means "not known"). O(documents).
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    Hash64 h;
    for (const std::int64_t c : cu_seqlens_) h.add(c);
    h.add(std::int64_t{-1});
    for (const std::int64_t o : sequence_offsets_) h.add(o);
    return h.value();
  }

  /// The visible (query, key) pairs of this batch's attention under `mask`: causal_area() narrowed by
  /// the window (document_area of every document); what every plan's slice areas add up to. O(documents)
  /// under a window.
  [[nodiscard]] std::int64_t attention_area(AttentionMask mask = {}) const noexcept {
    if (mask.window <= 0) return area_;
    std::int64_t area = 0;
    for (const Document& d : documents_) area += mask.area(d.tokens.size());
    return area;
  }

  friend bool operator==(const DocumentBatch& a, const DocumentBatch& b) {
    return a.cu_seqlens_ == b.cu_seqlens_ && a.sequence_offsets_ == b.sequence_offsets_;
  }

  /// Largest token count accepted: keeps token*heads*dim products of realistic shapes inside int64.
  static constexpr std::int64_t kMaxTokens = std::int64_t{1} << 40;
  /// Longest document accepted: its causal area s(s+1)/2 (the planners' and the cost model's unit)
  /// and the products s * (s + 1) on the way to it stay inside int64.
  static constexpr std::int64_t kMaxDocumentTokens = 3'037'000'499;  // floor(sqrt(2^63 - 1))

 private:
  std::vector<Document> documents_;
  std::vector<std::int64_t> cu_seqlens_;
  std::vector<std::int64_t> sequence_offsets_;
  std::int64_t total_ = 0;
  std::int64_t area_ = 0;
};

}  // namespace seqpar
