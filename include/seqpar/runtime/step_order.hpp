// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <concepts>

#include "seqpar/comm/program.hpp"

namespace seqpar::runtime {

/// Opt-in tag of step-order policies.
struct step_order_tag {};

/// A step-order policy may reorder a compiled program's steps before they are lowered, keeping every
/// dependency (a step that reads a buffer stays after the step that writes it; posts before their
/// waits). It sees one rank's programs of one batch; what to run when across a batch (chunks, a
/// pipeline) is a batch-level scheduler's job (schedule/).
template <class S>
concept StepOrder = std::derived_from<typename S::policy_category, step_order_tag> &&
    requires(const S& s, comm::CompiledAttention& program) {
  typename S::Arguments;
  s.order(program);
};

/// The order the communicator compiled: its posts already come before the compute they overlap.
struct StaticOrder {
  using policy_category = step_order_tag;
  struct Arguments {
    /// No field: nothing for the ranks to agree on.
    template <class Fn>
    void for_each_argument(Fn&&) const {}
  };
  Arguments args;
  void order(comm::CompiledAttention&) const noexcept {}
};

static_assert(StepOrder<StaticOrder>);

}  // namespace seqpar::runtime
