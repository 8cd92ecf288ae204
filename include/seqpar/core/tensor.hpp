// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Non-owning THD view: element (t, h, d) at data[t * token_stride + h * head_stride + d].
/// The head_dim axis is contiguous (stride 1) so kernels can vectorise along it.
template <class T>
struct ThdView {
  T* data = nullptr;
  std::int64_t tokens = 0;
  int heads = 0;
  int head_dim = 0;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;

  /// Dense (tokens, heads, head_dim) view.
  [[nodiscard]] static ThdView dense(T* data, std::int64_t tokens, int heads, int head_dim) noexcept {
    return {data, tokens, heads, head_dim, std::int64_t{heads} * head_dim, head_dim};
  }
  [[nodiscard]] T* row(std::int64_t t, int h) const noexcept { return data + t * token_stride + h * head_stride; }
  [[nodiscard]] T& operator()(std::int64_t t, int h, int d) const noexcept { return row(t, h)[d]; }

  /// Rows [first, first + count) of the token axis.
  [[nodiscard]] ThdView tokens_slice(std::int64_t first, std::int64_t count) const noexcept {
    return {data + first * token_stride, count, heads, head_dim, token_stride, head_stride};
  }
  /// Heads [first, first + count): a strided view that copies nothing.
  [[nodiscard]] ThdView heads_slice(int first, int count) const noexcept {
    return {data + first * head_stride, tokens, count, head_dim, token_stride, head_stride};
  }
  // Views convert to const views implicitly. A template, so that ThdView<const T> declares no
  // conversion to itself (nvcc warns about one even when its constraint removes it).
  template <class U>
  requires(std::is_same_v<U, const T> && !std::is_const_v<T>) operator ThdView<U>() const noexcept {  // NOLINT
    return {data, tokens, heads, head_dim, token_stride, head_stride};
  }
};

/// Non-owning (heads, tokens) view of log-sum-exp values: element (h, t) at data[h * head_stride + t].
template <class T>
struct LseView {
  T* data = nullptr;
  int heads = 0;
  std::int64_t tokens = 0;
  std::int64_t head_stride = 0;

  [[nodiscard]] static LseView dense(T* data, int heads, std::int64_t tokens) noexcept {
    return {data, heads, tokens, tokens};
  }
  [[nodiscard]] T& operator()(int h, std::int64_t t) const noexcept { return data[h * head_stride + t]; }
  [[nodiscard]] LseView tokens_slice(std::int64_t first, std::int64_t count) const noexcept {
    return {data + first, heads, count, head_stride};
  }
  [[nodiscard]] LseView heads_slice(int first, int count) const noexcept {
    return {data + first * head_stride, count, tokens, head_stride};
  }
  template <class U>
  requires(std::is_same_v<U, const T> && !std::is_const_v<T>) operator LseView<U>()
      const noexcept {  // NOLINT (a template: see ThdView)
    return {data, heads, tokens, head_stride};
  }
};

/// Owning dense THD tensor, for tests, examples and benchmarks (the library's hot path never owns).
template <class T>
struct ThdTensor {
  std::vector<T> storage;
  std::int64_t tokens = 0;
  int heads = 0;
  int head_dim = 0;

  ThdTensor() = default;
  ThdTensor(std::int64_t tokens_, int heads_, int head_dim_)
      : storage(static_cast<std::size_t>(tokens_) * static_cast<std::size_t>(heads_) *
                static_cast<std::size_t>(head_dim_)),
        tokens(tokens_),
        heads(heads_),
        head_dim(head_dim_) {}
  [[nodiscard]] ThdView<T> view() noexcept { return ThdView<T>::dense(storage.data(), tokens, heads, head_dim); }
  [[nodiscard]] ThdView<const T> view() const noexcept {
    return ThdView<const T>::dense(storage.data(), tokens, heads, head_dim);
  }
};

/// Owning dense (heads, tokens) LSE buffer.
template <class T>
struct LseTensor {
  std::vector<T> storage;
  int heads = 0;
  std::int64_t tokens = 0;

  LseTensor() = default;
  LseTensor(int heads_, std::int64_t tokens_)
      : storage(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(tokens_)), heads(heads_), tokens(tokens_) {}
  [[nodiscard]] LseView<T> view() noexcept { return LseView<T>::dense(storage.data(), heads, tokens); }
  [[nodiscard]] LseView<const T> view() const noexcept {
    return LseView<const T>::dense(storage.data(), heads, tokens);
  }
};

namespace detail {

/// Whether T blocks of `block` contiguous elements, laid out along two axes (counts n1, n2 and
/// strides s1, s2), never share an element, and the offset of the last element fits in both int64
/// elements and ptrdiff_t bytes of `elem` size. Accepts every non-overlapping layout (THD, HTD, a
/// heads_slice of either); refuses negative strides, a zero stride on an axis of two or more, rows
/// that overlap (a token stride smaller than heads x head_dim in THD) and sizes whose address
/// arithmetic would overflow. Axes of count 0 or 1 take any stride. An empty view addresses nothing,
/// but code still forms the start of each of its rows (a head's LSE row, a heads_slice): on an axis of
/// count two or more, (count - 1) x |stride| elements must fit in ptrdiff_t bytes even then.
[[nodiscard]] constexpr bool strided_layout_ok(std::int64_t block, std::int64_t n1, std::int64_t s1, std::int64_t n2,
                                               std::int64_t s2, std::size_t elem) noexcept {
  if (block < 0 || n1 < 0 || n2 < 0) return false;
  constexpr auto kMaxBytes = static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max());
  const auto reach_fits = [&](std::int64_t n, std::int64_t s) {
    if (n < 2) return true;
    const std::uint64_t magnitude =
        s < 0 ? std::uint64_t{0} - static_cast<std::uint64_t>(s) : static_cast<std::uint64_t>(s);
    return magnitude <= kMaxBytes / elem / static_cast<std::uint64_t>(n - 1);
  };
  if (!reach_fits(n1, s1) || !reach_fits(n2, s2)) return false;
  if (n1 == 0 || n2 == 0 || block == 0) return true;
  if ((n1 > 1 && s1 < 0) || (n2 > 1 && s2 < 0)) return false;
  // The axis with the smaller stride is inner: its blocks must not overlap, and the outer stride
  // must clear the inner axis's whole run.
  std::int64_t na = n1 > 1 ? n1 : 1, a = n1 > 1 ? s1 : 0, nb = n2 > 1 ? n2 : 1, b = n2 > 1 ? s2 : 0;
  if (nb > 1 && (na == 1 || b < a)) {
    std::swap(na, nb);
    std::swap(a, b);
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  if (na > 1 && (a < block || a > (kMax - block) / (na - 1))) return false;
  const std::int64_t inner = (na - 1) * a + block;  // elements the inner axis spans
  if (nb > 1 && (b < inner || b > (kMax - inner) / (nb - 1))) return false;
  const std::int64_t span = (nb - 1) * b + inner;
  return static_cast<std::uint64_t>(span) <=
         static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()) / elem;
}

template <class T>
[[nodiscard]] constexpr bool layout_ok(const ThdView<T>& v) noexcept {
  return strided_layout_ok(v.head_dim, v.tokens, v.token_stride, v.heads, v.head_stride, sizeof(T));
}
template <class T>
[[nodiscard]] constexpr bool layout_ok(const LseView<T>& v) noexcept {
  return strided_layout_ok(1, v.tokens, 1, v.heads, v.head_stride, sizeof(T));
}

template <class T>
void check_view(const ThdView<T>& v, const char* where, const char* name, std::int64_t tokens, int heads,
                int head_dim) {
  if (v.tokens == tokens && v.heads == heads && v.head_dim == head_dim && (v.tokens == 0 || v.data != nullptr) &&
      layout_ok(v))
    return;  // the hot path builds no message
  const std::string n(name);
  require(v.tokens == tokens, where, n + ".tokens", v.tokens, "expected " + std::to_string(tokens));
  require(v.heads == heads, where, n + ".heads", v.heads, "expected " + std::to_string(heads));
  require(v.head_dim == head_dim, where, n + ".head_dim", v.head_dim, "expected " + std::to_string(head_dim));
  require(v.tokens == 0 || v.data != nullptr, where, n + ".data", "null", "non-empty view without storage");
  require(v.token_stride >= 0 && v.head_stride >= 0, where, n + ".token_stride", v.token_stride,
          "strides must be non-negative (head_stride = " + std::to_string(v.head_stride) + ")");
  require(false, where, n + ".token_stride", v.token_stride,
          "with head_stride = " + std::to_string(v.head_stride) + ", " + std::to_string(v.tokens) + " tokens x " +
              std::to_string(v.heads) + " heads x head_dim " + std::to_string(v.head_dim) +
              " elements overlap or their offsets overflow (THD needs token_stride >= heads x head_dim and "
              "head_stride >= head_dim)");
}

template <class T>
void check_view(const LseView<T>& v, const char* where, const char* name, int heads, std::int64_t tokens) {
  if (v.heads == heads && v.tokens == tokens && (v.tokens == 0 || v.data != nullptr) && layout_ok(v)) return;
  const std::string n(name);
  require(v.heads == heads, where, n + ".heads", v.heads, "expected " + std::to_string(heads));
  require(v.tokens == tokens, where, n + ".tokens", v.tokens, "expected " + std::to_string(tokens));
  require(v.tokens == 0 || v.data != nullptr, where, n + ".data", "null", "non-empty view without storage");
  require(false, where, n + ".head_stride", v.head_stride,
          "the rows of " + std::to_string(v.heads) + " heads x " + std::to_string(v.tokens) +
              " tokens overlap or their offsets overflow (need head_stride >= tokens)");
}

}  // namespace detail
}  // namespace seqpar
