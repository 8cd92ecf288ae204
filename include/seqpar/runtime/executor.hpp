// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cstddef>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/overloaded.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/transport.hpp"
#include "seqpar/runtime/data_ops.hpp"
#include "seqpar/runtime/lowered_program.hpp"

namespace seqpar::runtime {

/// Runs any communicator's program over a transport, a kernel and an execution context, in two
/// phases as CUTLASS does: `initialize` lowers the program once (flat tables, workspace layout,
/// request storage: every allocation happens here), `run` walks the tables and allocates nothing.
/// Exchanges pack their pieces into one all_to_all_v; posts and waits move ring blocks in transfer
/// slots while compute runs; attention ops call the kernel on head sub-views; merge, zero and fill
/// ops are `DataOps<exec_type>`. Ops run in program order (the static step order); each declares what
/// it reads and writes, for executors that place ops on several streams.
///
/// @code
/// runtime::Executor<attention::CpuFlash<float>, AnyTransport> ex;
/// ex.initialize(program, kernel);                    // once per cached program
/// AlignedBytes ws(ex.workspace_bytes());
/// ex.run({&group, nullptr, nullptr}, kernel, kernel.exec(), buffers, ws.span());
/// @endcode
///
/// A kernel with a preparation step (`attention::PreparingKernel`: `Params prepare(...)`) is prepared
/// in `initialize`, once per kernel call of the program, from the call's host slices; `run` passes
/// each call its `Params`. Other kernels are called without.
template <attention::AttentionKernel Kernel, Transport Tr>
class Executor {
  static_assert(!attention::kDeclaresParams<Kernel> || attention::PreparingKernel<Kernel>,
                "runtime::Executor: the kernel declares Params but is not an attention::PreparingKernel: give it "
                "`Params prepare(exec, shape, host_slices, q_rows, k_rows, attention::Pass) const` and forward / "
                "backward overloads taking `const Params&` after the execution context");

 public:
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;
  using exec_type = typename Kernel::exec_type;
  using Buffers = BufferTable<value_type, accum_type>;
  /// The transport of each level (Level::kGroup, kInner, kOuter); levels a program does not use may be null.
  using Levels = std::array<Tr*, comm::kNumLevels>;

  /// Lowers `program` for `kernel` (its element types and workspace needs).
  void initialize(const comm::Program& program, const Kernel& kernel) {
    lowered_ = lower(program, sizeof(value_type), sizeof(accum_type),
                     [&](const AttentionShape& shape, std::int64_t q_rows, std::int64_t k_rows) {
                       return static_cast<std::uint64_t>(kernel.workspace_bytes(shape, q_rows, k_rows));
                     });
    for (std::size_t s = 0; s < requests_.size(); ++s) {
      requests_[s].clear();
      requests_[s].reserve(lowered_.max_requests[s]);
    }
    tables_ = Ops::upload(kernel.exec(), lowered_);
    if constexpr (attention::PreparingKernel<Kernel>) {
      // The kernel's per-program parameters, one per kernel call in program order (run counts them off).
      params_.clear();
      const auto rows = [&](BufferId b) -> std::int64_t {
        if (comm::is_caller_buffer(b)) return program.local_tokens;
        const comm::BufferSpec* spec = program.staging_spec(b);
        return spec != nullptr ? spec->rows : 0;
      };
      for (const LoweredOp& lop : lowered_.ops)
        if (const auto* op = std::get_if<AttentionOp>(&lop.op))
          params_.push_back(kernel.prepare(kernel.exec(), kernel_shape(lowered_, *op),
                                           lowered_.view(lowered_.slices, op->slices), rows(op->q), rows(op->k),
                                           op->backward ? attention::Pass::kBackward : attention::Pass::kForward));
    }
  }

  /// The shape of the kernel call an attention op makes: its head group's heads, the program's head
  /// sizes and softmax scale.
  [[nodiscard]] static AttentionShape kernel_shape(const LoweredProgram& lp, const AttentionOp& op) noexcept {
    return {static_cast<int>(op.heads.q_heads.size()), static_cast<int>(op.heads.kv_heads.size()), lp.head_dim,
            lp.softmax_scale, lp.head_dim_v};
  }

  /// The kernel's answer (`attention::can_implement` on `exec`) for every kernel call of the lowered
  /// program: the first refusal, or success. Local: what an engine checks before it communicates.
  [[nodiscard]] Status can_implement(const Kernel& kernel, const exec_type& exec) const {
    for (const LoweredOp& lop : lowered_.ops)
      if (const auto* op = std::get_if<AttentionOp>(&lop.op))
        if (Status s = attention::can_implement(kernel, exec, kernel_shape(lowered_, *op)); !s) return s;
    return Status::success();
  }

  [[nodiscard]] const LoweredProgram& lowered() const noexcept { return lowered_; }
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return lowered_.layout.total; }

  /// Runs the program. `buffers` holds the caller's views (kQ..kDv); staging views are placed in
  /// `workspace` (at least workspace_bytes()). A failure names this rank, the step and its kind.
  void run(Levels transports, Kernel& kernel, const exec_type& exec, Buffers buffers, std::span<std::byte> workspace) {
    const LoweredProgram& lp = lowered_;
    const WorkspaceLayout& lay = lp.layout;
    if (workspace.size() < lay.total)
      throw std::invalid_argument("runtime::Executor::run: workspace.size() = " + std::to_string(workspace.size()) +
                                  ": needs " + std::to_string(lay.total) + " bytes");
    for (const comm::BufferSpec& s : lp.staging) {
      std::byte* base = workspace.data() + lay.staging[static_cast<std::size_t>(s.id)];
      if (comm::is_lse(s.id))
        buffers.lse[static_cast<std::size_t>(s.id)] =
            LseView<accum_type>::dense(reinterpret_cast<accum_type*>(base), s.heads, s.rows);
      else
        buffers.thd[static_cast<std::size_t>(s.id)] =
            ThdView<value_type>::dense(reinterpret_cast<value_type*>(base), s.rows, s.heads, lp.widths().of(s.id));
    }
    for (auto& r : requests_) r.clear();  // left over by a failed run (the failure has reached every rank)
    next_params_ = 0;
    const Context ctx{lp, transports, kernel, exec, buffers, workspace};
    for (const LoweredOp& op : lp.ops) {
      try {
        std::visit([&](const auto& o) { this->execute(ctx, o); }, op.op);
      } catch (const Error& e) {
        throw Error(e.code(), where(op) + e.detail());
      } catch (const std::invalid_argument&) {
        throw;  // a bad argument names itself
      } catch (const std::exception& e) {
        throw Error(Errc::kStepFailed, where(op) + e.what());
      }
    }
  }

 private:
  using Ops = DataOps<exec_type>;

  [[nodiscard]] TableSlice<PieceCopy> copies(TableSpan s) const noexcept {
    return {lowered_.view(lowered_.copies, s), tables_.copies + s.first};
  }
  [[nodiscard]] TableSlice<AttnSlice> slices(TableSpan s) const noexcept {
    return {lowered_.view(lowered_.slices, s), tables_.slices + s.first};
  }

  struct Context {
    const LoweredProgram& lp;
    Levels transports;
    Kernel& kernel;
    const exec_type& exec;
    const Buffers& b;
    std::span<std::byte> workspace;
    [[nodiscard]] std::byte* at(std::uint64_t offset) const noexcept { return workspace.data() + offset; }
    [[nodiscard]] Tr& level(comm::Level l) const {
      Tr* t = transports[static_cast<std::size_t>(l)];
      if (t == nullptr) throw std::logic_error("runtime::Executor: program uses a level without a transport");
      return *t;
    }
    // A host-ordered transport reads and writes memory now: work issued before must have finished.
    // A stream-ordered one enqueues on the context's comm queue, which first waits for the compute
    // queue (an event, no host wait).
    void before_transport(Tr& t) const {
      if (Executor::stream_ordered(t)) {
        if constexpr (StreamOrderedExec<exec_type>) {
          exec.comm_after_compute();
          t.set_queue(exec.comm_queue());
        } else {
          throw std::invalid_argument(
              "runtime::Executor: a stream-ordered transport needs a stream-ordered execution context "
              "(StreamOrderedExec: a CUDA context), not a host-synchronous one");
        }
      } else if constexpr (!exec_type::kHostSynchronous) {
        exec.synchronize();
      }
    }
    // What a transport delivered is read by compute work issued next.
    void after_transport(Tr& t) const {
      if constexpr (StreamOrderedExec<exec_type>)
        if (Executor::stream_ordered(t)) exec.compute_after_comm();
    }
  };

  [[nodiscard]] static bool stream_ordered(const Tr& t) {
    if constexpr (requires { t.stream_ordered(); })
      return t.stream_ordered();  // AnyTransport: known at run time
    else
      return StreamOrderedTransport<Tr>;
  }

  // A failure names the step, so that this rank's error (and its peers' "rank R failed: ...") says
  // where the program stopped.
  [[nodiscard]] std::string where(const LoweredOp& op) const {
    return "rank " + std::to_string(lowered_.rank) + ", step " + std::to_string(op.step + 1) + "/" +
           std::to_string(lowered_.num_steps) + " (" + op.kind + "): ";
  }

  void execute(const Context& c, const ExchangeOp& op) {
    Tr& t = c.level(op.level);
    const auto send_counts = c.lp.view(c.lp.counts, op.send_counts);
    const auto recv_counts = c.lp.view(c.lp.counts, op.recv_counts);
    if (send_counts.size() != static_cast<std::size_t>(t.size()))
      throw std::logic_error("runtime::Executor: exchange lowered for " + std::to_string(send_counts.size()) +
                             " peers on a transport of " + std::to_string(t.size()));
    std::byte* send = c.at(c.lp.layout.pack_send);
    std::byte* recv = c.at(c.lp.layout.pack_recv);
    Ops::pack(c.exec, c.b, copies(op.pack), send, c.lp.widths());
    c.before_transport(t);
    t.all_to_all_v(std::span<const std::byte>(send, op.send_bytes), send_counts,
                   std::span<std::byte>(recv, op.recv_bytes), recv_counts);
    c.after_transport(t);
    Ops::unpack(c.exec, c.b, copies(op.unpack), recv, c.lp.widths());
  }

  // A local copy bounces through the exchange's send region: the same pack and unpack an exchange
  // runs, so every context's DataOps serves it.
  void execute(const Context& c, const CopyOp& op) {
    std::byte* region = c.at(c.lp.layout.pack_send);
    Ops::pack(c.exec, c.b, copies(op.pack), region, c.lp.widths());
    Ops::unpack(c.exec, c.b, copies(op.unpack), region, c.lp.widths());
  }

  void execute(const Context& c, const ZeroOp& op) { Ops::zero(c.exec, c.b, c.lp.view(c.lp.buffers, op.buffers)); }

  void execute(const Context& c, const FillEmptyOp& op) {
    const int q0 = static_cast<int>(op.heads.q_heads.begin), nq = static_cast<int>(op.heads.q_heads.size());
    Ops::fill_empty(c.exec, c.b[op.o].heads_slice(q0, nq), c.b.lse_of(op.lse).heads_slice(q0, nq));
  }

  void execute(const Context& c, const AttentionOp& op) {
    const comm::HeadGroup& g = op.heads;
    const int q0 = static_cast<int>(g.q_heads.begin), nq = static_cast<int>(g.q_heads.size());
    const int k0 = static_cast<int>(g.kv_heads.begin), nk = static_cast<int>(g.kv_heads.size());
    const AttentionShape shape = kernel_shape(c.lp, op);
    const auto in = [&](BufferId id, int first, int n) {
      return ThdView<const value_type>(c.b[id].heads_slice(first, n));
    };
    // The kernel reads the slices in its context's memory (their device mirror on a GPU).
    const auto slices = this->slices(op.slices).in_context();
    const auto kernel_ws = c.workspace.subspan(c.lp.layout.kernel, c.lp.layout.kernel_bytes);
    const auto q = in(op.q, q0, nq), k = in(op.k, k0, nk), v = in(op.v, k0, nk);
    // A prepared kernel gets this call's Params (after the context); any other, none.
    const auto forward = [&](auto&&... args) {
      if constexpr (attention::PreparingKernel<Kernel>)
        c.kernel.forward(c.exec, params_[next_params_++], args...);
      else
        c.kernel.forward(c.exec, args...);
    };
    const auto backward = [&](auto&&... args) {
      if constexpr (attention::PreparingKernel<Kernel>)
        c.kernel.backward(c.exec, params_[next_params_++], args...);
      else
        c.kernel.backward(c.exec, args...);
    };
    if (op.backward) {
      backward(shape, q, k, v, in(op.o, q0, nq), LseView<const accum_type>(c.b.lse_of(op.lse).heads_slice(q0, nq)),
               in(op.dout, q0, nq), slices, c.b[op.dq].heads_slice(q0, nq), c.b[op.dk].heads_slice(k0, nk),
               c.b[op.dv].heads_slice(k0, nk), kernel_ws);
    } else if (op.partial) {
      forward(shape, q, k, v, slices, c.b[BufferId::kOPart].heads_slice(0, nq),
              c.b.lse_of(BufferId::kLsePart).heads_slice(0, nq), kernel_ws);
    } else {
      forward(shape, q, k, v, slices, c.b[op.o].heads_slice(q0, nq), c.b.lse_of(op.lse).heads_slice(q0, nq), kernel_ws);
    }
  }

  void execute(const Context& c, const MergeOp& op) {
    const int q0 = static_cast<int>(op.heads.q_heads.begin), nq = static_cast<int>(op.heads.q_heads.size());
    Ops::merge(c.exec, c.b[op.o].heads_slice(q0, nq), c.b.lse_of(op.lse).heads_slice(q0, nq),
               c.b[BufferId::kOPart].heads_slice(0, nq), c.b.lse_of(BufferId::kLsePart).heads_slice(0, nq),
               slices(op.slices));
  }

  void execute(const Context& c, const PostOp& op) {
    const auto slot = static_cast<std::size_t>(op.slot);
    Tr& t = c.level(op.level);
    level_of_slot_[slot] = &t;
    std::byte* send = c.at(c.lp.layout.slot_send[slot]);
    std::byte* recv = c.at(c.lp.layout.slot_recv[slot]);
    const auto sends = c.lp.view(c.lp.transfers, op.sends);
    for (const TransferEntry& e : sends) Ops::pack(c.exec, c.b, copies(e.copies), send, c.lp.widths());
    c.before_transport(t);
    for (const TransferEntry& e : sends)
      requests_[slot].push_back(t.isend(std::span<const std::byte>(send + e.offset, e.bytes), e.peer, op.tag));
    for (const TransferEntry& e : c.lp.view(c.lp.transfers, op.recvs))
      requests_[slot].push_back(t.irecv(std::span<std::byte>(recv + e.offset, e.bytes), e.peer, op.tag));
  }

  void execute(const Context& c, const WaitOp& op) {
    const auto slot = static_cast<std::size_t>(op.slot);
    Tr* t = level_of_slot_[slot];
    for (auto& r : requests_[slot]) t->wait(r);
    requests_[slot].clear();
    c.after_transport(*t);
    Ops::unpack(c.exec, c.b, copies(op.unpack), c.at(c.lp.layout.slot_recv[slot]), c.lp.widths());
  }

  LoweredProgram lowered_;
  typename Ops::Tables tables_{};
  std::array<std::vector<typename Tr::Request>, comm::kNumSlots> requests_;
  std::array<Tr*, comm::kNumSlots> level_of_slot_{};
  std::vector<attention::params_t<Kernel>> params_;  // prepared kernels: one per kernel call, in program order
  std::size_t next_params_ = 0;                      // the next call's, during run
};

}  // namespace seqpar::runtime
