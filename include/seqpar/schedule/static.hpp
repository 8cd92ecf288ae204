// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <concepts>

#include "seqpar/comm/program.hpp"

namespace seqpar::schedule {

/// Opt-in tag of schedulers.
struct scheduler_tag {};

/// A scheduler orders a compiled program's steps (and, for chunked training, cuts the batch into
/// chunks). It may reorder only steps that do not depend on each other.
template <class S>
concept Scheduler = std::derived_from<typename S::policy_category, scheduler_tag> &&
                    requires(const S& s, comm::CompiledAttention& program) {
                      typename S::Arguments;
                      s.schedule(program);
                    };

/// Runs the program in the order the communicator compiled it, on the batch as given.
struct Static {
  using policy_category = scheduler_tag;
  struct Arguments {};
  Arguments args;
  void schedule(comm::CompiledAttention&) const noexcept {}
};

static_assert(Scheduler<Static>);

}  // namespace seqpar::schedule
