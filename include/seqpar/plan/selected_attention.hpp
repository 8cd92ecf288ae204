// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/plan/compile_all.hpp"
#include "seqpar/replay/predict.hpp"
#include "seqpar/runtime/engine.hpp"
#include "seqpar/runtime/plan_cache.hpp"
#include "seqpar/strategy.hpp"

namespace seqpar::plan {

/// Exact distributed attention that, for every new batch shape, simulates each of the strategies compiled
/// in on the cost model and runs the fastest: the per-batch choice among Strategies... (e.g. Ulysses for
/// few long documents on one node, Hybrid with a sharding-aware ring for many short ones). All ranks
/// reach the same choice without talking (the simulation is deterministic); the choice, its prediction and
/// every candidate's are kept per batch shape, and everything else (cache, transports, executor, failure
/// handling) is the same engine DistributedAttention uses.
///
/// @code
/// using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
/// using FlashCP = Strategy<partition::Hybrid, comm::Ring>;
/// plan::SelectedAttention<attention::CpuFlash<float>, Ulysses, FlashCP>::Arguments args;
/// args.simulation.hardware = replay::profiles::h100_sxm();
/// plan::SelectedAttention<attention::CpuFlash<float>, Ulysses, FlashCP> attn(transport, shape, args);
/// attn.forward(batch, q, k, v, o, lse);            // lay q, k, v out by attn.owned_ranges(batch)
/// const auto& why = attn.choice(batch);            // why.name, why.predicted_s, why.predictions
/// @endcode
namespace detail {

/// SelectedAttention's PlanCompiler: chooses a strategy per batch when it places it (simulating every
/// candidate under every mask of the mix, weighted by its layers), and compiles each mask's programs
/// with the strategy chosen for the batch. The choices are kept per batch (bounded); a choice evicted
/// while its placement stays cached is made again (deterministic, the same on every rank).
template <class... Strategies>
class SelectingCompiler final : public runtime::PlanCompiler {
 public:
  static constexpr std::size_t kCount = sizeof...(Strategies);
  struct Arguments {
    std::tuple<typename Strategies::Arguments...> strategies{};
    std::array<std::string, kCount> names{};
    replay::SimulationOptions simulation{};
    double seconds_per_token = 0.0;
    int ranks_per_node = 0;
    MaskMix masks{};
  };
  struct Choice {
    int index = -1;
    std::string name;
    double predicted_s = 0;
    std::array<double, kCount> predictions{};
    std::array<std::string, kCount> refusals{};
  };
  static constexpr std::size_t kChoiceEntries = 32;

  SelectingCompiler(Arguments args, const AttentionShape& shape) : args_(std::move(args)), shape_(shape) {
    args_.simulation.hardware.validate("SelectedAttention: args.simulation.hardware");
    seqpar::detail::require(args_.seconds_per_token >= 0 && std::isfinite(args_.seconds_per_token), "SelectedAttention",
                            "args.seconds_per_token", args_.seconds_per_token, "must be finite and >= 0");
    args_.masks.validate("SelectedAttention", "args.masks");
    for (std::size_t i = 0; i < kCount; ++i)
      if (args_.names[i].empty()) args_.names[i] = "strategy " + std::to_string(i);
    Hash64 h;
    (h.add(std::string_view(typeid(Strategies).name())), ...);
    for (const auto& n : args_.names) h.add(std::string_view(n));
    signature_ = h.add(std::int64_t{args_.ranks_per_node}).value();
  }

  [[nodiscard]] const std::string& name(std::size_t i) const { return args_.names[i]; }
  [[nodiscard]] int ranks_per_node() const noexcept { return args_.ranks_per_node; }

  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topology) const override {
    Placement out;
    choose(batch, topology, &out);
    return out;
  }

  void compile(const DocumentBatch& batch, const Placement& placement, AttentionMask mask, const AttentionShape& shape,
               int rank, ShardPlan& plan, comm::CompiledAttention& program) const override {
    const int index = choice(batch, placement.topology).index;
    const auto one = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      if (static_cast<int>(I) != index) return;
      using S = std::tuple_element_t<I, std::tuple<Strategies...>>;
      auto compiled = S::compile(arguments<I>(placement.topology), placement, batch, mask, shape, rank);
      if (!compiled.status)
        throw std::invalid_argument("SelectedAttention: " + args_.names[I] + ": " + compiled.refused_by + " under " +
                                    mask.to_string() + ": " + compiled.status.reason);
      plan = std::move(compiled.plan);
      program = std::move(compiled.program);
    };
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (one(std::integral_constant<std::size_t, I>{}), ...);
    }
    (std::make_index_sequence<kCount>{});
  }

  [[nodiscard]] const MaskMix& masks() const noexcept override { return args_.masks; }
  [[nodiscard]] std::uint64_t signature() const noexcept override { return signature_; }
  [[nodiscard]] std::span<const runtime::ArgumentWord> argument_words() const noexcept override { return {}; }

  /// The choice for `batch` (made again if it was evicted). Thread-safe: plan_ahead's thread chooses too.
  [[nodiscard]] Choice choice(const DocumentBatch& batch, const Topology& topology) const {
    {
      const std::lock_guard lock(mutex_);
      for (const auto& [key, c] : choices_)
        if (runtime::same_batch(key, batch)) return c;
    }
    return choose(batch, topology, nullptr);
  }
  [[nodiscard]] std::size_t cached_choices() const {
    const std::lock_guard lock(mutex_);
    return choices_.size();
  }

 private:
  template <std::size_t I>
  [[nodiscard]] auto arguments(const Topology& topology) const {
    auto a = std::get<I>(args_.strategies);
    a.ranks_per_node = topology.ranks_per_node;
    a.masks = args_.masks;
    return a;
  }

  // Simulates every strategy under every mask of the mix (layer-weighted), keeps the choice, and hands
  // back the chosen strategy's placement.
  Choice choose(const DocumentBatch& batch, const Topology& topo, Placement* placement) const {
    Choice c;
    c.predictions.fill(std::numeric_limits<double>::quiet_NaN());
    double best_s = std::numeric_limits<double>::infinity();
    const auto consider = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      using S = std::tuple_element_t<I, std::tuple<Strategies...>>;
      const auto a = arguments<I>(topo);
      std::string refused;
      std::int64_t most_tokens = 0;
      const double s = args_.masks.mean([&](AttentionMask m) {
        if (!refused.empty()) return 0.0;
        replay::CompiledStrategy compiled = compile_all<S>(a, batch, shape_, topo, m);
        if (!compiled.status) {
          refused = compiled.status.reason;
          return 0.0;
        }
        for (int r = 0; r < topo.world_size; ++r) most_tokens = std::max(most_tokens, compiled.plan.local_tokens(r));
        return replay::predict(compiled, topo, shape_, args_.simulation).time_s();
      });
      if (!refused.empty()) {
        c.refusals[I] = refused;
        return;
      }
      const double total = s + args_.seconds_per_token * static_cast<double>(most_tokens);
      c.predictions[I] = total;
      if (total < best_s) {  // ties: the first listed wins
        best_s = total;
        c.index = static_cast<int>(I);
        if (placement != nullptr) *placement = S::place(a, batch, topo).placement;
      }
    };
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (consider(std::integral_constant<std::size_t, I>{}), ...);
    }
    (std::make_index_sequence<kCount>{});
    if (c.index < 0) {
      std::string why;
      for (std::size_t i = 0; i < kCount; ++i) why += (i ? "; " : "") + args_.names[i] + ": " + c.refusals[i];
      throw std::invalid_argument("SelectedAttention: every strategy refuses the batch (" + why + ")");
    }
    c.name = args_.names[static_cast<std::size_t>(c.index)];
    c.predicted_s = best_s;
    const std::lock_guard lock(mutex_);
    for (const auto& [key, old] : choices_)
      if (runtime::same_batch(key, batch)) return c;
    if (choices_.size() >= kChoiceEntries) choices_.pop_front();  // the oldest first (chosen again if needed)
    choices_.emplace_back(runtime::batch_key(batch), c);
    return c;
  }

  Arguments args_;
  AttentionShape shape_;
  std::uint64_t signature_ = 0;
  mutable std::deque<std::pair<std::vector<std::int64_t>, Choice>> choices_;  // oldest first
  mutable std::mutex mutex_;                                                  // guards choices_
};

}  // namespace detail

/// Exact distributed attention that, for every new batch shape, simulates each of the strategies compiled
/// in on the cost model and runs the fastest: the per-batch choice among Strategies... (e.g. Ulysses for
/// few long documents on one node, Hybrid with a sharding-aware ring for many short ones). The choice is
/// made when the batch is placed (once for every layer), its predicted time the layer-weighted mean over
/// the mask mix (`Arguments::masks`); every call's mask then runs with the chosen strategy. All ranks
/// reach the same choice without talking (the simulation is deterministic); everything else (cache,
/// transports, executor, failure handling) is the same engine DistributedAttention uses.
///
/// @code
/// using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
/// using FlashCP = Strategy<partition::Hybrid, comm::Ring>;
/// plan::SelectedAttention<attention::CpuFlash<float>, Ulysses, FlashCP>::Arguments args;
/// args.simulation.hardware = replay::profiles::h100_sxm();
/// plan::SelectedAttention<attention::CpuFlash<float>, Ulysses, FlashCP> attn(transport, shape, args);
/// attn.forward(batch, q, k, v, o, lse);            // lay q, k, v out by attn.owned_ranges(batch)
/// const auto& why = attn.choice(batch);            // why.name, why.predicted_s, why.predictions
/// @endcode
template <attention::AttentionKernel Kernel, class... Strategies>
class SelectedAttention final : public runtime::AttentionEngine<Kernel> {
  static_assert(sizeof...(Strategies) >= 1, "SelectedAttention needs at least one strategy");
  using Compiler = detail::SelectingCompiler<Strategies...>;

 public:
  static constexpr std::size_t kCount = sizeof...(Strategies);
  /// strategies, names (for reports; empty = "strategy <i>"), simulation (the hardware the choice is made
  /// for), seconds_per_token (the rest of the layer per token a rank owns, forward + backward: strategies
  /// that balance attention by giving ranks unequal token counts pay for it here; 0 = attention alone
  /// decides), ranks_per_node (0: one node), masks (the model's mask mix).
  using Arguments = typename Compiler::Arguments;
  using Choice = typename Compiler::Choice;
  /// Most choices kept (a choice evicted while its placement stays cached is made again).
  static constexpr std::size_t kChoiceEntries = Compiler::kChoiceEntries;

  template <Transport Tr>
  SelectedAttention(Tr& transport, const AttentionShape& shape, Arguments args, Kernel kernel = Kernel())
      : SelectedAttention(transport, shape, std::make_shared<const Compiler>(std::move(args), shape),
                          std::move(kernel)) {}

  /// The strategy chosen for `batch` (placing and simulating it on first sight of its shape).
  [[nodiscard]] Choice choice(const DocumentBatch& batch) {
    (void)this->placement(batch);  // chooses on a cache miss
    return compiler_->choice(batch, this->topology());
  }
  /// Choices kept (at most kChoiceEntries; for tests and monitoring).
  [[nodiscard]] std::size_t cached_choices() const { return compiler_->cached_choices(); }

 private:
  template <Transport Tr>
  SelectedAttention(Tr& transport, const AttentionShape& shape, std::shared_ptr<const Compiler> compiler, Kernel kernel)
      : runtime::AttentionEngine<Kernel>(transport, shape, compiler_ranks_per_node(*compiler), compiler,
                                         std::move(kernel)),
        compiler_(std::move(compiler)) {}
  static int compiler_ranks_per_node(const Compiler& c) { return c.ranks_per_node(); }

  std::shared_ptr<const Compiler> compiler_;
};

}  // namespace seqpar::plan
