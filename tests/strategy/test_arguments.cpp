// SPDX-License-Identifier: Apache-2.0
// Every field of every policy's Arguments reaches the cross-rank agreement. The fields are found
// without asking the policy (aggregate initialization counts them, structured bindings reach them), so
// a field that a policy's for_each_argument leaves out fails here: changing it on one rank must change
// exactly one argument word, and two ranks that differ in it must both get Errc::kMismatch naming it.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include "support/strategy_list.hpp"

#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

using namespace seqpar;

namespace argument_fields {
// Converts to any field type; only named in unevaluated braces, so never defined (external linkage:
// outside the anonymous namespace).
struct AnyField {
  template <class T>
  operator T() const;  // NOLINT(google-explicit-constructor)
};
}  // namespace argument_fields

namespace {

using argument_fields::AnyField;

template <class A, std::size_t... I>
constexpr bool brace_initializable(std::index_sequence<I...>) {
  return requires {
    A{(static_cast<void>(I), AnyField{})...};
  };
}

/// The number of fields of the aggregate A: the most initializers A{...} takes.
template <class A, std::size_t N = 0>
constexpr std::size_t field_count() {
  if constexpr (brace_initializable<A>(std::make_index_sequence<N + 1>{}))
    return field_count<A, N + 1>();
  else
    return N;
}

/// References to the fields of `a`, in declaration order.
template <class A>
auto fields_of(A& a) {
  constexpr std::size_t n = field_count<A>();
  static_assert(n <= 10, "fields_of: add a case for an Arguments with more than 10 fields");
  if constexpr (n == 0) {
    return std::tuple<>{};
  } else if constexpr (n == 1) {
    auto& [f0] = a;
    return std::tie(f0);
  } else if constexpr (n == 2) {
    auto& [f0, f1] = a;
    return std::tie(f0, f1);
  } else if constexpr (n == 3) {
    auto& [f0, f1, f2] = a;
    return std::tie(f0, f1, f2);
  } else if constexpr (n == 4) {
    auto& [f0, f1, f2, f3] = a;
    return std::tie(f0, f1, f2, f3);
  } else if constexpr (n == 5) {
    auto& [f0, f1, f2, f3, f4] = a;
    return std::tie(f0, f1, f2, f3, f4);
  } else if constexpr (n == 6) {
    auto& [f0, f1, f2, f3, f4, f5] = a;
    return std::tie(f0, f1, f2, f3, f4, f5);
  } else if constexpr (n == 7) {
    auto& [f0, f1, f2, f3, f4, f5, f6] = a;
    return std::tie(f0, f1, f2, f3, f4, f5, f6);
  } else if constexpr (n == 8) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7] = a;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7);
  } else if constexpr (n == 9) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8] = a;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8);
  } else {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9] = a;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9);
  }
}

template <class V>
constexpr bool kOptional = false;
template <class V>
constexpr bool kOptional<std::optional<V>> = true;

/// Changes one leaf field to another value of its type.
template <class V>
void perturb(V& v) {
  if constexpr (std::is_same_v<V, bool>)
    v = !v;
  else if constexpr (std::is_integral_v<V>)
    v = static_cast<V>(v + 1);
  else if constexpr (std::is_floating_point_v<V>)
    v = v + 0.5;
  else if constexpr (kOptional<V>)
    v = v.has_value() ? V{} : V{1};
  else if constexpr (std::is_same_v<V, partition::HybridCostFunction>)
    v = v ? V{} : V{[](const partition::HybridCandidate&) { return 1.0; }};
  else
    static_assert(sizeof(V) == 0, "perturb: teach this test to change a field of this type");
}

/// fn(copy of `base` with one leaf field changed), for every leaf field; a field that is itself an
/// aggregate (a nested policy's Arguments) contributes its own leaf fields.
template <class A, class Fn>
void for_each_perturbation(const A& base, Fn&& fn) {
  constexpr std::size_t n = field_count<A>();
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          A copy = base;
          auto& field = std::get<I>(fields_of(copy));
          using F = std::remove_cvref_t<decltype(field)>;
          if constexpr (std::is_aggregate_v<F>) {
            for_each_perturbation(field, [&](const F& changed) {
              A outer = base;
              std::get<I>(fields_of(outer)) = changed;
              fn(outer);
            });
          } else {
            perturb(field);
            fn(copy);
          }
        }(),
        ...);
  }
  (std::make_index_sequence<n>{});
}

/// Leaf fields, counted without the policy's help (nested aggregates by their own leaves).
template <class A>
std::size_t leaf_count() {
  std::size_t n = 0;
  for_each_perturbation(A{}, [&](const A&) { ++n; });
  return n;
}

template <class S>
std::vector<runtime::ArgumentWord> words_of(const typename S::Arguments& args) {
  std::vector<runtime::ArgumentWord> out;
  S::for_each_argument(args, [&](runtime::ArgumentWord w) { out.push_back(std::move(w)); });
  return out;
}

struct Outcome {
  std::vector<std::string> errors;
  std::vector<int> codes;
};

/// Two ranks run one forward of S, rank 1 with `changed`: each rank's error and seqpar::Errc.
template <class S>
Outcome run_pair(const typename S::Arguments& base, const typename S::Arguments& changed) {
  const AttentionShape shape{4, 2, 8};
  const DocumentBatch batch({{24, 9}, {17}});
  Outcome out{std::vector<std::string>(2), std::vector<int>(2, 0)};
  std::mutex mu;
  try {
    backend::inproc::World(2, {.timeout = std::chrono::seconds(20)}).run([&](backend::inproc::Transport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      try {
        DistributedAttention<S, attention::Reference<double>> attn(t, shape, r == 1 ? changed : base);
        std::int64_t local = 0;
        try {
          local = attn.local_tokens(batch);
        } catch (const std::invalid_argument&) {
          // a changed argument the strategy refuses: the call below still agrees first
        }
        AttentionTensors<double> l(local, shape);
        attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
      } catch (const Error& e) {
        const std::lock_guard lock(mu);
        out.errors[r] = e.what();
        out.codes[r] = static_cast<int>(e.errc());
        throw;
      } catch (const std::exception& e) {
        const std::lock_guard lock(mu);
        out.errors[r] = e.what();
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return out;
}

/// Every leaf field of `Policy` (reached as `member` of the strategy's Arguments, named `prefix`...)
/// changes exactly one argument word, and two ranks that differ in it get a mismatch naming it.
template <class S, class A, class Member>
void check_policy(const std::string& label, const std::string& prefix, Member member) {
  const typename S::Arguments base{};
  const auto base_words = words_of<S>(base);
  std::size_t named = 0;
  for_each_perturbation(base.*member, [&](const A& changed_policy) {
    typename S::Arguments changed = base;
    changed.*member = changed_policy;
    const auto words = words_of<S>(changed);
    REQUIRE(words.size() == base_words.size());
    std::vector<std::string> differing;
    for (std::size_t i = 0; i < words.size(); ++i) {
      CHECK(words[i].name == base_words[i].name);
      if (words[i].value != base_words[i].value) differing.push_back(words[i].name);
    }
    INFO(label << ": leaf field " << named << " of " << prefix);
    REQUIRE_MESSAGE(differing.size() == 1, "a field of the policy's Arguments that its for_each_argument leaves out");
    CHECK(differing[0].rfind(prefix, 0) == 0);
    const Outcome w = run_pair<S>(base, changed);
    for (std::size_t r = 0; r < 2; ++r) {
      INFO("rank " << r << ": " << w.errors[r]);
      CHECK(w.codes[r] == static_cast<int>(Errc::kMismatch));
      CHECK(w.errors[r].find("the strategy argument " + differing[0]) != std::string::npos);
    }
    ++named;
  });
  CHECK(named == leaf_count<A>());
}

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("the field count sees every kind of field") {
    CHECK(field_count<partition::Uniform::Arguments>() == 0);
    CHECK(field_count<partition::WholeDoc::Arguments>() == 2);
    CHECK(field_count<partition::Hybrid::Arguments>() == 9);
    CHECK(field_count<partition::BatchAware<partition::WholeDoc>::Arguments>() == 5);
    CHECK(leaf_count<partition::BatchAware<partition::WholeDoc>::Arguments>() == 6);
    CHECK(field_count<comm::Hierarchical<comm::AllToAll, comm::Ring>::Arguments>() == 2);
    CHECK(leaf_count<comm::Hierarchical<comm::AllToAll, comm::Ring>::Arguments>() == 2);
  }

  TEST_CASE("every policy argument changes the agreement, and a disagreement names it") {
    std::size_t partitioner_fields = 0, communicator_fields = 0;
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      using P = typename S::partitioner_type;
      using Comm = typename S::communicator_type;
      // Every Strategy argument is a partitioner's, a communicator's or the step order's.
      const auto words = words_of<S>(typename S::Arguments{});
      CHECK(words.size() == leaf_count<typename P::Arguments>() + leaf_count<typename Comm::Arguments>() +
                                leaf_count<typename S::step_order_type::Arguments>());
      check_policy<S, typename P::Arguments>(C::name(), "partition.", &S::Arguments::partition);
      check_policy<S, typename Comm::Arguments>(C::name(), "comm.", &S::Arguments::comm);
      partitioner_fields += leaf_count<typename P::Arguments>();
      communicator_fields += leaf_count<typename Comm::Arguments>();
    });
    CHECK(partitioner_fields > 0);
    CHECK(communicator_fields > 0);
  }

  TEST_CASE("nested policies' arguments carry their prefix") {
    using Usp = Strategy<partition::BatchAware<partition::WholeDoc>, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    std::vector<std::string> names;
    for (const auto& w : words_of<Usp>({})) names.push_back(w.name);
    const std::vector<std::string> expected{
        "partition.group_size",    "partition.linear_weight",         "partition.equal_groups_when_divisible",
        "partition.respect_nodes", "partition.inner.capacity_factor", "partition.inner.linear_weight",
        "comm.inner_size",         "comm.outer.sharding_aware"};
    CHECK(names == expected);
    check_policy<Usp, partition::BatchAware<partition::WholeDoc>::Arguments>("BASP", "partition.",
                                                                             &Usp::Arguments::partition);
  }
}
