// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/hash.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/runtime/argument_word.hpp"
#include "seqpar/runtime/engine.hpp"
#include "seqpar/runtime/plan_cache.hpp"
#include "seqpar/strategy.hpp"

namespace seqpar {

namespace detail {
/// A Strategy as the engine's PlanCompiler: its arguments (immutable once built), their words for the
/// agreement and the hash of its type.
template <class StrategyT>
class StrategyCompiler final : public runtime::PlanCompiler {
 public:
  using Arguments = typename StrategyT::Arguments;
  explicit StrategyCompiler(Arguments args) : args_(std::move(args)) {
    args_.masks.validate("DistributedAttention", "args.masks");
    Hash64 h;
    h.add(std::string_view(typeid(StrategyT).name())).add(std::int64_t{args_.ranks_per_node});
    signature_ = h.value();
    StrategyT::for_each_argument(args_, [this](runtime::ArgumentWord word) {
      word.name = "the strategy argument " + word.name;  // how a disagreement names it
      words_.push_back(std::move(word));
    });
  }
  [[nodiscard]] Placement place(const DocumentBatch& batch, const Topology& topology) const override {
    auto placed = StrategyT::place(args_, batch, topology);
    if (!placed.status)
      throw std::invalid_argument(std::string("DistributedAttention: ") + placed.refused_by + ": " +
                                  placed.status.reason);
    return std::move(placed.placement);
  }
  void compile(const DocumentBatch& batch, const Placement& placement, AttentionMask mask, const AttentionShape& shape,
               int rank, ShardPlan& plan, comm::CompiledAttention& program) const override {
    auto compiled = StrategyT::compile(args_, placement, batch, mask, shape, rank);
    if (!compiled.status)
      throw std::invalid_argument(std::string("DistributedAttention: ") + compiled.refused_by + " under " +
                                  mask.to_string() + ": " + compiled.status.reason);
    plan = std::move(compiled.plan);
    program = std::move(compiled.program);
  }
  [[nodiscard]] const MaskMix& masks() const noexcept override { return args_.masks; }
  [[nodiscard]] std::uint64_t signature() const noexcept override { return signature_; }
  [[nodiscard]] std::span<const runtime::ArgumentWord> argument_words() const noexcept override { return words_; }

 private:
  Arguments args_;
  std::uint64_t signature_ = 0;
  std::vector<runtime::ArgumentWord> words_;
};
}  // namespace detail

/// Exact distributed attention of one layer over packed documents, with the strategy's policies,
/// the kernel's arithmetic, over any transport. Tensors are the rank's local shard: `local_tokens`
/// rows in the placement's token order (`owned_ranges(batch)` says which global tokens those are).
///
/// Placement once per batch, masks per call: the rows a rank holds for a batch are the same for every
/// layer of a model (one object can serve every layer; layers with their own objects and the same
/// Arguments place alike), balanced for the model's mask mix declared once in `Arguments::masks`. Each
/// call passes its layer's AttentionMask (causal when left out), so a model alternating window and full
/// layers keeps one set of rows per rank.
///
/// Plans and programs are compiled and lowered once per (batch, mask) and cached; the workspace grows
/// only on a cache miss (or is the caller's: `workspace_bytes(batch, mask)`), so steady-state calls
/// allocate nothing. Every rank of the transport must make the same calls with the same batch and mask
/// (compared before any data moves). The strategy-independent machinery lives in
/// runtime::AttentionEngine<Kernel>, shared by every strategy compiled in with the same kernel; this
/// facade, the one place a Strategy meets a kernel, sits above both (runtime/ knows no policy).
///
/// @code
/// using Ulysses = seqpar::Strategy<partition::Uniform, comm::AllToAll>;
/// seqpar::DistributedAttention<Ulysses, attention::CpuFlash<float>> attn(
///     transport, shape, {.masks = {{AttentionMask::causal(), 12}, {AttentionMask::sliding_window(128), 12}}});
/// attn.forward(batch, AttentionMask::sliding_window(128), q, k, v, o, lse);   // q (local, Hq, D) ... lse (Hq, local)
/// attn.backward(batch, AttentionMask::sliding_window(128), q, k, v, o, lse, dout, dq, dk, dv);
/// attn.forward(batch, q, k, v, o, lse);                                       // a full layer: the same rows
/// @endcode
template <class StrategyT, attention::AttentionKernel Kernel>
class DistributedAttention final : public runtime::AttentionEngine<Kernel> {
  using Engine = runtime::AttentionEngine<Kernel>;

 public:
  using strategy_type = StrategyT;
  using Arguments = typename StrategyT::Arguments;

  template <Transport Tr>
  DistributedAttention(Tr& transport, const AttentionShape& shape, Arguments args = {}, Kernel kernel = {})
      : Engine(transport, shape, args.ranks_per_node,
               std::make_shared<const detail::StrategyCompiler<StrategyT>>(std::move(args)), std::move(kernel)) {}
};

}  // namespace seqpar
