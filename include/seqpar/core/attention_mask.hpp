// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/hash.hpp"

namespace seqpar {

/// Visible (query, key) pairs of one document of `len` tokens under document-causal attention with a
/// sliding window of `window` keys (0: no window). Row i sees min(i + 1, window) keys, so the area is
/// the causal triangle up to the window and a band of `window` keys per row after it.
[[nodiscard]] constexpr std::int64_t document_area(std::int64_t len, std::int64_t window) noexcept {
  if (window <= 0 || window >= len) return detail::triangle(len);
  return detail::triangle(window) + (len - window) * window;
}

/// The mask of one attention call over a packed batch: document-causal (a query sees its own document's
/// keys up to itself), optionally narrowed to a sliding window of `window` keys (the query's own key
/// included: Mistral's and Gemma's convention, FlashAttention's window_size = (window - 1, 0)).
///
/// A mask is a property of the call, not of the batch: a model that mixes window and full layers keeps
/// one placement of its tokens (DistributedAttention::owned_ranges(batch)) for every layer and passes each
/// layer's mask to forward and backward (MagiAttention's "a new mask reuses the same dispatch"). Where
/// tokens live is balanced once for the model's mask mix (MaskMix), declared when the attention is built.
///
/// @code
/// attn.forward(batch, AttentionMask::sliding_window(128), q, k, v, o, lse);   // a window layer
/// attn.forward(batch, AttentionMask::causal(), q, k, v, o, lse);              // a full layer, same rows
/// @endcode
struct AttentionMask {
  /// Keys a query sees, its own included; 0: no window (the whole causal prefix of its document).
  std::int64_t window = 0;

  [[nodiscard]] static constexpr AttentionMask causal() noexcept { return {}; }
  /// A sliding window of `window` >= 1 keys (throws std::invalid_argument naming it otherwise).
  [[nodiscard]] static AttentionMask sliding_window(std::int64_t window) {
    detail::require(window >= 1, "AttentionMask::sliding_window", "window", window,
                    "must be >= 1 (each query sees its `window` most recent keys, itself included; "
                    "AttentionMask::causal() for no window)");
    return {window};
  }

  /// Whether some document of `longest` tokens is narrowed by the window.
  [[nodiscard]] constexpr bool binds(std::int64_t longest) const noexcept { return window > 0 && window < longest; }
  /// Visible pairs of a document of `len` tokens under this mask.
  [[nodiscard]] constexpr std::int64_t area(std::int64_t len) const noexcept { return document_area(len, window); }

  /// Throws std::invalid_argument naming `name` (e.g. "mask.window") when the window is negative.
  void validate(std::string_view where, std::string_view name = "mask.window") const {
    detail::require(window >= 0, where, name, window,
                    "must be >= 0 (0: causal, no window; w >= 1: each query sees its w most recent keys)");
  }

  [[nodiscard]] std::string to_string() const {
    return window > 0 ? "sliding_window(" + std::to_string(window) + ")" : std::string("causal");
  }
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    return Hash64{}.add(std::string_view("mask")).add(window).value();
  }

  friend constexpr bool operator==(const AttentionMask&, const AttentionMask&) = default;
};

/// The masks a model's attention layers use, with how many layers use each: what a placement is
/// balanced for. A placement is made once per batch and serves every layer, so Per-Doc, Whole-Doc,
/// Hybrid and BatchAware balance the layer-weighted mean of the masks' work: a model of 24 full and 24
/// window-128 layers declares `{{AttentionMask::causal(), 24}, {AttentionMask::sliding_window(128), 24}}`.
/// Empty (the default): every layer causal. Any mask may still be called; the mix only steers balance.
///
/// @code
/// using S = Strategy<partition::PerDoc, comm::AllGather>;
/// DistributedAttention<S, attention::CpuFlash<float>> attn(
///     transport, shape, {.masks = {{AttentionMask::causal(), 24}, {AttentionMask::sliding_window(128), 24}}});
/// @endcode
class MaskMix {
 public:
  struct Part {
    AttentionMask mask;
    std::int64_t layers = 1;
  };

  MaskMix() = default;
  MaskMix(std::initializer_list<Part> parts) : parts_(parts) {}
  explicit MaskMix(std::vector<Part> parts) : parts_(std::move(parts)) {}
  /// Every layer of the model under one mask.
  [[nodiscard]] static MaskMix only(AttentionMask mask) { return MaskMix{{mask, 1}}; }

  /// Whether any part was declared (an empty mix means every layer causal).
  [[nodiscard]] bool declared() const noexcept { return !parts_.empty(); }
  /// The parts as declared, or {causal, 1} when none was.
  [[nodiscard]] std::vector<Part> parts() const { return parts_.empty() ? std::vector<Part>{{}} : parts_; }
  /// The distinct masks of the mix, in the order declared (causal when none was).
  [[nodiscard]] std::vector<AttentionMask> masks() const {
    std::vector<AttentionMask> out;
    for (const Part& p : parts())
      if (std::find(out.begin(), out.end(), p.mask) == out.end()) out.push_back(p.mask);
    return out;
  }

  /// The layer-weighted mean of f(mask) over the parts: the balance target of a placement.
  template <class F>
  [[nodiscard]] double mean(F&& f) const {
    if (parts_.empty()) return static_cast<double>(f(AttentionMask{}));
    double sum = 0, layers = 0;
    for (const Part& p : parts_) {
      sum += static_cast<double>(p.layers) * static_cast<double>(f(p.mask));
      layers += static_cast<double>(p.layers);
    }
    return sum / layers;
  }
  /// The mean visible pairs per layer of a document of `len` tokens.
  [[nodiscard]] double document_area(std::int64_t len) const {
    return mean([len](AttentionMask m) { return m.area(len); });
  }
  /// The mean pairs per layer of rows [a, b) of a document (row i costs min(i + 1, window) pairs per mask).
  [[nodiscard]] double rows_area(std::int64_t a, std::int64_t b) const {
    return mean([a, b](AttentionMask m) { return m.area(b) - m.area(a); });
  }

  /// Throws std::invalid_argument naming the part when a mask is invalid or a layer count below 1.
  void validate(std::string_view where, const std::string& name = "masks") const {
    for (std::size_t i = 0; i < parts_.size(); ++i) {
      const std::string at = name + "[" + std::to_string(i) + "]";
      parts_[i].mask.validate(where, at + ".mask.window");
      detail::require(parts_[i].layers >= 1, where, at + ".layers", parts_[i].layers,
                      "must be >= 1 (the number of layers of the model that use this mask)");
    }
  }

  /// What the mix makes a placement depend on (the parts, in order), for plan keys and the agreement.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    Hash64 h;  // allocation-free: compared on every call
    h.add(std::string_view("mix"));
    if (parts_.empty()) return h.add(std::int64_t{0}).add(std::int64_t{1}).value();  // {causal: 1}
    for (const Part& p : parts_) h.add(p.mask.window).add(p.layers);
    return h.value();
  }
  [[nodiscard]] std::string to_string() const {
    std::string s = "{";
    for (const Part& p : parts())
      s += (s.size() > 1 ? ", " : "") + p.mask.to_string() + ": " + std::to_string(p.layers);
    return s + "}";
  }

 private:
  std::vector<Part> parts_;
};

}  // namespace seqpar
