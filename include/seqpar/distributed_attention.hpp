// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/runtime/argument_word.hpp"
#include "seqpar/runtime/engine.hpp"
#include "seqpar/strategy.hpp"

namespace seqpar {

/// Exact distributed attention of one layer over packed documents, with the strategy's policies,
/// the kernel's arithmetic, over any transport. Tensors are the rank's local shard: `local_tokens`
/// rows in the plan's token order (`owned_ranges(batch)` says which global tokens those are).
/// Plans and programs are compiled and lowered once per batch shape and cached; the workspace grows
/// only on a cache miss (or is the caller's: `workspace_bytes(batch)`), so steady-state calls
/// allocate nothing. Every rank of the transport must make the same calls with the same batch.
/// The strategy-independent machinery (cache, transports, executor, execution context) lives in
/// runtime::AttentionEngine<Kernel>, shared by every strategy compiled in with the same kernel; this
/// facade, the one place a Strategy meets a kernel, sits above both (runtime/ knows no policy).
///
/// @code
/// using Ulysses = seqpar::Strategy<partition::Uniform, comm::AllToAll>;
/// seqpar::DistributedAttention<Ulysses, attention::CpuFlash<float>> attn(transport, shape);
/// attn.forward(batch, q, k, v, o, lse);                      // q (local, Hq, D) ... lse (Hq, local)
/// attn.backward(batch, q, k, v, o, lse, dout, dq, dk, dv);
/// @endcode
template <class StrategyT, attention::AttentionKernel Kernel>
class DistributedAttention final : public runtime::AttentionEngine<Kernel> {
  using Engine = runtime::AttentionEngine<Kernel>;

 public:
  using strategy_type = StrategyT;
  using Arguments = typename StrategyT::Arguments;

  template <Transport Tr>
  DistributedAttention(Tr& transport, const AttentionShape& shape, Arguments args = {}, Kernel kernel = {})
      : Engine(transport, shape, args.ranks_per_node, std::move(kernel)),
        args_(args),
        signature_(signature_of(args.ranks_per_node)) {
    StrategyT::for_each_argument(args_, [this](runtime::ArgumentWord word) { words_.push_back(std::move(word)); });
  }

  ~DistributedAttention() override { this->finish_planning_ahead(); }  // its compile() reads args_

 private:
  [[nodiscard]] static std::uint64_t signature_of(int ranks_per_node) {
    std::uint64_t h = 14695981039346656037ull;
    for (const char* c = typeid(StrategyT).name(); *c != '\0'; ++c)
      h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
    return h ^ static_cast<std::uint64_t>(ranks_per_node) * 0x9e3779b97f4a7c15ull;
  }
  [[nodiscard]] std::uint64_t strategy_signature() const override { return signature_; }
  [[nodiscard]] std::span<const runtime::ArgumentWord> argument_words() const override { return words_; }

  void compile(const DocumentBatch& batch, ShardPlan& plan, comm::CompiledAttention& program) const override {
    auto compiled = StrategyT::compile(args_, batch, this->shape(), this->topology(), this->rank());
    if (!compiled.status)
      throw std::invalid_argument(std::string("DistributedAttention: ") + compiled.refused_by + ": " +
                                  compiled.status.reason);
    plan = std::move(compiled.plan);
    program = std::move(compiled.program);
  }

  Arguments args_;
  std::uint64_t signature_;
  std::vector<runtime::ArgumentWord> words_;  // compared across ranks on every call
};

}  // namespace seqpar
