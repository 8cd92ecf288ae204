// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <future>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_mask.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/shard_plan.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/runtime/argument_word.hpp"

namespace seqpar::runtime {

/// What the engine needs of a strategy, as an object: place a batch (once, for every layer) and compile
/// one rank's programs of a placement under one mask. Immutable once made and shared with the
/// plan-ahead thread (held by shared_ptr), so a background planning reads nothing of the engine or of
/// the class that made it: no destructor of theirs has to wait for it.
class PlanCompiler {
 public:
  virtual ~PlanCompiler() = default;
  /// Where `batch`'s tokens live on `topology`, balanced for masks(). Throws std::invalid_argument naming
  /// the refusal when the strategy cannot place the batch.
  [[nodiscard]] virtual Placement place(const DocumentBatch& batch, const Topology& topology) const = 0;
  /// Rank `rank`'s plan and programs of `placement` under `mask`. Throws std::invalid_argument naming the
  /// refusal.
  virtual void compile(const DocumentBatch& batch, const Placement& placement, AttentionMask mask,
                       const AttentionShape& shape, int rank, ShardPlan& plan,
                       comm::CompiledAttention& program) const = 0;
  /// The model's mask mix the placements are balanced for.
  [[nodiscard]] virtual const MaskMix& masks() const noexcept = 0;
  /// The strategy's type and ranks_per_node, hashed (ranks must agree on it).
  [[nodiscard]] virtual std::uint64_t signature() const noexcept = 0;
  /// The strategy's arguments, compared across ranks one by one (a disagreement names the argument).
  [[nodiscard]] virtual std::span<const ArgumentWord> argument_words() const noexcept = 0;
};

/// The words that identify a batch layout in the caches: document boundaries, then sequence boundaries.
template <class Fn>
void for_each_batch_word(const DocumentBatch& batch, Fn&& fn) {
  for (std::int64_t x : batch.cu_seqlens()) fn(x);
  fn(-1);
  for (int b = 0; b < batch.num_sequences(); ++b) fn(batch.sequence(b).begin);
  fn(batch.total_tokens());
}
[[nodiscard]] inline std::vector<std::int64_t> batch_key(const DocumentBatch& batch) {
  std::vector<std::int64_t> key;
  for_each_batch_word(batch, [&](std::int64_t x) { key.push_back(x); });
  return key;
}
/// Whether `key` is batch_key(batch), without building it (a cache hit allocates nothing).
[[nodiscard]] inline bool same_batch(const std::vector<std::int64_t>& key, const DocumentBatch& batch) {
  std::size_t i = 0;
  bool same = true;
  for_each_batch_word(batch, [&](std::int64_t x) {
    same = same && i < key.size() && key[i] == x;
    ++i;
  });
  return same && i == key.size();
}

/// The engine's two caches, along the placement/mask split: placements per batch (the partitioner runs
/// once per batch, for every layer) and plans + programs per (batch, mask) (a full and a window layer
/// of one batch share the placement and differ in slices). Both least recently used first out, so
/// memory is bounded however many batch shapes a run sees. `Entry` is the engine's lowered form of a
/// plan: it has `key`, `mask`, `plan` and `program` members, and `lower(Entry&)` finishes it.
///
/// `plan_ahead(batch)` places the batch and compiles every mask of the mix on a background thread that
/// holds only the compiler (shared), the shape, the topology and the rank: the first use of that batch
/// takes the result (waiting for it if needed) and only lowers it. At most one batch is planned ahead. A
/// refusal surfaces where it would without planning ahead: the partitioner's at the first use of the
/// batch, a mask's at the first call with that mask.
template <class Entry>
class PlanCache {
 public:
  static constexpr std::size_t kEntries = 16;    ///< most (batch, mask) plans kept, lowered
  static constexpr std::size_t kPlacements = 8;  ///< most batch placements kept

  PlanCache(std::shared_ptr<const PlanCompiler> compiler, const AttentionShape& shape, const Topology& topology,
            int rank)
      : compiler_(std::move(compiler)), shape_(shape), topology_(topology), rank_(rank) {}
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;
  ~PlanCache() { drop_ahead(); }

  [[nodiscard]] const PlanCompiler& compiler() const noexcept { return *compiler_; }
  [[nodiscard]] std::size_t entries() const noexcept { return entries_.size(); }
  [[nodiscard]] std::size_t placements() const noexcept { return placements_.size(); }

  /// The placement of `batch` (placed on a miss; an error of the strategy is raised here).
  const Placement& placement(const DocumentBatch& batch) {
    for (auto it = placements_.begin(); it != placements_.end(); ++it)
      if (same_batch(it->first, batch)) {
        if (it != placements_.begin()) placements_.splice(placements_.begin(), placements_, it);
        return placements_.front().second;
      }
    if (take_ahead(batch)) return placements_.front().second;
    Placement p = compiler_->place(batch, topology_);
    placements_.emplace_front(batch_key(batch), std::move(p));
    if (placements_.size() > kPlacements) placements_.pop_back();
    return placements_.front().second;
  }

  /// Calls fn(key, placement) for each cached placement, most recently used first (a refusal's message
  /// looks for the batch a caller's rows were laid out by). The key: batch_key's words.
  template <class Fn>
  void for_each_placement(Fn&& fn) const {
    for (const auto& [key, placement] : placements_) fn(key, placement);
  }

  /// The entry of (batch, mask), compiled and lowered (`lower(entry)`) on a miss.
  template <class Lower>
  Entry& entry(const DocumentBatch& batch, AttentionMask mask, Lower&& lower) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->mask == mask && same_batch(it->key, batch)) {
        if (it != entries_.begin()) entries_.splice(entries_.begin(), entries_, it);
        return entries_.front();
      }
    const Placement& placement = this->placement(batch);
    Entry e;
    e.key = batch_key(batch);
    e.mask = mask;
    if (auto ready = take_compiled(e.key, mask)) {
      if (ready->error) std::rethrow_exception(ready->error);
      e.plan = std::move(ready->plan);
      e.program = std::move(ready->program);
    } else {
      compiler_->compile(batch, placement, mask, shape_, rank_, e.plan, e.program);
    }
    lower(e);
    entries_.push_front(std::move(e));
    if (entries_.size() > kEntries) entries_.pop_back();
    return entries_.front();
  }

  /// Starts placing `batch` and compiling every mask of the mix on a background thread (see above). A
  /// batch already placed or under way is left alone; a second batch waits for the first and drops it.
  void plan_ahead(const DocumentBatch& batch) {
    for (const auto& p : placements_)
      if (same_batch(p.first, batch)) return;
    if (ahead_ && same_batch(ahead_->key, batch)) return;
    drop_ahead();
    ahead_.emplace();
    ahead_->key = batch_key(batch);
    // The thread holds only what it reads: the shared compiler, the shape, the topology, the rank, the batch.
    ahead_->result = std::async(std::launch::async, &PlanCache::plan_all, compiler_, shape_, topology_, rank_, batch);
  }
  /// Whether `batch` is being (or has been) planned ahead and not yet used.
  [[nodiscard]] bool planning_ahead(const DocumentBatch& batch) const {
    return ahead_ && same_batch(ahead_->key, batch);
  }

 private:
  struct Compiled {
    AttentionMask mask;
    ShardPlan plan;
    comm::CompiledAttention program;
    std::exception_ptr error;  // the strategy's refusal of this mask, raised by its first call
  };
  struct Ahead {
    struct Result {
      Placement placement;
      std::vector<Compiled> compiled;
    };
    std::vector<std::int64_t> key;
    std::future<Result> result;
  };

  // The placement of `batch` and its programs under every mask of the mix (plan_ahead's thread). A
  // mask the strategy refuses keeps its error, raised by the first call with it, as a miss would raise it.
  static typename Ahead::Result plan_all(std::shared_ptr<const PlanCompiler> compiler, AttentionShape shape,
                                         Topology topology, int rank, DocumentBatch batch) {
    typename Ahead::Result r;
    r.placement = compiler->place(batch, topology);
    for (const AttentionMask m : compiler->masks().masks()) {
      Compiled& c = r.compiled.emplace_back();
      c.mask = m;
      try {
        compiler->compile(batch, r.placement, m, shape, rank, c.plan, c.program);
      } catch (...) {
        c.error = std::current_exception();
      }
    }
    return r;
  }

  // Moves a plan-ahead of `batch` into the placement cache (its planning's error, if any, is raised
  // here, as a miss would raise it); its compiled masks wait in ready_ for their first call.
  bool take_ahead(const DocumentBatch& batch) {
    if (!ahead_ || !same_batch(ahead_->key, batch)) return false;
    std::future<typename Ahead::Result> result = std::move(ahead_->result);
    std::vector<std::int64_t> key = std::move(ahead_->key);
    ahead_.reset();
    typename Ahead::Result r = result.get();
    ready_key_ = key;
    ready_ = std::move(r.compiled);
    placements_.emplace_front(std::move(key), std::move(r.placement));
    if (placements_.size() > kPlacements) placements_.pop_back();
    return true;
  }
  std::optional<Compiled> take_compiled(const std::vector<std::int64_t>& key, AttentionMask mask) {
    if (key != ready_key_) return std::nullopt;
    for (auto it = ready_.begin(); it != ready_.end(); ++it)
      if (it->mask == mask) {
        Compiled c = std::move(*it);
        ready_.erase(it);
        return c;
      }
    return std::nullopt;
  }
  void drop_ahead() noexcept {
    if (!ahead_) return;
    if (ahead_->result.valid()) ahead_->result.wait();  // its outcome, an error included, is not wanted
    ahead_.reset();
  }

  std::shared_ptr<const PlanCompiler> compiler_;
  AttentionShape shape_;
  Topology topology_;
  int rank_ = 0;
  std::list<std::pair<std::vector<std::int64_t>, Placement>> placements_;  // most recently used first
  std::list<Entry> entries_;                                               // most recently used first
  std::optional<Ahead> ahead_;
  std::vector<std::int64_t> ready_key_;  // the batch whose planned-ahead masks wait in ready_
  std::vector<Compiled> ready_;
};

}  // namespace seqpar::runtime
