// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "seqpar/attention/sinks.hpp"
#include "seqpar/core/exec.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/runtime/any_transport.hpp"
#include "seqpar/runtime/data_ops.hpp"

namespace seqpar::runtime {

/// Attention sinks (attention/sinks.hpp) on a distributed call, for any execution context: the
/// forward rescales the rank's final rows once they hold every key (after the program's merges), the
/// backward gives the sinks' gradient summed over the ranks of the transport. The kernels' backward
/// needs nothing more: handed the sink-applied O and LSE, it computes the gradients with the sink.
/// Used by AttentionEngine (a whole batch) and ChunkedAttention (a chunk's rows after its prefix merge),
/// so that the sink is counted once per row there too.
///
/// Cost: O(rows * Hq * d) per pass on the context; the backward adds one all_gather of Hq values per
/// rank (a stream-ordered context also waits for it on the host: one synchronization per backward).
/// The gather buffer, (ranks + 1) * Hq values in the context's memory, grows on the first call only.
template <class Exec>
class SinkEpilogue {
 public:
  /// The local checks of a call, before any message: one logit per query head (and one gradient
  /// slot); on a context whose memory the host reads, no NaN or +inf (-inf: a head without a sink).
  /// Messages are built only when thrown (no allocation on the steady-state path).
  template <class A>
  static void check(const char* where, std::span<const A> sinks, int heads_q, std::span<A> dsinks = {},
                    bool backward = false) {
    if constexpr (StreamOrderedExec<Exec>) {
      if (sinks.size() != static_cast<std::size_t>(heads_q))
        seqpar::detail::throw_invalid(where, "sinks.size()", sinks.size(),
                                      "must be heads_q = " + std::to_string(heads_q));
    } else {
      attention::check_sinks(where, sinks, heads_q);
    }
    if (backward && dsinks.size() != static_cast<std::size_t>(heads_q))
      seqpar::detail::throw_invalid(where, "dsinks.size()", dsinks.size(),
                                    "must be heads_q = " + std::to_string(heads_q));
  }

  /// o, lse: the rank's final rows; afterwards the rows with the sinks.
  template <class T, class A>
  static void forward(const Exec& exec, ThdView<T> o, LseView<A> lse, std::span<const A> sinks) {
    DataOps<Exec>::apply_sinks(exec, o, lse, sinks.data());
  }

  /// dsinks (overwritten) = -sum over every row of every rank of the transport of
  /// e^{s_h - LSE'} dO . O', from the sink-applied o and lse of this rank's rows. Collective over
  /// `transport`; every rank holds the same bits afterwards (the parts are summed in rank order).
  template <class T, class A>
  void backward(const Exec& exec, AnyTransport& transport, ThdView<const T> dout, ThdView<const T> o,
                LseView<const A> lse, std::span<const A> sinks, std::span<A> dsinks) {
    const std::size_t heads = sinks.size();
    const auto ranks = static_cast<std::size_t>(transport.size());
    const std::size_t need = (ranks + 1) * heads * sizeof(A);
    if (buffer_.size() < need) buffer_ = DataOps<Exec>::allocate(exec, need);
    A* const mine = reinterpret_cast<A*>(buffer_.span().data());
    A* const all = mine + heads;
    DataOps<Exec>::sink_gradient(exec, dout, o, lse, sinks.data(), mine);
    // The gather reads `mine` on the transport's queue: the context's work must be done (host contexts
    // run inline; a stream-ordered one is waited for), and its result must be in before the sum.
    if constexpr (!Exec::kHostSynchronous) exec.synchronize();
    transport.all_gather(std::as_bytes(std::span<const A>(mine, heads)),
                         std::as_writable_bytes(std::span<A>(all, ranks * heads)));
    if constexpr (StreamOrderedExec<Exec>) transport.barrier();  // ordered after the gather on the host
    DataOps<Exec>::sum_parts(exec, all, static_cast<int>(ranks), heads, dsinks.data());
  }

 private:
  typename DataOps<Exec>::Workspace buffer_;
};

}  // namespace seqpar::runtime
