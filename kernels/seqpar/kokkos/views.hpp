// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Kokkos::View <-> seqpar views, without copies: a LayoutRight rank-3 View (tokens, heads, head_dim)
/// is a ThdView, a LayoutRight rank-2 View (heads, tokens) is an LseView, and back (unmanaged Views
/// over the same memory, LayoutStride since seqpar views may be head or token slices).
///
/// @code
/// Kokkos::View<float***, Kokkos::LayoutRight> q("q", tokens, heads, d);
/// Kokkos::View<float**, Kokkos::LayoutRight> lse("lse", heads, tokens);
/// flash.forward(shape, kokkos::as_thd(q), kokkos::as_thd(k), kokkos::as_thd(v), slices, kokkos::as_thd(o),
///               kokkos::as_lse(lse), ws);
/// @endcode

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <type_traits>

#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::kokkos {

/// The ThdView of a LayoutRight rank-3 View (tokens, heads, head_dim). Const-ness follows the View's
/// element type (`View<const float***>` gives `ThdView<const float>`).
template <class DataType, class... Props>
[[nodiscard]] auto as_thd(const Kokkos::View<DataType, Props...>& v) {
  using V = Kokkos::View<DataType, Props...>;
  static_assert(V::rank == 3, "kokkos::as_thd: a THD tensor is a rank-3 View (tokens, heads, head_dim)");
  static_assert(std::is_same_v<typename V::array_layout, Kokkos::LayoutRight>,
                "kokkos::as_thd: the View must be LayoutRight (head_dim contiguous)");
  using T = typename V::value_type;
  constexpr const char* where = "kokkos::as_thd";
  seqpar::detail::require(v.extent(1) <= 1u << 30, where, "view.extent(1)", v.extent(1), "too many heads for an int");
  seqpar::detail::require(v.extent(2) <= 1u << 30, where, "view.extent(2)", v.extent(2),
                          "head_dim too large for an int");
  return ThdView<T>{v.data(),
                    static_cast<std::int64_t>(v.extent(0)),
                    static_cast<int>(v.extent(1)),
                    static_cast<int>(v.extent(2)),
                    static_cast<std::int64_t>(v.stride(0)),
                    static_cast<std::int64_t>(v.stride(1))};
}

/// The LseView of a LayoutRight rank-2 View (heads, tokens).
template <class DataType, class... Props>
[[nodiscard]] auto as_lse(const Kokkos::View<DataType, Props...>& v) {
  using V = Kokkos::View<DataType, Props...>;
  static_assert(V::rank == 2, "kokkos::as_lse: an LSE buffer is a rank-2 View (heads, tokens)");
  static_assert(std::is_same_v<typename V::array_layout, Kokkos::LayoutRight>,
                "kokkos::as_lse: the View must be LayoutRight (tokens contiguous)");
  using T = typename V::value_type;
  seqpar::detail::require(v.extent(0) <= 1u << 30, "kokkos::as_lse", "view.extent(0)", v.extent(0),
                          "too many heads for an int");
  return LseView<T>{v.data(), static_cast<int>(v.extent(0)), static_cast<std::int64_t>(v.extent(1)),
                    static_cast<std::int64_t>(v.stride(0))};
}

/// An unmanaged View over a ThdView's memory (in MemorySpace), (tokens, heads, head_dim).
template <class MemorySpace = Kokkos::HostSpace, class T>
[[nodiscard]] auto as_view(ThdView<T> v) {
  using View = Kokkos::View<T***, Kokkos::LayoutStride, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const Kokkos::LayoutStride layout(static_cast<std::size_t>(v.tokens), static_cast<std::size_t>(v.token_stride),
                                    static_cast<std::size_t>(v.heads), static_cast<std::size_t>(v.head_stride),
                                    static_cast<std::size_t>(v.head_dim), 1);
  return View(v.data, layout);
}

/// An unmanaged View over an LseView's memory (in MemorySpace), (heads, tokens).
template <class MemorySpace = Kokkos::HostSpace, class T>
[[nodiscard]] auto as_view(LseView<T> v) {
  using View = Kokkos::View<T**, Kokkos::LayoutStride, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const Kokkos::LayoutStride layout(static_cast<std::size_t>(v.heads), static_cast<std::size_t>(v.head_stride),
                                    static_cast<std::size_t>(v.tokens), 1);
  return View(v.data, layout);
}

}  // namespace seqpar::kokkos
