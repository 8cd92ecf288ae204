// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace seqpar::runtime {

/// Which layer a collective call is for, in words every rank can compare (an object's address is not
/// comparable across ranks): the order in which this rank made its attention objects on one transport
/// object. An SPMD program makes its layers in the same order on every rank, so "the 3rd object made on
/// this rank's transport" names the same layer everywhere; two layers called in different orders on two
/// ranks then disagree on it in the call's agreement (runtime/agreement.hpp) instead of exchanging one
/// layer's rows for another's. Together with the object's count of agreed calls, this is the layer word
/// AttentionEngine adds to every agreement.
///
/// The count is per transport object (the in-process world's ranks each hold their own, an MPI or NCCL
/// rank its one), and restarts once every object made on that transport is gone: a later world whose
/// transport reuses the address starts from 0 on every rank alike. Objects made on one rank only (a
/// local planning copy) shift the count of the objects made after them on that rank: make those on a
/// transport of their own, or name the layer with AttentionEngine::set_layer.
///
/// Thread-safe (one mutex, taken at construction and destruction only: never on a call).
class LayerOrder {
 public:
  /// Takes the next number on `transport` (any object that outlives this ticket; only its address is used).
  explicit LayerOrder(const void* transport) : key_(transport) {
    const std::lock_guard lock(mutex());
    Slot& s = slots()[key_];
    index_ = s.next++;
    ++s.live;
  }
  LayerOrder(const LayerOrder&) = delete;
  LayerOrder& operator=(const LayerOrder&) = delete;
  ~LayerOrder() {
    const std::lock_guard lock(mutex());
    auto it = slots().find(key_);
    if (it != slots().end() && --it->second.live == 0) slots().erase(it);
  }

  /// This object's place among the objects made on its transport (0 first).
  [[nodiscard]] std::uint64_t index() const noexcept { return index_; }

 private:
  struct Slot {
    std::uint64_t next = 0;
    std::uint64_t live = 0;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<const void*, Slot>& slots() {
    static std::unordered_map<const void*, Slot> s;
    return s;
  }

  const void* key_;
  std::uint64_t index_ = 0;
};

}  // namespace seqpar::runtime
