// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/train/token_meta.hpp"

namespace seqpar::train {

/// A token-weighted mean loss across ranks: the sum of per-token losses and the count of label tokens.
///
/// The single-device loss of a packed batch is sum over label tokens / number of label tokens. Sharded,
/// each rank holds some of those tokens; the mean of per-rank means is not the batch mean (ranks hold
/// different numbers of label tokens: under BASP whole sequences, under Per-Doc or hybrid cuts uneven
/// pieces, and every document's last token has no label). So each rank sums, the sums and counts are
/// combined, and the global mean and its gradient scale follow:
///  - loss = combined.sum / combined.count, the same number on every rank;
///  - d loss / d (a token's loss) = 1 / combined.count = gradient_scale(): every rank scales its local
///    per-token gradients by it, and then the gradients of replicated parameters are *summed* over the
///    same ranks (all_reduce_sum), not averaged, to give the single-device gradient.
/// Which ranks: every rank holding part of the batch the mean is over. Under BASP that is the world the
/// plan was made for (every group), not a group's sub-communicator; for context parallelism alone it is
/// the attention group; with data-parallel replicas on top, theirs too (one mean over all their batches).
///
/// @code
/// auto local = train::local_loss(std::span<const float>(token_loss), meta);  // this rank's label tokens
/// const train::LossTotals total = train::combine(world, local);             // same on every rank
/// for (auto& g : dlogits_rows) g *= total.gradient_scale();
/// @endcode
struct LossTotals {
  double sum = 0;          ///< sum of per-token losses over label tokens
  std::int64_t count = 0;  ///< label tokens

  [[nodiscard]] double mean() const { return count > 0 ? sum / static_cast<double>(count) : 0.0; }
  /// d mean / d (one token's loss); 0 when there is no label token.
  [[nodiscard]] double gradient_scale() const { return count > 0 ? 1.0 / static_cast<double>(count) : 0.0; }
};

/// The local rows' totals: per_row_loss has one value per local row; rows without a label (a
/// document's last token) are skipped, whatever value they hold.
template <class T>
[[nodiscard]] LossTotals local_loss(std::span<const T> per_row_loss, const TokenMeta& meta) {
  seqpar::detail::require(static_cast<std::int64_t>(per_row_loss.size()) == meta.rows(), "train::local_loss",
                          "per_row_loss.size()", per_row_loss.size(), "expected " + std::to_string(meta.rows()));
  LossTotals t;
  for (std::size_t i = 0; i < per_row_loss.size(); ++i)
    if (meta.label_index[i] >= 0) t.sum += static_cast<double>(per_row_loss[i]), ++t.count;
  return t;
}

/// Sums `local` over the ranks of `transport` (call on all of them). Summed in rank order on every
/// rank from one all_gather, so every rank gets the same bits.
template <Transport Tr>
[[nodiscard]] LossTotals combine(Tr& transport, const LossTotals& local) {
  std::vector<LossTotals> all(static_cast<std::size_t>(transport.size()));
  transport.all_gather(as_bytes_of(std::span<const LossTotals>(&local, 1)), as_writable_bytes_of(std::span(all)));
  LossTotals total;
  for (const LossTotals& t : all) total.sum += t.sum, total.count += t.count;
  return total;
}

}  // namespace seqpar::train
