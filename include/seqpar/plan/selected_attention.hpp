// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/plan/compile_all.hpp"
#include "seqpar/replay/predict.hpp"
#include "seqpar/runtime/engine.hpp"
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
template <attention::AttentionKernel Kernel, class... Strategies>
class SelectedAttention final : public runtime::AttentionEngine<Kernel> {
  static_assert(sizeof...(Strategies) >= 1, "SelectedAttention needs at least one strategy");

 public:
  static constexpr std::size_t kCount = sizeof...(Strategies);

  struct Arguments {
    std::tuple<typename Strategies::Arguments...> strategies{};
    std::array<std::string, kCount> names{};  ///< for reports; empty = "strategy <i>"
    replay::SimulationOptions simulation{};   ///< hardware the choice is made for
    /// The rest of the layer (projections, MLP) per token a rank owns, forward + backward: strategies
    /// that balance attention by giving ranks unequal token counts pay for it here
    /// (layer_gemm_seconds_per_token). 0 = attention alone decides.
    double seconds_per_token = 0.0;
    int ranks_per_node = 0;  ///< 0: every rank on one node
  };

  /// The choice for one batch shape.
  struct Choice {
    int index = -1;
    std::string name;
    double predicted_s = 0;                      ///< of the chosen strategy, one layer forward + backward
    std::array<double, kCount> predictions{};    ///< every candidate's; NaN where it refused the batch
    std::array<std::string, kCount> refusals{};  ///< the refusal reasons
  };

  template <Transport Tr>
  SelectedAttention(Tr& transport, const AttentionShape& shape, Arguments args, Kernel kernel = Kernel())
      : runtime::AttentionEngine<Kernel>(transport, shape, args.ranks_per_node, std::move(kernel)),
        args_(std::move(args)) {
    args_.simulation.hardware.validate("SelectedAttention: args.simulation.hardware");
    detail::require(args_.seconds_per_token >= 0 && std::isfinite(args_.seconds_per_token), "SelectedAttention",
                    "args.seconds_per_token", args_.seconds_per_token, "must be finite and >= 0");
    for (std::size_t i = 0; i < kCount; ++i)
      if (args_.names[i].empty()) args_.names[i] = "strategy " + std::to_string(i);
  }

  ~SelectedAttention() override { this->finish_planning_ahead(); }  // its compile() reads args_, choices_

  /// The strategy chosen for `batch` (planning and simulating it on first sight of its shape). Valid
  /// until the next call on this object.
  [[nodiscard]] const Choice& choice(const DocumentBatch& batch) {
    (void)this->plan(batch);  // compiles (and chooses) on a cache miss
    const std::vector<std::int64_t> key = this->key_of(batch);
    {
      const std::lock_guard lock(choices_mutex_);
      if (const auto it = choices_.find(key); it != choices_.end()) return it->second;
    }
    // Its choice was evicted while its plan stayed cached: choose again (local and deterministic).
    ShardPlan plan;
    comm::CompiledAttention program;
    compile(batch, plan, program);
    const std::lock_guard lock(choices_mutex_);
    return choices_.at(key);
  }
  /// Most choices kept (twice the engine's cached batches: a cached plan's choice is usually still
  /// there; choice() chooses again when it is not).
  static constexpr std::size_t kChoiceEntries = 2 * runtime::AttentionEngine<Kernel>::kCacheEntries;
  /// Choices kept (at most kChoiceEntries; for tests and monitoring).
  [[nodiscard]] std::size_t cached_choices() const {
    const std::lock_guard lock(choices_mutex_);
    return choices_.size();
  }

 private:
  [[nodiscard]] std::uint64_t strategy_signature() const override {
    std::uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](const std::string& s) {
      for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    };
    (mix(typeid(Strategies).name()), ...);
    for (const auto& n : args_.names) mix(n);
    return h ^ static_cast<std::uint64_t>(args_.ranks_per_node) * 0x9e3779b97f4a7c15ull;
  }

  void compile(const DocumentBatch& batch, ShardPlan& plan, comm::CompiledAttention& program) const override {
    Choice c;
    c.predictions.fill(std::numeric_limits<double>::quiet_NaN());
    replay::CompiledStrategy best;
    double best_s = std::numeric_limits<double>::infinity();
    const Topology& topo = this->topology();
    const auto consider = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      using S = std::tuple_element_t<I, std::tuple<Strategies...>>;
      typename S::Arguments a = std::get<I>(args_.strategies);
      a.ranks_per_node = this->topology().ranks_per_node;
      replay::CompiledStrategy compiled = compile_all<S>(a, batch, this->shape(), topo);
      if (!compiled.status) {
        c.refusals[I] = compiled.status.reason;
        return;
      }
      const replay::AttentionPrediction p = replay::predict(compiled, topo, this->shape(), args_.simulation);
      std::int64_t most_tokens = 0;
      for (int r = 0; r < topo.world_size; ++r) most_tokens = std::max(most_tokens, compiled.plan.local_tokens(r));
      const double s = p.time_s() + args_.seconds_per_token * static_cast<double>(most_tokens);
      c.predictions[I] = s;
      if (s < best_s) {  // ties: the first listed wins
        best_s = s;
        best = std::move(compiled);
        c.index = static_cast<int>(I);
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
    const auto r = static_cast<std::size_t>(this->rank());
    plan = std::move(best.plan);
    program.forward = std::move(best.forward[r]);
    program.backward = std::move(best.backward[r]);
    std::vector<std::int64_t> key = this->key_of(batch);
    // compile() also runs on plan_ahead's thread while this rank's thread may read a choice.
    const std::lock_guard lock(choices_mutex_);
    if (choices_.find(key) == choices_.end()) {
      // Bounded like the engine's caches: the oldest choice goes first (choice() recomputes it).
      if (choices_.size() >= kChoiceEntries) {
        choices_.erase(choice_order_.front());
        choice_order_.pop_front();
      }
      choice_order_.push_back(key);
    }
    choices_[std::move(key)] = std::move(c);
  }

  Arguments args_;
  mutable std::map<std::vector<std::int64_t>, Choice> choices_;
  mutable std::deque<std::vector<std::int64_t>> choice_order_;  // keys of choices_, oldest first
  mutable std::mutex choices_mutex_;                            // guards choices_ and choice_order_
};

}  // namespace seqpar::plan
