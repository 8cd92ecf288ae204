// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::train {

/// Moving whole-batch tensors to a rank's local rows and back.
///
/// A rank's local buffers hold the global tokens `plan.owned[rank]`, concatenated in that order (under
/// zigzag, Per-Doc or hybrid plans several pieces, not one contiguous range). These functions are the
/// one place that order is applied:
///  - shard(plan, rank, global, local): copies the rank's rows out of a whole-batch tensor;
///  - unshard_local(plan, rank, local, global): writes the rank's rows back at their global rows (only
///    those: ranks that share one global buffer, as in-process ranks do, assemble it together);
///  - unshard(transport, plan, local, global): every rank's rows gathered over the transport (one
///    all_gather_v) into the whole-batch tensor, on every rank.
/// Views may be strided (any head layout: a heads_slice, a token stride with padding); shard and
/// unshard_local convert element types with static_cast (e.g. an fp64 reference to fp32 shards),
/// unshard moves bytes and needs one type. Per-token values (token ids, labels, losses) go through
/// the std::span overloads (one value per token).
///
/// A plan of another batch: each overload checks the plan against what it is given. Without the batch
/// that is the global tensor's rows (the plan's token count), so a plan of another batch with the same
/// token count cannot be told apart; the overloads that take the batch first (`shard(batch, plan, ...)`)
/// also compare the placement's fingerprint (Placement::batch_fingerprint) with the batch's and refuse a
/// plan of another batch by name. Pass the batch wherever the caller has it.
///
/// @code
/// auto plan = attn.plan(batch);
/// ThdTensor<float> q(attn.local_tokens(batch), Hq, D);   // (local tokens, Hq, D)
/// train::shard(batch, plan, rank, q_global.view(), q.view());   // the rank's rows, plan order
/// attn.forward(batch, q.view(), k.view(), v.view(), o.view(), lse.view());
/// train::unshard(transport, batch, plan, o.view(), o_global.view());  // (total tokens, Hq, D) on every rank
/// @endcode

namespace detail_shard {

inline std::int64_t total_tokens(const Placement& plan) {
  std::int64_t n = 0;
  for (int r = 0; r < plan.world_size(); ++r) n += plan.local_tokens(r);
  return n;
}

inline void check_rank(const Placement& plan, int rank, const char* where) {
  seqpar::detail::require(rank >= 0 && rank < plan.world_size(), where, "rank", rank,
                          "must be in [0, " + std::to_string(plan.world_size()) + ") (the plan's world size)");
}

template <class G, class L>
void check_thd(const Placement& plan, int rank, const ThdView<G>& global, const ThdView<L>& local, const char* where) {
  check_rank(plan, rank, where);
  seqpar::detail::check_view(global, where, "global", total_tokens(plan), local.heads, local.head_dim);
  seqpar::detail::check_view(local, where, "local", plan.local_tokens(rank), global.heads, global.head_dim);
}

template <class T>
bool dense(const ThdView<T>& v) {
  return v.head_stride == v.head_dim && v.token_stride == std::int64_t{v.heads} * v.head_dim;
}

/// `count` token rows from row `from` of src to row `to` of dst, converting the element type.
template <class S, class D>
void copy_rows(const ThdView<S>& src, std::int64_t from, const ThdView<D>& dst, std::int64_t to, std::int64_t count) {
  if (count <= 0) return;
  using Src = std::remove_const_t<S>;
  if constexpr (std::is_same_v<Src, D> && std::is_trivially_copyable_v<D>) {
    if (dense(src) && dense(dst)) {
      std::memcpy(dst.row(to, 0), src.row(from, 0), sizeof(D) * static_cast<std::size_t>(count * src.token_stride));
      return;
    }
  }
  for (std::int64_t t = 0; t < count; ++t)
    for (int h = 0; h < src.heads; ++h) {
      const S* s = src.row(from + t, h);
      D* d = dst.row(to + t, h);
      for (int x = 0; x < src.head_dim; ++x) d[x] = static_cast<D>(s[x]);
    }
}

template <class T>
ThdView<T> per_token(std::span<T> s) {
  return ThdView<T>::dense(s.data(), static_cast<std::int64_t>(s.size()), 1, 1);
}

/// The rows `rows` (global ranges) of `global` into `local`, concatenated in that order; and back. The
/// one loop every shard / unshard_local / *_rows overload runs after its own checks.
template <class G, class L>
void gather(std::span<const Range> rows, const ThdView<G>& global, const ThdView<L>& local) {
  std::int64_t at = 0;
  for (const Range& r : rows) {
    copy_rows(global, r.begin, local, at, r.size());
    at += r.size();
  }
}
template <class L, class G>
void scatter(std::span<const Range> rows, const ThdView<L>& local, const ThdView<G>& global) {
  std::int64_t at = 0;
  for (const Range& r : rows) {
    copy_rows(local, at, global, r.begin, r.size());
    at += r.size();
  }
}
template <class G, class L>
void gather(std::span<const Range> rows, const LseView<G>& global, const LseView<L>& local) {
  for (int h = 0; h < global.heads; ++h) {
    std::int64_t at = 0;
    for (const Range& r : rows)
      for (std::int64_t t = r.begin; t < r.end; ++t) local(h, at++) = static_cast<L>(global(h, t));
  }
}
template <class L, class G>
void scatter(std::span<const Range> rows, const LseView<L>& local, const LseView<G>& global) {
  for (int h = 0; h < global.heads; ++h) {
    std::int64_t at = 0;
    for (const Range& r : rows)
      for (std::int64_t t = r.begin; t < r.end; ++t) global(h, t) = static_cast<G>(local(h, at++));
  }
}
inline std::span<const Range> owned(const Placement& plan, int rank) {
  return plan.owned[static_cast<std::size_t>(rank)];
}

/// The plan is one of `batch`: its token count, and its fingerprint when it carries one (a plan built
/// by hand carries 0). O(documents), no allocation unless it throws.
inline void check_batch(const DocumentBatch& batch, const Placement& plan, const char* where) {
  const std::int64_t tokens = total_tokens(plan);
  if (tokens != batch.total_tokens())
    seqpar::detail::throw_invalid(where, "plan", std::to_string(tokens) + " tokens",
                                  "is not a plan of this batch (" + std::to_string(batch.total_tokens()) + " tokens)");
  // A plan of another batch with the same token count passes the check above; the fingerprint catches it.
  if (plan.batch_fingerprint != 0 && plan.batch_fingerprint != batch.fingerprint())
    seqpar::detail::throw_invalid(where, "plan.batch_fingerprint", plan.batch_fingerprint,
                                  "is not this batch's (" + std::to_string(batch.fingerprint()) +
                                      "): the plan belongs to another batch (same token count, other documents)");
}

}  // namespace detail_shard

/// Rank `rank`'s rows of `global` (every token of the plan's batch) into `local`
/// (plan.local_tokens(rank) rows), in plan order. Heads and head_dim must match.
template <class G, class L>
void shard(const Placement& plan, int rank, const ThdView<G>& global, const ThdView<L>& local) {
  detail_shard::check_thd(plan, rank, global, local, "train::shard");
  detail_shard::gather(detail_shard::owned(plan, rank), global, local);
}

/// Rank `rank`'s local rows written at their global rows of `global`; other rows are left alone.
template <class L, class G>
void unshard_local(const Placement& plan, int rank, const ThdView<L>& local, const ThdView<G>& global) {
  detail_shard::check_thd(plan, rank, global, local, "train::unshard_local");
  detail_shard::scatter(detail_shard::owned(plan, rank), local, global);
}

/// LSE-style (heads, tokens) tensors: the rank's token columns of every head, in plan order.
template <class G, class L>
void shard(const Placement& plan, int rank, const LseView<G>& global, const LseView<L>& local) {
  constexpr const char* where = "train::shard";
  detail_shard::check_rank(plan, rank, where);
  seqpar::detail::check_view(global, where, "global", local.heads, detail_shard::total_tokens(plan));
  seqpar::detail::check_view(local, where, "local", global.heads, plan.local_tokens(rank));
  detail_shard::gather(detail_shard::owned(plan, rank), global, local);
}

template <class L, class G>
void unshard_local(const Placement& plan, int rank, const LseView<L>& local, const LseView<G>& global) {
  constexpr const char* where = "train::unshard_local";
  detail_shard::check_rank(plan, rank, where);
  seqpar::detail::check_view(global, where, "global", local.heads, detail_shard::total_tokens(plan));
  seqpar::detail::check_view(local, where, "local", global.heads, plan.local_tokens(rank));
  detail_shard::scatter(detail_shard::owned(plan, rank), local, global);
}

/// One value per token (token ids, labels, per-token losses or weights).
template <class G, class L>
void shard(const Placement& plan, int rank, std::span<G> global, std::span<L> local) {
  shard(plan, rank, detail_shard::per_token(global), detail_shard::per_token(local));
}
template <class L, class G>
void unshard_local(const Placement& plan, int rank, std::span<L> local, std::span<G> global) {
  unshard_local(plan, rank, detail_shard::per_token(local), detail_shard::per_token(global));
}

/// shard / unshard_local with the batch the plan is of: the plan is refused (std::invalid_argument
/// naming plan or plan.batch_fingerprint) when it is a plan of another batch, then as above.
template <class G, class L>
void shard(const DocumentBatch& batch, const Placement& plan, int rank, const ThdView<G>& global,
           const ThdView<L>& local) {
  detail_shard::check_batch(batch, plan, "train::shard");
  shard(plan, rank, global, local);
}
template <class G, class L>
void shard(const DocumentBatch& batch, const Placement& plan, int rank, const LseView<G>& global,
           const LseView<L>& local) {
  detail_shard::check_batch(batch, plan, "train::shard");
  shard(plan, rank, global, local);
}
template <class G, class L>
void shard(const DocumentBatch& batch, const Placement& plan, int rank, std::span<G> global, std::span<L> local) {
  detail_shard::check_batch(batch, plan, "train::shard");
  shard(plan, rank, global, local);
}
template <class L, class G>
void unshard_local(const DocumentBatch& batch, const Placement& plan, int rank, const ThdView<L>& local,
                   const ThdView<G>& global) {
  detail_shard::check_batch(batch, plan, "train::unshard_local");
  unshard_local(plan, rank, local, global);
}
template <class L, class G>
void unshard_local(const DocumentBatch& batch, const Placement& plan, int rank, const LseView<L>& local,
                   const LseView<G>& global) {
  detail_shard::check_batch(batch, plan, "train::unshard_local");
  unshard_local(plan, rank, local, global);
}
template <class L, class G>
void unshard_local(const DocumentBatch& batch, const Placement& plan, int rank, std::span<L> local,
                   std::span<G> global) {
  detail_shard::check_batch(batch, plan, "train::unshard_local");
  unshard_local(plan, rank, local, global);
}

/// Rows listed by their global ranges, for layouts that are not a rank's plan: a DPP chunk's rows on
/// this rank (runtime::ChunkedAttention::owned_global(c)), a micro-batch of one's own. `local` holds
/// the listed rows concatenated in the order given; each range must lie inside `global`'s tokens.
///
/// @code
/// const auto& rows = chunked.owned_global(c);           // chunk c's global rows on this rank
/// ThdTensor<float> q(chunked.local_tokens(c), Hq, D);    // (chunk rows, Hq, D)
/// train::shard_rows(rows, q_global.view(), q.view());
/// @endcode
namespace detail_shard {
inline std::int64_t rows_in(std::span<const Range> rows, std::int64_t tokens, const char* where) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Range& r = rows[i];
    if (r.begin < 0 || r.begin > r.end || r.end > tokens) {  // the message is built only when thrown
      std::string range("[");  // appended, not prepended: GCC 12 -O3 warns (-Wrestrict) on "[" + string
      range.append(std::to_string(r.begin)).append(", ").append(std::to_string(r.end)).append(")");
      seqpar::detail::throw_invalid(where, "rows[" + std::to_string(i) + "]", range,
                                    "must lie inside the global tensor's " + std::to_string(tokens) + " tokens");
    }
    n += r.size();
  }
  return n;
}
}  // namespace detail_shard

template <class G, class L>
void shard_rows(std::span<const Range> rows, const ThdView<G>& global, const ThdView<L>& local) {
  constexpr const char* where = "train::shard_rows";
  const std::int64_t n = detail_shard::rows_in(rows, global.tokens, where);
  seqpar::detail::check_view(global, where, "global", global.tokens, local.heads, local.head_dim);
  seqpar::detail::check_view(local, where, "local", n, global.heads, global.head_dim);
  detail_shard::gather(rows, global, local);
}
/// The listed rows of `local` written back at their global rows; other rows are left alone.
template <class L, class G>
void unshard_rows(std::span<const Range> rows, const ThdView<L>& local, const ThdView<G>& global) {
  constexpr const char* where = "train::unshard_rows";
  const std::int64_t n = detail_shard::rows_in(rows, global.tokens, where);
  seqpar::detail::check_view(global, where, "global", global.tokens, local.heads, local.head_dim);
  seqpar::detail::check_view(local, where, "local", n, global.heads, global.head_dim);
  detail_shard::scatter(rows, local, global);
}
/// LSE-style (heads, tokens): the listed token columns of every head.
template <class G, class L>
void shard_rows(std::span<const Range> rows, const LseView<G>& global, const LseView<L>& local) {
  constexpr const char* where = "train::shard_rows";
  const std::int64_t n = detail_shard::rows_in(rows, global.tokens, where);
  seqpar::detail::check_view(global, where, "global", local.heads, global.tokens);
  seqpar::detail::check_view(local, where, "local", global.heads, n);
  detail_shard::gather(rows, global, local);
}
template <class L, class G>
void unshard_rows(std::span<const Range> rows, const LseView<L>& local, const LseView<G>& global) {
  constexpr const char* where = "train::unshard_rows";
  const std::int64_t n = detail_shard::rows_in(rows, global.tokens, where);
  seqpar::detail::check_view(global, where, "global", local.heads, global.tokens);
  seqpar::detail::check_view(local, where, "local", global.heads, n);
  detail_shard::scatter(rows, local, global);
}
/// One value per token.
template <class G, class L>
void shard_rows(std::span<const Range> rows, std::span<G> global, std::span<L> local) {
  shard_rows(rows, detail_shard::per_token(global), detail_shard::per_token(local));
}
template <class L, class G>
void unshard_rows(std::span<const Range> rows, std::span<L> local, std::span<G> global) {
  unshard_rows(rows, detail_shard::per_token(local), detail_shard::per_token(global));
}

/// Every rank's local rows gathered into `global` (every token, global order) on every rank of
/// `transport`, whose ranks must be the plan's (size == plan.world_size(); call it on all of them).
/// One all_gather_v of the packed rows: each rank receives the whole tensor once.
template <Transport Tr, class L, class T>
requires std::is_same_v<std::remove_const_t<L>, T> && std::is_trivially_copyable_v<T>
void unshard(Tr& transport, const Placement& plan, const ThdView<L>& local, const ThdView<T>& global) {
  constexpr const char* where = "train::unshard";
  seqpar::detail::require(transport.size() == plan.world_size(), where, "transport.size()", transport.size(),
                          "must equal the plan's world size " + std::to_string(plan.world_size()));
  const int rank = transport.rank();
  detail_shard::check_thd(plan, rank, global, local, where);
  const std::int64_t row = std::int64_t{global.heads} * global.head_dim;
  const std::int64_t total = global.tokens;
  std::vector<T> send;
  std::span<const T> send_span;
  if (detail_shard::dense(local)) {
    send_span = std::span<const T>(local.data, static_cast<std::size_t>(local.tokens * row));
  } else {
    send.resize(static_cast<std::size_t>(local.tokens * row));
    detail_shard::copy_rows(local, 0, ThdView<T>::dense(send.data(), local.tokens, local.heads, local.head_dim), 0,
                            local.tokens);
    send_span = send;
  }
  std::vector<std::size_t> counts(static_cast<std::size_t>(plan.world_size()));
  for (int r = 0; r < plan.world_size(); ++r)
    counts[static_cast<std::size_t>(r)] = sizeof(T) * static_cast<std::size_t>(plan.local_tokens(r) * row);
  std::vector<T> all(static_cast<std::size_t>(total * row));
  transport.all_gather_v(as_bytes_of(send_span), as_writable_bytes_of(std::span<T>(all)), counts);
  const auto packed = ThdView<const T>::dense(all.data(), total, global.heads, global.head_dim);
  std::int64_t at = 0;  // rank r's rows follow rank r-1's, each in r's plan order
  for (int r = 0; r < plan.world_size(); ++r)
    for (const Range& g : plan.owned[static_cast<std::size_t>(r)]) {
      detail_shard::copy_rows(packed, at, global, g.begin, g.size());
      at += g.size();
    }
}

/// LSE-style (heads, tokens) tensors gathered like the THD ones.
template <Transport Tr, class L, class T>
requires std::is_same_v<std::remove_const_t<L>, T> && std::is_trivially_copyable_v<T>
void unshard(Tr& transport, const Placement& plan, const LseView<L>& local, const LseView<T>& global) {
  seqpar::detail::require(local.heads == global.heads, "train::unshard", "local.heads", local.heads,
                          "expected " + std::to_string(global.heads) + " (global.heads)");
  // Token-major packing turns it into a THD gather of one "head" of `heads` values per token.
  const std::int64_t n = local.tokens;
  std::vector<T> mine(static_cast<std::size_t>(n * local.heads));
  for (int h = 0; h < local.heads; ++h)
    for (std::int64_t t = 0; t < n; ++t) mine[static_cast<std::size_t>(t * local.heads + h)] = local(h, t);
  std::vector<T> all(static_cast<std::size_t>(global.tokens * global.heads));
  unshard(transport, plan, ThdView<const T>::dense(mine.data(), n, 1, local.heads),
          ThdView<T>::dense(all.data(), global.tokens, 1, global.heads));
  for (int h = 0; h < global.heads; ++h)
    for (std::int64_t t = 0; t < global.tokens; ++t) global(h, t) = all[static_cast<std::size_t>(t * global.heads + h)];
}

/// Per-token values gathered like the THD ones.
template <Transport Tr, class L, class T>
requires std::is_same_v<std::remove_const_t<L>, T> && std::is_trivially_copyable_v<T>
void unshard(Tr& transport, const Placement& plan, std::span<L> local, std::span<T> global) {
  unshard(transport, plan, detail_shard::per_token(local), detail_shard::per_token(global));
}

/// unshard with the batch the plan is of: a plan of another batch is refused on every rank before the
/// gather (every rank passes the same batch and plan, so every rank refuses; none is left waiting).
template <Transport Tr, class L, class T>
requires std::is_same_v<std::remove_const_t<L>, T> && std::is_trivially_copyable_v<T>
void unshard(Tr& transport, const DocumentBatch& batch, const Placement& plan, const ThdView<L>& local,
             const ThdView<T>& global) {
  detail_shard::check_batch(batch, plan, "train::unshard");
  unshard(transport, plan, local, global);
}
template <Transport Tr, class L, class T>
requires std::is_same_v<std::remove_const_t<L>, T> && std::is_trivially_copyable_v<T>
void unshard(Tr& transport, const DocumentBatch& batch, const Placement& plan, const LseView<L>& local,
             const LseView<T>& global) {
  detail_shard::check_batch(batch, plan, "train::unshard");
  unshard(transport, plan, local, global);
}
template <Transport Tr, class L, class T>
requires std::is_same_v<std::remove_const_t<L>, T> && std::is_trivially_copyable_v<T>
void unshard(Tr& transport, const DocumentBatch& batch, const Placement& plan, std::span<L> local,
             std::span<T> global) {
  detail_shard::check_batch(batch, plan, "train::unshard");
  unshard(transport, plan, local, global);
}

}  // namespace seqpar::train
