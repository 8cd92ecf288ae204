// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The executor's own work besides attention: pack and unpack message pieces from the lowered copy
/// tables, zero buffers, fill rows no slice covers, and merge partial results. `DataOps<Exec>` is the
/// customization point per execution context: this header defines it for `HostExec` (loops on the
/// calling thread); the CUDA context brings its own specialization (kernels/seqpar/gpu) with the same
/// members, launched on its stream.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>

#include "seqpar/attention/merge.hpp"
#include "seqpar/attention/sinks.hpp"
#include "seqpar/core/aligned_bytes.hpp"
#include "seqpar/core/host_exec.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/runtime/lowered_program.hpp"

namespace seqpar::runtime {

/// Views of every buffer a program names: the caller's tensors (kQ..kDv) and the staging buffers
/// the executor places in its workspace.
template <class T, class A>
struct BufferTable {
  std::array<ThdView<T>, kNumBuffers> thd{};
  std::array<LseView<A>, kNumBuffers> lse{};
  [[nodiscard]] const ThdView<T>& operator[](BufferId b) const noexcept { return thd[static_cast<std::size_t>(b)]; }
  [[nodiscard]] const LseView<A>& lse_of(BufferId b) const noexcept { return lse[static_cast<std::size_t>(b)]; }
};

/// Rows of a lowered table as the executor hands them to `DataOps` and kernels: `host` is the
/// LoweredProgram's own view (sizes, host-side decisions), `mirror` the same rows in the context's
/// memory (uploaded once by `DataOps<Exec>::upload`; for HostExec, the host rows themselves).
template <class T>
struct TableSlice {
  std::span<const T> host;
  const T* mirror = nullptr;
  /// The rows in the context's memory.
  [[nodiscard]] std::span<const T> in_context() const noexcept { return {mirror, host.size()}; }
};

/// Data movement on an execution context. The primary template is left undefined: a context without
/// a specialization is a compile error naming DataOps<YourExec>.
template <class Exec>
struct DataOps;

/// Members of a specialization (HostExec's below is the model):
///  - `Tables upload(exec, lowered)`: the lowered copy and slice tables in the context's memory,
///    once per cached program (`Tables::copies`, `Tables::slices`: base pointers of the mirrors);
///  - `Workspace allocate(exec, bytes)`: owning memory of the context (`.span()`), for engines that
///    own their workspace;
///  - pack, unpack, zero, fill_empty, merge: issued on the context, in its order;
///  - apply_sinks, sink_gradient, sum_parts: attention sinks on final rows (the engine's epilogue).
template <>
struct DataOps<HostExec> {
  struct Tables {
    const PieceCopy* copies = nullptr;
    const AttnSlice* slices = nullptr;
  };
  [[nodiscard]] static Tables upload(const HostExec&, const LoweredProgram& lp) noexcept {
    return {lp.copies.data(), lp.slices.data()};
  }
  using Workspace = seqpar::detail::AlignedBytes;
  [[nodiscard]] static Workspace allocate(const HostExec&, std::size_t bytes) { return Workspace(bytes); }

  /// Copies the pieces of `copies` out of their buffers into `region` at their offsets.
  template <class T, class A>
  static void pack(const HostExec&, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies, std::byte* region,
                   comm::HeadWidths widths) {
    for (const PieceCopy& c : copies.host) move_piece<false>(b, c, region + c.offset, widths.of(c.buffer));
  }

  /// Copies (or, with PieceCopy::accumulate, adds) the pieces of `copies` from `region` into their buffers.
  template <class T, class A>
  static void unpack(const HostExec&, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies, const std::byte* region,
                     comm::HeadWidths widths) {
    for (const PieceCopy& c : copies.host)
      move_piece<true>(b, c, const_cast<std::byte*>(region) + c.offset, widths.of(c.buffer));
  }

  template <class T, class A>
  static void zero(const HostExec&, const BufferTable<T, A>& b, std::span<const BufferId> buffers) {
    for (BufferId id : buffers) {
      if (comm::is_lse(id)) {
        const auto& v = b.lse_of(id);
        for (int h = 0; h < v.heads && v.tokens > 0; ++h) std::fill_n(&v(h, 0), v.tokens, A(0));
      } else {
        const auto& v = b[id];
        for (std::int64_t t = 0; t < v.tokens; ++t)
          for (int h = 0; h < v.heads; ++h) std::fill_n(v.row(t, h), v.head_dim, T(0));
      }
    }
  }

  /// O = 0, LSE = -inf over whole views.
  template <class T, class A>
  static void fill_empty(const HostExec&, ThdView<T> o, LseView<A> lse) {
    for (std::int64_t t = 0; t < o.tokens; ++t)
      for (int h = 0; h < o.heads; ++h) std::fill_n(o.row(t, h), o.head_dim, T(0));
    if (lse.tokens == 0) return;  // an empty view addresses nothing: form no row start
    for (int h = 0; h < lse.heads; ++h) std::fill_n(&lse(h, 0), lse.tokens, -std::numeric_limits<A>::infinity());
  }

  /// Folds the partial (o_part, lse_part) into (o, lse) on the query rows of `slices`.
  template <class T, class A>
  static void merge(const HostExec&, ThdView<T> o, LseView<A> lse, ThdView<T> o_part, LseView<A> lse_part,
                    TableSlice<AttnSlice> slices) {
    for (const AttnSlice& s : slices.host) {
      const std::int64_t r0 = s.q_range.begin, n = s.q_range.size();
      attention::merge_into(o.tokens_slice(r0, n), lse.tokens_slice(r0, n),
                            ThdView<const T>(o_part.tokens_slice(r0, n)),
                            LseView<const A>(lse_part.tokens_slice(r0, n)));
    }
  }

  /// Attention sinks on final rows (attention/sinks.hpp): O, LSE rescaled by the sink of each head.
  /// `sinks`: heads logits in the context's memory.
  template <class T, class A>
  static void apply_sinks(const HostExec&, ThdView<T> o, LseView<A> lse, const A* sinks) {
    attention::apply_sinks(o, lse, std::span<const A>(sinks, static_cast<std::size_t>(o.heads)));
  }

  /// This rank's part of the sinks' gradient: grad[h] = -sum_t e^{s_h - LSE'} dO . O' over the rows
  /// (overwritten; `grad`: heads values in the context's memory).
  template <class T, class A>
  static void sink_gradient(const HostExec&, ThdView<const T> dout, ThdView<const T> o, LseView<const A> lse,
                            const A* sinks, A* grad) {
    const auto heads = static_cast<std::size_t>(o.heads);
    std::fill_n(grad, heads, A(0));
    attention::accumulate_sink_gradient(dout, o, lse, std::span<const A>(sinks, heads), std::span<A>(grad, heads));
  }

  /// out[i] = sum over r < parts of in[r * n + i], in rank order (every rank sums the same gathered
  /// values in the same order: the same bits everywhere).
  template <class A>
  static void sum_parts(const HostExec&, const A* in, int parts, std::size_t n, A* out) {
    for (std::size_t i = 0; i < n; ++i) {
      A sum = 0;
      for (int r = 0; r < parts; ++r) sum += in[static_cast<std::size_t>(r) * n + i];
      out[i] = sum;
    }
  }

 private:
  // THD pieces travel rows outer, heads inner; LSE pieces heads outer, rows inner (its contiguous axis).
  template <bool kUnpack, class T, class A>
  static void move_piece(const BufferTable<T, A>& b, const PieceCopy& c, std::byte* cursor, int d) {
    const auto run = [&](auto* elems, std::size_t n) {
      using E = std::remove_pointer_t<decltype(elems)>;
      if constexpr (!kUnpack) {
        std::memcpy(cursor, elems, n * sizeof(E));
      } else if (!c.accumulate) {
        std::memcpy(elems, cursor, n * sizeof(E));
      } else {
        // Summed in the accumulation type: a storage-only type (bf16) has no arithmetic of its own,
        // and each partial is added in fp32 and rounded once, not in bf16.
        using Sum = std::conditional_t<std::is_floating_point_v<E>, E, float>;
        for (std::size_t i = 0; i < n; ++i) {
          E x;
          std::memcpy(&x, cursor + i * sizeof(E), sizeof(E));
          elems[i] = static_cast<E>(static_cast<Sum>(elems[i]) + static_cast<Sum>(x));
        }
      }
      cursor += n * sizeof(E);
    };
    if (comm::is_lse(c.buffer)) {
      const LseView<A>& v = b.lse_of(c.buffer);
      for (std::int64_t h = c.heads.begin; h < c.heads.end; ++h)
        run(&v(static_cast<int>(h), c.rows.begin), static_cast<std::size_t>(c.rows.size()));
      return;
    }
    const ThdView<T>& v = b[c.buffer];
    const bool heads_contiguous = v.head_stride == d;
    for (std::int64_t t = c.rows.begin; t < c.rows.end; ++t) {
      if (heads_contiguous) {
        run(v.row(t, static_cast<int>(c.heads.begin)), static_cast<std::size_t>(c.heads.size() * d));
      } else {
        for (std::int64_t h = c.heads.begin; h < c.heads.end; ++h)
          run(v.row(t, static_cast<int>(h)), static_cast<std::size_t>(d));
      }
    }
  }
};

}  // namespace seqpar::runtime
