// SPDX-License-Identifier: Apache-2.0
// The partitioners and communicator configurations that the exhaustive checks enumerate, in one place:
// tests/strategy/test_combinations.cpp (every combination against fp64 on 1..8 ranks),
// tests/fuzz/fuzz_plans.cpp (every combination's compiled programs on random batches),
// tests/support/transport_cases.hpp (a selection of them on every transport), and
// bench/comm_volume.cpp (its rows take their communicator configurations from here). A new partitioner
// or communicator configuration is added here once and every one of them picks it up.
//
// Under a sanitizer (tests/support/sanitizer.hpp: CI's ASan + UBSan and TSan builds) for_each_combination
// and for_each_communicator visit, and so instantiate, only kSanitizerSweep's diagonal of the table (see
// there); the Release build runs all of it against the fp64 reference.
//
// @code
// seqpar::test::for_each_combination([]<class C>(C) {
//   using S = typename C::strategy;               // Strategy<Partitioner, Communicator>
//   typename S::Arguments args = C::arguments();  // with the variant's communicator arguments
//   run<S>(C::name(), args);                      // "Zigzag x Ring(sharding-aware)"
// });
// @endcode
#pragma once

#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "sanitizer.hpp"  // beside this header: bench/comm_volume.cpp includes it by a relative path

namespace seqpar::test {

/// Every partitioner.
using Partitioners =
    std::tuple<partition::Uniform, partition::Zigzag, partition::PerDoc, partition::WholeDoc, partition::Hybrid,
               partition::BatchAware<partition::Uniform>, partition::BatchAware<partition::PerDoc>>;

/// The name tests print for partitioner P.
template <class P>
inline constexpr std::string_view partitioner_name{};
template <>
inline constexpr std::string_view partitioner_name<partition::Uniform>{"Uniform"};
template <>
inline constexpr std::string_view partitioner_name<partition::Zigzag>{"Zigzag"};
template <>
inline constexpr std::string_view partitioner_name<partition::PerDoc>{"PerDoc"};
template <>
inline constexpr std::string_view partitioner_name<partition::WholeDoc>{"WholeDoc"};
template <>
inline constexpr std::string_view partitioner_name<partition::Hybrid>{"Hybrid"};
template <>
inline constexpr std::string_view partitioner_name<partition::BatchAware<partition::Uniform>>{"BatchAware<Uniform>"};
template <>
inline constexpr std::string_view partitioner_name<partition::BatchAware<partition::PerDoc>>{"BatchAware<PerDoc>"};

/// Communicator configurations: a communicator type, the Arguments it runs with, and its name.
namespace communicators {

using HierarchicalA2aRing = comm::Hierarchical<comm::AllToAll, comm::Ring>;

struct AllToAll {
  using type = comm::AllToAll;
  static constexpr std::string_view name{"AllToAll"};
  static type::Arguments arguments() { return {}; }
};
struct Ring {
  using type = comm::Ring;
  static constexpr std::string_view name{"Ring"};
  static type::Arguments arguments() { return {}; }
};
struct RingShardingAware {
  using type = comm::Ring;
  static constexpr std::string_view name{"Ring(sharding-aware)"};
  static type::Arguments arguments() {
    type::Arguments a;
    a.sharding_aware = true;
    return a;
  }
};
struct Hierarchical {
  using type = HierarchicalA2aRing;
  static constexpr std::string_view name{"Hierarchical"};
  static type::Arguments arguments() { return {}; }
};
struct HierarchicalShardingAware {
  using type = HierarchicalA2aRing;
  static constexpr std::string_view name{"Hierarchical(sharding-aware ring)"};
  static type::Arguments arguments() {
    type::Arguments a;
    a.outer.sharding_aware = true;
    return a;
  }
};
struct AllGather {
  using type = comm::AllGather;
  static constexpr std::string_view name{"AllGather"};
  static type::Arguments arguments() { return {}; }
};
struct AllGatherShardingAware {
  using type = comm::AllGather;
  static constexpr std::string_view name{"AllGather(sharding-aware)"};
  static type::Arguments arguments() {
    type::Arguments a;
    a.sharding_aware = true;
    return a;
  }
};

}  // namespace communicators

/// Every communicator configuration, in the order the tests run them.
using Communicators = std::tuple<communicators::AllToAll, communicators::Ring, communicators::RingShardingAware,
                                 communicators::Hierarchical, communicators::HierarchicalShardingAware,
                                 communicators::AllGather, communicators::AllGatherShardingAware>;

inline constexpr std::size_t kNumPartitioners = std::tuple_size_v<Partitioners>;
inline constexpr std::size_t kNumCommunicators = std::tuple_size_v<Communicators>;
inline constexpr std::size_t kNumCombinations = kNumPartitioners * kNumCommunicators;

/// Partitioner P with communicator configuration V: the strategy, its arguments, its name.
template <class P, class V>
struct Combination {
  using partitioner = P;
  using variant = V;
  using strategy = Strategy<P, typename V::type>;

  /// "Partitioner x Communicator(configuration)", as the tests print it.
  static std::string name() { return std::string(partitioner_name<P>) + " x " + std::string(V::name); }
  /// The strategy's default arguments with the configuration's communicator arguments.
  static typename strategy::Arguments arguments() {
    typename strategy::Arguments a;
    a.comm = V::arguments();
    return a;
  }
};

/// The sanitizer sweep: which (partitioner, communicator configuration) pairs, by index into Partitioners and
/// Communicators, the sweeps visit under a sanitizer. A sanitizer's job is memory errors, undefined
/// behaviour and races in the code the tests reach, not re-proving each combination's numbers (the Release
/// build does: all 49 against the fp64 reference), and each combination is its own instantiation of the
/// strategy, the engine and the checks: the whole table made the strategy tests ~60% of the ASan build's
/// compile time. So: one diagonal, pairs (k mod partitioners, (k + kSanitizerSweepOffset) mod communicators)
/// for k < max(partitioners, communicators): every partitioner and every communicator configuration (all
/// four communicator types) at least once. The offset 5 makes it disjoint from the strategies
/// tests/support/transport_cases.hpp runs under the same sanitizers (Ulysses, the zigzag ring, USP, BASP,
/// Llama 3 CP, FlashCP: static_assert there), so that the two together reach 14 distinct pairs.
inline constexpr std::size_t kSanitizerSweepOffset = 5;
constexpr bool in_sanitizer_sweep(std::size_t partitioner, std::size_t communicator) {
  for (std::size_t k = 0; k < std::max(kNumPartitioners, kNumCommunicators); ++k)
    if (k % kNumPartitioners == partitioner && (k + kSanitizerSweepOffset) % kNumCommunicators == communicator)
      return true;
  return false;
}
/// How many combinations for_each_combination visits in this build (all of them without a sanitizer).
inline constexpr std::size_t kNumSweptCombinations =
    kUnderSanitizer ? std::max(kNumPartitioners, kNumCommunicators) : kNumCombinations;

namespace list_detail {
template <class T, class... Ts>
constexpr std::size_t index_of(std::tuple<Ts...>*) {
  std::size_t i = 0;
  const bool found = ((std::is_same_v<T, Ts> || (++i, false)) || ...);
  return found ? i : sizeof...(Ts);
}
template <class... Ts, class Fn>
void for_each_type(std::tuple<Ts...>*, Fn& fn) {
  (fn(std::type_identity<Ts>{}), ...);
}
template <class T, class Tuple>
struct Listed;
template <class T, class... Ts>
struct Listed<T, std::tuple<Ts...>> : std::bool_constant<(std::is_same_v<T, Ts> || ...)> {};
template <class Tuple>
struct AllNamed;
template <class... Ps>
struct AllNamed<std::tuple<Ps...>> : std::bool_constant<(!partitioner_name<Ps>.empty() && ...)> {};
}  // namespace list_detail

/// fn(std::type_identity<T>{}) for every type T of the std::tuple type `Tuple`, in order.
template <class Tuple, class Fn>
void for_each_type(Fn&& fn) {
  list_detail::for_each_type(static_cast<Tuple*>(nullptr), fn);
}

/// Index of T in the std::tuple type `Tuple` (its size when T is not listed).
template <class T, class Tuple>
inline constexpr std::size_t kIndexOf = list_detail::index_of<T>(static_cast<Tuple*>(nullptr));

/// fn(Combination<P, V>{}) for every communicator configuration V, in the order of Communicators; under a
/// sanitizer only those V paired with P in the sanitizer sweep (all of them for a P not in Partitioners).
template <class P, class Fn>
void for_each_communicator(Fn&& fn) {
  constexpr std::size_t p = kIndexOf<P, Partitioners>;
  [&]<std::size_t... C>(std::index_sequence<C...>) {
    (
        [&] {
          if constexpr (!kUnderSanitizer || p == kNumPartitioners || in_sanitizer_sweep(p, C))
            fn(Combination<P, std::tuple_element_t<C, Communicators>>{});
        }(),
        ...);
  }
  (std::make_index_sequence<kNumCommunicators>{});
}

/// fn(Combination<P, V>{}) for every partitioner P and communicator configuration V, partitioner-major
/// (under a sanitizer: the sanitizer sweep's kNumSweptCombinations).
template <class Fn>
void for_each_combination(Fn&& fn) {
  for_each_type<Partitioners>([&]<class P>(std::type_identity<P>) { for_each_communicator<P>(fn); });
}

/// Whether the std::tuple type `Tuple` lists T.
template <class T, class Tuple>
inline constexpr bool kListed = list_detail::Listed<T, Tuple>::value;

static_assert(list_detail::AllNamed<Partitioners>::value,
              "every partitioner of test::Partitioners needs a partitioner_name");

}  // namespace seqpar::test
