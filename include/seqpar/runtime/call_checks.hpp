// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/core/view_checks.hpp"

namespace seqpar::runtime {

/// The local checks of an attention call's tensors, made before the agreement (so that a bad argument
/// on one rank reaches every rank before any data moves): extents, strides and aliasing of the views,
/// the caller's workspace, that a forward of the batch and mask ran before its backward, and that
/// backward's O and LSE are what a forward of the same batch and mask wrote. Each throws
/// std::invalid_argument naming the argument.
template <class T, class A, class Exec>
class CallChecks {
 public:
  /// The views both passes take: q, k, v, o of n local rows, lse (Hq, n).
  template <class O, class L>
  static void forward_views(const char* where, const AttentionShape& shape, std::int64_t n, ThdView<const T> q,
                            ThdView<const T> k, ThdView<const T> v, const O& o, const L& lse) {
    seqpar::detail::check_view(q, where, "q", n, shape.heads_q, shape.qk_dim());
    seqpar::detail::check_view(k, where, "k", n, shape.heads_kv, shape.qk_dim());
    seqpar::detail::check_view(v, where, "v", n, shape.heads_kv, shape.v_dim());
    seqpar::detail::check_view(o, where, "o", n, shape.heads_q, shape.v_dim());
    seqpar::detail::check_view(lse, where, "lse", shape.heads_q, n);
  }

  /// A caller's workspace: large enough, and sharing memory with no tensor (the program writes it).
  template <class... Views>
  static void workspace(const char* where, std::span<std::byte> workspace, std::size_t need, const Views&... views) {
    if (workspace.data() == nullptr) return;  // the engine's own
    seqpar::detail::require(workspace.size() >= need, where, "workspace.size()", workspace.size(),
                            "need at least workspace_bytes(batch) = " + std::to_string(need));
    const char* const names[] = {"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv"};
    std::size_t i = 0;
    (seqpar::detail::check_disjoint(where, "workspace", workspace, names[i++], views), ...);
  }

  /// An output (o and lse forward; dq, dk, dv backward) may not share memory with q, k or v.
  template <class Out>
  static void not_input(const char* where, const char* name, const Out& out, ThdView<const T> q, ThdView<const T> k,
                        ThdView<const T> v) {
    seqpar::detail::check_disjoint(where, name, out, "q", q);
    seqpar::detail::check_disjoint(where, name, out, "k", k);
    seqpar::detail::check_disjoint(where, name, out, "v", v);
  }

  /// Forwards remembered for backward's check of its O and LSE (per object: one object serving every
  /// layer checks the last kForwardRecords layers' forwards).
  static constexpr std::size_t kForwardRecords = 64;
  /// Distinct (batch, mask) pairs whose forward ran, remembered for backward's check that one did (least
  /// recently run first out: 256 pairs in flight between a forward and its backward, micro-batches x masks).
  static constexpr std::size_t kForwardKeys = 256;

  /// Records that a forward of (batch, mask) ran on this object, with attention sinks or without (any
  /// context: nothing is read).
  void remember_forward_ran(std::uint64_t batch, AttentionMask mask, bool sinks = false) noexcept {
    ++clock_;
    const std::uint8_t pass = sinks ? kWithSinks : kWithoutSinks;
    std::size_t oldest = 0;
    for (std::size_t i = 0; i < kForwardKeys; ++i) {
      if (keys_[i].stamp != 0 && keys_[i].batch == batch && keys_[i].window == mask.window) {
        keys_[i].stamp = clock_;
        keys_[i].passes |= pass;
        return;
      }
      if (keys_[i].stamp < keys_[oldest].stamp) oldest = i;
    }
    keys_[oldest] = {batch, mask.window, clock_, pass};
  }

  /// Refuses a backward of (batch, mask) when no forward of that batch under that mask ran on this object
  /// (among its last kForwardKeys distinct pairs): its O and LSE, backward's inputs, were then written by
  /// nothing this object computed (zeros, another object's, a buffer never filled) and the gradients
  /// would be silently wrong.
  ///
  /// Attention sinks across the two passes: a forward with sinks writes O and LSE with the sinks' term;
  /// the kernels' backward, handed those, gives the gradients of that function, so a backward without
  /// sinks after it is meaningful (dQ, dK, dV exact, the sinks held constant: frozen sinks) and is
  /// accepted. A backward with sinks whose forward ran without them would give dsinks of a softmax that
  /// never ran (O and LSE lack the sinks' term): refused, naming `sinks`.
  void forward_ran(const char* where, std::uint64_t batch, AttentionMask mask, bool sinks = false) const {
    for (const Key& k : keys_)
      if (k.stamp != 0 && k.batch == batch && k.window == mask.window) {
        if (sinks && (k.passes & kWithSinks) == 0)
          seqpar::detail::throw_invalid(
              where, "sinks", "given",
              "backward with attention sinks, but every forward of this batch under " + mask.to_string() +
                  " on this object ran without sinks: its O and LSE lack the sinks' term, so dsinks would be the "
                  "gradient of a softmax that never ran (pass the same sinks to forward, or none to both)");
        return;
      }
    seqpar::detail::throw_invalid(
        where, "batch", "fingerprint " + std::to_string(batch) + " under " + mask.to_string(),
        "backward called before any forward of this batch under this mask on this object (it remembers its last " +
            std::to_string(kForwardKeys) +
            " distinct batch and mask pairs): run forward first, with the same batch and mask; its O and LSE are "
            "backward's inputs");
  }

  /// Records where a forward of (batch, mask) wrote O and LSE, and a few of the values (a fixed ring:
  /// recording and checking allocate nothing). Host-synchronous contexts only: a device's values cannot
  /// be sampled without a synchronizing copy.
  void remember_forward(std::uint64_t batch, AttentionMask mask, ThdView<T> o, LseView<A> lse) noexcept {
    if constexpr (Exec::kHostSynchronous) {
      if (o.tokens == 0) return;
      Record& r = records_[next_];
      next_ = (next_ + 1) % kForwardRecords;
      r = {o.data, lse.data, o.tokens, batch, mask.window, sample(o), sample(lse)};
    }
  }

  /// Refuses O or LSE that still hold what a forward of another batch, or of the same batch under another
  /// mask, wrote (most recent record first). Memory overwritten since (copied, offloaded and brought back,
  /// recycled by an allocator) cannot be told apart and is taken as given.
  void forward_of(const char* where, std::uint64_t batch, AttentionMask mask, ThdView<const T> o,
                  LseView<const A> lse) const {
    if constexpr (Exec::kHostSynchronous) {
      if (o.tokens == 0) return;
      const auto o_now = sample(o);
      const auto lse_now = sample(lse);
      bool o_seen = false, lse_seen = false;
      for (std::size_t i = 0; i < kForwardRecords && !(o_seen && lse_seen); ++i) {
        const Record& r = records_[(next_ + kForwardRecords - 1 - i) % kForwardRecords];
        if (r.batch == 0 || r.rows != o.tokens) continue;
        const auto refuse = [&](const char* name, const void* data) {
          if (r.batch != batch)
            seqpar::detail::throw_invalid(
                where, name, data,
                "holds the output of a forward of another batch (fingerprint " + std::to_string(r.batch) +
                    ", this batch's " + std::to_string(batch) +
                    "): pass the O and LSE a forward of this batch wrote (a stale buffer of an earlier step?)");
          seqpar::detail::throw_invalid(where, name, data,
                                        "holds the output of a forward of this batch under another mask (" +
                                            AttentionMask{r.window}.to_string() + ", this call's " + mask.to_string() +
                                            "): a layer's backward takes the mask of its forward");
        };
        const bool same = r.batch == batch && r.window == mask.window;
        if (!o_seen && r.o == static_cast<const void*>(o.data) && r.o_samples == o_now) {
          o_seen = true;
          if (!same) refuse("o", o.data);
        }
        if (!lse_seen && r.lse == static_cast<const void*>(lse.data) && r.lse_samples == lse_now) {
          lse_seen = true;
          if (!same) refuse("lse", lse.data);
        }
      }
    }
  }

 private:
  struct Record {
    const void* o = nullptr;
    const void* lse = nullptr;
    std::int64_t rows = 0;
    std::uint64_t batch = 0;  // DocumentBatch::fingerprint(); 0: empty slot
    std::int64_t window = 0;  // the forward's mask
    std::array<std::byte, 3 * sizeof(T)> o_samples{};
    std::array<std::byte, 3 * sizeof(A)> lse_samples{};
  };

  template <class V>
  static std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> sample(const ThdView<V>& o) noexcept {
    std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> out{};
    const std::int64_t n = o.tokens;
    const V* at[3] = {o.row(0, 0), o.row(n / 2, o.heads / 2) + o.head_dim / 2,
                      o.row(n - 1, o.heads - 1) + o.head_dim - 1};
    for (std::size_t i = 0; i < 3; ++i) std::memcpy(out.data() + i * sizeof(V), at[i], sizeof(V));
    return out;
  }
  template <class V>
  static std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> sample(const LseView<V>& lse) noexcept {
    std::array<std::byte, 3 * sizeof(std::remove_const_t<V>)> out{};
    const std::int64_t n = lse.tokens;
    const V* at[3] = {&lse(0, 0), &lse(lse.heads / 2, n / 2), &lse(lse.heads - 1, n - 1)};
    for (std::size_t i = 0; i < 3; ++i) std::memcpy(out.data() + i * sizeof(V), at[i], sizeof(V));
    return out;
  }

  static constexpr std::uint8_t kWithoutSinks = 1, kWithSinks = 2;
  struct Key {
    std::uint64_t batch = 0;
    std::int64_t window = 0;
    std::uint64_t stamp = 0;  // 0: empty slot; else when a forward of (batch, window) last ran
    std::uint8_t passes = 0;  // kWithoutSinks | kWithSinks: how the forwards of (batch, window) ran
  };

  std::array<Record, kForwardRecords> records_{};
  std::size_t next_ = 0;  // the slot the next forward records in
  std::array<Key, kForwardKeys> keys_{};
  std::uint64_t clock_ = 0;
};

}  // namespace seqpar::runtime
