// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `train::TokenBatch`: a packed batch of token ids over its document layout, with each token's
/// position in its document (RoPE restarts at every document) and its next-token label (none at a
/// document's last token: a label never crosses into the next document).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::train {

/// `tokens[g]` is global token g of `documents`.
struct TokenBatch {
  DocumentBatch documents;
  std::vector<int> tokens;

  void validate(const char* where) const {
    detail::require(tokens.size() == static_cast<std::size_t>(documents.total_tokens()), where, "batch.tokens.size()",
                    tokens.size(), "must be the batch's token count " + std::to_string(documents.total_tokens()));
  }
  /// Position of every token in its document.
  [[nodiscard]] std::vector<std::int64_t> positions() const {
    std::vector<std::int64_t> pos(tokens.size(), 0);
    for (const Document& doc : documents.documents())
      for (std::int64_t g = doc.tokens.begin; g < doc.tokens.end; ++g)
        pos[static_cast<std::size_t>(g)] = g - doc.tokens.begin;
    return pos;
  }
  /// Next-token label of every token; -1 at the last token of a document.
  [[nodiscard]] std::vector<int> labels() const {
    std::vector<int> out(tokens.size(), -1);
    for (const Document& doc : documents.documents())
      for (std::int64_t g = doc.tokens.begin; g + 1 < doc.tokens.end; ++g)
        out[static_cast<std::size_t>(g)] = tokens[static_cast<std::size_t>(g + 1)];
    return out;
  }
  /// Tokens with a label: total tokens - documents.
  [[nodiscard]] std::int64_t label_tokens() const noexcept {
    return documents.total_tokens() - static_cast<std::int64_t>(documents.documents().size());
  }
};

}  // namespace seqpar::train
