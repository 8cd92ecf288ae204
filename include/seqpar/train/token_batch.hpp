// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `train::TokenBatch`: a packed batch of token ids over its document layout, with each token's
/// position in its document (RoPE restarts at every document) and its next-token label (none at a
/// document's last token: a label never crosses into the next document).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/train/token_meta.hpp"

namespace seqpar::train {

/// `tokens[g]` is global token g of `documents`.
struct TokenBatch {
  DocumentBatch documents;
  std::vector<int> tokens;

  void validate(const char* where) const {
    detail::require(tokens.size() == static_cast<std::size_t>(documents.total_tokens()), where, "batch.tokens.size()",
                    tokens.size(), "must be the batch's token count " + std::to_string(documents.total_tokens()));
  }
  /// Position of every token in its document (token_meta's definition, over the whole batch).
  [[nodiscard]] std::vector<std::int64_t> positions() const { return whole_batch_meta(documents).position; }
  /// Next-token label of every token; -1 at the last token of a document (train::labels').
  [[nodiscard]] std::vector<int> labels() const {
    validate("train::TokenBatch::labels");
    return train::labels(whole_batch_meta(documents), std::span<const int>(tokens), -1);
  }
  /// Tokens with a label: total tokens - documents.
  [[nodiscard]] std::int64_t label_tokens() const noexcept {
    return documents.total_tokens() - static_cast<std::int64_t>(documents.documents().size());
  }
};

}  // namespace seqpar::train
