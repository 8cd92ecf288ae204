// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `kokkos::KokkosExec<ExecSpace>`: the execution context of the Kokkos kernels, and the executor's
/// data movement on it (`runtime::DataOps<KokkosExec<ExecSpace>>`).
///
/// A context holds one instance of a Kokkos execution space. It is host-synchronous for the runtime:
/// every kernel call fences its space before returning, so the executor may hand buffers to a host
/// transport (in-process, MPI) right after it. The executor's own pack / unpack / zero / merge run
/// as host loops, which needs the space's memory to be host accessible (Serial, OpenMP, Threads, HPX,
/// or CUDA/HIP with unified memory spaces); a space whose memory the host cannot read is refused at
/// compile time by DataOps (the kernel itself, `attention::KokkosFlash`, runs on any space).

#include <Kokkos_Core.hpp>

#include <mutex>

#include "seqpar/core/exec.hpp"
#include "seqpar/core/host_exec.hpp"
#include "seqpar/runtime/data_ops.hpp"

namespace seqpar::kokkos {

template <class ExecSpace>
class KokkosExec {
 public:
  using exec_category = exec_tag;
  using execution_space = ExecSpace;
  using memory_space = typename ExecSpace::memory_space;
  /// Every call on the context fences the space before returning.
  static constexpr bool kHostSynchronous = true;

  /// The default instance of ExecSpace (construct after Kokkos::initialize).
  KokkosExec() = default;
  explicit KokkosExec(ExecSpace space) : space_(space) {}

  [[nodiscard]] const ExecSpace& space() const noexcept { return space_; }
  void synchronize() const { space_.fence(); }

 private:
  ExecSpace space_{};
};

/// Whether the host can read and write the memory of ExecSpace (DataOps needs it).
template <class ExecSpace>
inline constexpr bool kHostAccessible =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;

/// The lock that serialises kernel launches on ExecSpace from several host threads (the in-process
/// world runs one rank per thread). Kokkos 3.4 keeps one team-scratch buffer per execution space
/// instance (Serial: one for the process), so two concurrent team launches would share it.
template <class ExecSpace>
[[nodiscard]] std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace seqpar::kokkos

namespace seqpar::runtime {

/// The executor's data movement on a Kokkos context: HostExec's loops, after a fence (the kernels
/// fence too; this keeps the order if a user issues work on the space between executor steps).
template <class ExecSpace>
struct DataOps<kokkos::KokkosExec<ExecSpace>> {
  static_assert(kokkos::kHostAccessible<ExecSpace>,
                "DataOps<KokkosExec<ExecSpace>>: the memory space of ExecSpace is not host accessible; the executor's "
                "pack / unpack / merge for device memory are not written yet (use attention::KokkosFlash directly)");
  using Exec = kokkos::KokkosExec<ExecSpace>;
  using Host = DataOps<HostExec>;
  using Tables = Host::Tables;
  using Workspace = Host::Workspace;

  [[nodiscard]] static Tables upload(const Exec&, const LoweredProgram& lp) noexcept {
    return {lp.copies.data(), lp.slices.data()};
  }
  [[nodiscard]] static Workspace allocate(const Exec&, std::size_t bytes) { return Workspace(bytes); }

  template <class T, class A>
  static void pack(const Exec& e, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies, std::byte* region,
                   comm::HeadWidths widths) {
    e.synchronize();
    Host::pack(inline_host(), b, copies, region, widths);
  }
  template <class T, class A>
  static void unpack(const Exec& e, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies, const std::byte* region,
                     comm::HeadWidths widths) {
    e.synchronize();
    Host::unpack(inline_host(), b, copies, region, widths);
  }
  template <class T, class A>
  static void zero(const Exec& e, const BufferTable<T, A>& b, std::span<const BufferId> buffers) {
    e.synchronize();
    Host::zero(inline_host(), b, buffers);
  }
  template <class T, class A>
  static void fill_empty(const Exec& e, ThdView<T> o, LseView<A> lse) {
    e.synchronize();
    Host::fill_empty(inline_host(), o, lse);
  }
  template <class T, class A>
  static void merge(const Exec& e, ThdView<T> o, LseView<A> lse, ThdView<T> o_part, LseView<A> lse_part,
                    TableSlice<AttnSlice> slices) {
    e.synchronize();
    Host::merge(inline_host(), o, lse, o_part, lse_part, slices);
  }
  template <class T, class A>
  static void apply_sinks(const Exec& e, ThdView<T> o, LseView<A> lse, const A* sinks) {
    e.synchronize();
    Host::apply_sinks(inline_host(), o, lse, sinks);
  }
  template <class T, class A>
  static void sink_gradient(const Exec& e, ThdView<const T> dout, ThdView<const T> o, LseView<const A> lse,
                            const A* sinks, A* grad) {
    e.synchronize();
    Host::sink_gradient(inline_host(), dout, o, lse, sinks, grad);
  }
  template <class A>
  static void sum_parts(const Exec& e, const A* in, int parts, std::size_t n, A* out) {
    e.synchronize();
    Host::sum_parts(inline_host(), in, parts, n, out);
  }

 private:
  // HostExec's ops loop on the calling thread and never use their context's pool.
  static const HostExec& inline_host() {
    static const HostExec host(1);
    return host;
  }
};

}  // namespace seqpar::runtime
