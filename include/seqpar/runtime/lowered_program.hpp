// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `runtime::LoweredProgram`: a compiled `comm::Program` turned, once per cache entry, into the flat
/// tables an executor walks (CUTLASS's `initialize` before `run`). Every size, offset, per-peer count
/// and slice list is computed here, so that running it only reads tables: on the host it allocates
/// nothing, on a device the tables are uploaded once.
///
/// Lowering also makes the program's implicit work explicit. A compute step becomes one
/// `AttentionOp` per (head group, wave), a `FillEmptyOp` for rows no wave covers, and a `MergeOp`
/// after every partial wave; an exchange becomes pack / collective / unpack in one `ExchangeOp`; a
/// post and its wait carry their message tables. Every op declares the buffers it reads and writes
/// (`Access`), so an executor with a compute stream and a comm stream can place ops and insert the
/// waits between them.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/overloaded.hpp"
#include "seqpar/core/range.hpp"

namespace seqpar::runtime {

using comm::BufferId;
using comm::kNumBuffers;
using comm::kNumSlots;

/// A run of a table: entries [first, first + count).
struct TableSpan {
  std::uint32_t first = 0;
  std::uint32_t count = 0;
};

/// Resources an op touches, one bit each: the program's buffers (bit = BufferId), then the
/// executor's message regions (the exchange's send and receive regions, each transfer slot's).
namespace access {
inline constexpr int kPackSend = kNumBuffers;
inline constexpr int kPackRecv = kNumBuffers + 1;
[[nodiscard]] constexpr int slot_send(int slot) noexcept {
  return kNumBuffers + 2 + slot;
}
[[nodiscard]] constexpr int slot_recv(int slot) noexcept {
  return kNumBuffers + 2 + kNumSlots + slot;
}
inline constexpr int kNumResources = kNumBuffers + 2 + 2 * kNumSlots;
static_assert(kNumResources <= 64, "runtime::Access: resources no longer fit one 64-bit set");
[[nodiscard]] constexpr std::uint64_t bit(int resource) noexcept {
  return std::uint64_t{1} << resource;
}
[[nodiscard]] constexpr std::uint64_t bit(BufferId b) noexcept {
  return bit(static_cast<int>(b));
}
}  // namespace access

/// What an op reads and writes (sets of access:: bits). An accumulating write also reads.
struct Access {
  std::uint64_t reads = 0;
  std::uint64_t writes = 0;
};

/// One box of a buffer copied to or from a message at `offset` bytes into its region: rows outer,
/// heads inner for THD buffers; heads outer, rows inner for LSE buffers. `accumulate` adds on unpack.
struct PieceCopy {
  BufferId buffer{};
  bool accumulate = false;
  Range rows;
  Range heads;
  std::uint64_t offset = 0;
};

/// One message of a post: to or from `peer`, `bytes` at `offset` into the slot's region.
struct TransferEntry {
  int peer = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  TableSpan copies;  ///< pack (send) or unpack (receive) copies
};

/// Pack `pack` into the send region, one all_to_all_v with per-peer byte counts, unpack `unpack`.
struct ExchangeOp {
  comm::Level level = comm::Level::kGroup;
  TableSpan pack, unpack;
  TableSpan send_counts, recv_counts;  ///< into LoweredProgram::counts, one entry per peer
  std::uint64_t send_bytes = 0, recv_bytes = 0;
};

/// Zero-fill buffers (into LoweredProgram::buffers).
struct ZeroOp {
  TableSpan buffers;
};

/// O = 0 and LSE = -inf on the query heads of `heads`: the defined result of rows no slice covers.
struct FillEmptyOp {
  BufferId o = BufferId::kO, lse = BufferId::kLse;
  comm::HeadGroup heads;
};

/// One kernel call over the head sub-views of `heads` and the slices `slices` (disjoint query rows).
/// Forward writes o/lse, or with `partial` the kOPart/kLsePart staging that a MergeOp folds in;
/// backward accumulates into dq/dk/dv.
struct AttentionOp {
  bool backward = false;
  bool partial = false;
  comm::HeadGroup heads;
  TableSpan slices;
  BufferId q = BufferId::kQ, k = BufferId::kK, v = BufferId::kV, o = BufferId::kO, lse = BufferId::kLse;
  BufferId dout = BufferId::kDout, dq = BufferId::kDq, dk = BufferId::kDk, dv = BufferId::kDv;
};

/// Merges the partial result (kOPart, kLsePart) into o/lse on the query rows of `slices`.
struct MergeOp {
  BufferId o = BufferId::kO, lse = BufferId::kLse;
  comm::HeadGroup heads;
  TableSpan slices;
};

/// Local copies between buffers: `pack` into the exchange's send region, then `unpack` from it (the
/// same pack/unpack as an exchange, no collective between them).
struct CopyOp {
  TableSpan pack, unpack;
  std::uint64_t bytes = 0;
};

/// Starts a slot's transfers: `sends` packed now and sent, `recvs` posted.
struct PostOp {
  comm::Level level = comm::Level::kGroup;
  int slot = 0;
  int tag = 0;
  TableSpan sends, recvs;  ///< into LoweredProgram::transfers
};

/// Completes a slot's transfers and unpacks what it received.
struct WaitOp {
  int slot = 0;
  TableSpan unpack;
};

using Op = std::variant<ExchangeOp, ZeroOp, FillEmptyOp, AttentionOp, MergeOp, PostOp, WaitOp, CopyOp>;

/// An op, what it touches, and the program step it came from (for error messages).
struct LoweredOp {
  Op op;
  Access access;
  std::uint32_t step = 0;
  const char* kind = "";
};

/// Byte offsets of everything in the executor's workspace.
struct WorkspaceLayout {
  static constexpr std::uint64_t kAlign = 64;
  std::array<std::uint64_t, kNumBuffers> staging{};  ///< offset of each staging buffer (unused: 0)
  std::uint64_t pack_send = 0, pack_send_bytes = 0, pack_recv = 0, pack_recv_bytes = 0;
  std::uint64_t kernel = 0, kernel_bytes = 0;
  std::array<std::uint64_t, kNumSlots> slot_send{}, slot_recv{}, slot_send_bytes{}, slot_recv_bytes{};
  std::uint64_t total = 0;
};

/// The lowered form of one rank's program.
struct LoweredProgram {
  int rank = 0;
  int head_dim = 0;    ///< q/k head size
  int head_dim_v = 0;  ///< v/o head size (0 = head_dim)
  double softmax_scale = 0;
  std::int64_t local_tokens = 0;
  std::int64_t carry_rows = 0;
  std::size_t num_steps = 0;
  std::vector<comm::BufferSpec> staging;
  std::array<std::vector<int>, comm::kNumLevels> level_members{};
  std::vector<LoweredOp> ops;
  std::vector<PieceCopy> copies;
  std::vector<AttnSlice> slices;
  std::vector<BufferId> buffers;
  std::vector<std::size_t> counts;
  std::vector<TransferEntry> transfers;
  std::array<std::size_t, kNumSlots> max_requests{};  ///< most requests in flight per slot
  /// Point-to-point messages one run receives on each level, and the largest (bytes): what an
  /// eagerly buffering transport reserves so that receiving allocates nothing.
  std::array<std::size_t, comm::kNumLevels> receives{};
  std::array<std::uint64_t, comm::kNumLevels> largest_receive{};
  WorkspaceLayout layout;

  /// The head size of each buffer's rows.
  [[nodiscard]] comm::HeadWidths widths() const noexcept { return {head_dim, head_dim_v != 0 ? head_dim_v : head_dim}; }

  template <class T>
  [[nodiscard]] std::span<const T> view(const std::vector<T>& table, TableSpan s) const noexcept {
    return {table.data() + s.first, s.count};
  }
};

namespace detail {

[[nodiscard]] constexpr std::uint64_t round_up(std::uint64_t n) noexcept {
  return (n + WorkspaceLayout::kAlign - 1) / WorkspaceLayout::kAlign * WorkspaceLayout::kAlign;
}

[[nodiscard]] inline TableSpan span_from(std::size_t first, std::size_t end) noexcept {
  return {static_cast<std::uint32_t>(first), static_cast<std::uint32_t>(end - first)};
}

/// Builds a LoweredProgram step by step.
class Lowering {
 public:
  Lowering(const comm::Program& program, std::size_t value_bytes, std::size_t lse_bytes)
      : p_(program), value_bytes_(value_bytes), lse_bytes_(lse_bytes) {
    out_.rank = program.rank;
    out_.head_dim = program.head_dim;
    out_.head_dim_v = program.widths().v;
    out_.softmax_scale = program.softmax_scale;
    out_.local_tokens = program.local_tokens;
    out_.carry_rows = program.carry_rows;
    out_.num_steps = program.steps.size();
    out_.staging = program.staging;
    out_.level_members = program.level_members;
  }

  template <class KernelBytes>
  LoweredProgram run(KernelBytes&& kernel_bytes) && {
    for (std::size_t i = 0; i < p_.steps.size(); ++i) {
      step_ = static_cast<std::uint32_t>(i);
      kind_ = comm::step_name(p_.steps[i]);
      std::visit(
          Overloaded{[&](const comm::ExchangeStep& s) { exchange(s); }, [&](const comm::ZeroStep& s) { zero(s); },
                     [&](const comm::ComputeStep& s) { compute(s, kernel_bytes); },
                     [&](const comm::PostStep& s) { post(s); }, [&](const comm::WaitStep& s) { wait(s); },
                     [&](const comm::CopyStep& s) { copy(s); }},
          p_.steps[i]);
    }
    place();
    return std::move(out_);
  }

 private:
  [[nodiscard]] std::uint64_t bytes(BufferId b, const comm::Piece& piece) const noexcept {
    return comm::piece_bytes(b, piece, p_.widths(), value_bytes_, lse_bytes_);
  }
  void emit(Op op, Access a) { out_.ops.push_back({std::move(op), a, step_, kind_}); }
  std::uint64_t add_copy(BufferId b, const comm::Piece& piece, bool accumulate, std::uint64_t offset) {
    out_.copies.push_back({b, accumulate, piece.rows, piece.heads, offset});
    return offset + bytes(b, piece);
  }
  TableSpan add_slices(std::span<const AttnSlice> s) {
    // Slices without query rows do nothing in any kernel; dropping them bounds a call's slice count
    // by its query rows, which device kernels size their tile tables by.
    const std::size_t first = out_.slices.size();
    for (const AttnSlice& x : s)
      if (!x.q_range.empty()) out_.slices.push_back(x);
    return span_from(first, out_.slices.size());
  }

  void exchange(const comm::ExchangeStep& ex) {
    // Every rank of the level takes part in the collective, with or without pieces.
    std::size_t peers = p_.level_members[static_cast<std::size_t>(ex.level)].size();
    for (const comm::Move& m : ex.moves) peers = std::max({peers, m.send.size(), m.recv.size()});
    ExchangeOp op;
    op.level = ex.level;
    Access a{access::bit(access::kPackRecv), access::bit(access::kPackSend)};
    // Pack peer by peer (moves in order inside a peer): the layout the receiver unpacks.
    std::size_t first = out_.copies.size();
    std::uint64_t offset = 0;
    const std::size_t counts_first = out_.counts.size();
    for (std::size_t peer = 0; peer < peers; ++peer) {
      const std::uint64_t start = offset;
      for (const comm::Move& m : ex.moves) {
        if (peer >= m.send.size()) continue;
        for (const comm::Piece& piece : m.send[peer]) offset = add_copy(m.src, piece, false, offset);
        a.reads |= access::bit(m.src);
      }
      out_.counts.push_back(static_cast<std::size_t>(offset - start));
    }
    op.send_counts = span_from(counts_first, out_.counts.size());
    op.pack = span_from(first, out_.copies.size());
    op.send_bytes = offset;
    first = out_.copies.size();
    offset = 0;
    const std::size_t recv_first = out_.counts.size();
    for (std::size_t peer = 0; peer < peers; ++peer) {
      const std::uint64_t start = offset;
      for (const comm::Move& m : ex.moves) {
        if (peer >= m.recv.size()) continue;
        for (const comm::Piece& piece : m.recv[peer]) offset = add_copy(m.dst, piece, m.accumulate, offset);
        a.writes |= access::bit(m.dst);
        if (m.accumulate) a.reads |= access::bit(m.dst);
      }
      out_.counts.push_back(static_cast<std::size_t>(offset - start));
    }
    op.recv_counts = span_from(recv_first, out_.counts.size());
    op.unpack = span_from(first, out_.copies.size());
    op.recv_bytes = offset;
    out_.layout.pack_send_bytes = std::max(out_.layout.pack_send_bytes, op.send_bytes);
    out_.layout.pack_recv_bytes = std::max(out_.layout.pack_recv_bytes, op.recv_bytes);
    emit(op, a);
  }

  void copy(const comm::CopyStep& step) {
    CopyOp op;
    Access a{access::bit(access::kPackSend), access::bit(access::kPackSend)};
    std::size_t first = out_.copies.size();
    std::uint64_t offset = 0;
    for (const comm::LocalMove& m : step.moves) {
      for (const comm::Piece& piece : m.from) offset = add_copy(m.src, piece, false, offset);
      a.reads |= access::bit(m.src);
    }
    op.pack = span_from(first, out_.copies.size());
    op.bytes = offset;
    first = out_.copies.size();
    std::uint64_t landed = 0;
    for (const comm::LocalMove& m : step.moves) {
      for (const comm::Piece& piece : m.to) landed = add_copy(m.dst, piece, m.accumulate, landed);
      a.writes |= access::bit(m.dst);
      if (m.accumulate) a.reads |= access::bit(m.dst);
    }
    op.unpack = span_from(first, out_.copies.size());
    if (landed != offset)
      throw std::logic_error("runtime::lower: a copy step's destination pieces hold " + std::to_string(landed) +
                             " bytes, its source pieces " + std::to_string(offset));
    out_.layout.pack_send_bytes = std::max(out_.layout.pack_send_bytes, op.bytes);
    emit(op, a);
  }

  void zero(const comm::ZeroStep& z) {
    const std::size_t first = out_.buffers.size();
    Access a;
    for (BufferId b : z.buffers) {
      out_.buffers.push_back(b);
      a.writes |= access::bit(b);
    }
    emit(ZeroOp{span_from(first, out_.buffers.size())}, a);
  }

  template <class KernelBytes>
  void compute(const comm::ComputeStep& c, KernelBytes& kernel_bytes) {
    const auto rows = [&](BufferId b) -> std::int64_t {
      if (comm::is_caller_buffer(b)) return p_.local_tokens;
      if (comm::is_carry_buffer(b)) return p_.carry_rows;
      const comm::BufferSpec* s = p_.staging_spec(b);
      return s ? s->rows : 0;
    };
    const auto inputs = access::bit(c.q) | access::bit(c.k) | access::bit(c.v);
    for (const comm::HeadGroup& g : c.head_groups) {
      const AttentionShape shape{static_cast<int>(g.q_heads.size()), static_cast<int>(g.kv_heads.size()), p_.head_dim,
                                 p_.softmax_scale, p_.widths().v};
      out_.layout.kernel_bytes =
          std::max<std::uint64_t>(out_.layout.kernel_bytes, kernel_bytes(shape, rows(c.q), rows(c.k)));
      if (c.backward) {
        const auto grads = access::bit(c.dq) | access::bit(c.dk) | access::bit(c.dv);
        for (const auto& wave : c.waves) {
          AttentionOp op{.backward = true, .partial = false, .heads = g, .slices = add_slices(wave)};
          set_buffers(op, c);
          emit(op, {inputs | access::bit(c.o) | access::bit(c.lse) | access::bit(c.dout) | grads, grads});
        }
        continue;
      }
      if (!c.merge && c.waves.empty()) emit(FillEmptyOp{c.o, c.lse, g}, {0, access::bit(c.o) | access::bit(c.lse)});
      const auto result = access::bit(c.o) | access::bit(c.lse);
      const auto part = access::bit(BufferId::kOPart) | access::bit(BufferId::kLsePart);
      for (std::size_t w = 0; w < c.waves.size(); ++w) {
        const bool partial = w > 0 || c.merge;
        AttentionOp op{.backward = false, .partial = partial, .heads = g, .slices = add_slices(c.waves[w])};
        set_buffers(op, c);
        emit(op, {inputs, partial ? part : result});
        if (partial) emit(MergeOp{c.o, c.lse, g, op.slices}, {result | part, result});
      }
    }
  }

  static void set_buffers(AttentionOp& op, const comm::ComputeStep& c) noexcept {
    op.q = c.q, op.k = c.k, op.v = c.v, op.o = c.o, op.lse = c.lse;
    op.dout = c.dout, op.dq = c.dq, op.dk = c.dk, op.dv = c.dv;
  }

  void post(const comm::PostStep& post) {
    const auto slot = static_cast<std::size_t>(post.slot);
    PostOp op{post.level, post.slot, post.tag, {}, {}};
    Access a{0, access::bit(access::slot_send(post.slot)) | access::bit(access::slot_recv(post.slot))};
    std::uint64_t offset = 0;
    const std::size_t sends_first = out_.transfers.size();
    for (const comm::Transfer& t : post.sends) {
      const std::size_t first = out_.copies.size();
      const std::uint64_t start = offset;
      for (const comm::BufferPiece& bp : t.pieces) {
        offset = add_copy(bp.buffer, bp.piece, false, offset);
        a.reads |= access::bit(bp.buffer);
      }
      out_.transfers.push_back({t.peer, start, offset - start, span_from(first, out_.copies.size())});
    }
    op.sends = span_from(sends_first, out_.transfers.size());
    out_.layout.slot_send_bytes[slot] = std::max(out_.layout.slot_send_bytes[slot], offset);
    offset = 0;
    const std::size_t recvs_first = out_.transfers.size();
    const std::size_t unpack_first = out_.copies.size();
    for (const comm::Transfer& t : post.recvs) {
      const std::size_t first = out_.copies.size();
      const std::uint64_t start = offset;
      for (const comm::BufferPiece& bp : t.pieces) offset = add_copy(bp.buffer, bp.piece, post.accumulate, offset);
      out_.transfers.push_back({t.peer, start, offset - start, span_from(first, out_.copies.size())});
      const auto level = static_cast<std::size_t>(post.level);
      out_.receives[level] += 1;
      out_.largest_receive[level] = std::max(out_.largest_receive[level], offset - start);
    }
    op.recvs = span_from(recvs_first, out_.transfers.size());
    out_.layout.slot_recv_bytes[slot] = std::max(out_.layout.slot_recv_bytes[slot], offset);
    pending_unpack_[slot] = span_from(unpack_first, out_.copies.size());
    pending_accumulate_[slot] = post.accumulate;
    out_.max_requests[slot] = std::max(out_.max_requests[slot], post.sends.size() + post.recvs.size());
    emit(op, a);
  }

  void wait(const comm::WaitStep& w) {
    const auto slot = static_cast<std::size_t>(w.slot);
    const TableSpan unpack = pending_unpack_[slot];
    Access a{access::bit(access::slot_recv(w.slot)), 0};
    for (std::uint32_t i = unpack.first; i < unpack.first + unpack.count; ++i) {
      a.writes |= access::bit(out_.copies[i].buffer);
      if (pending_accumulate_[slot]) a.reads |= access::bit(out_.copies[i].buffer);
    }
    pending_unpack_[slot] = {};
    emit(WaitOp{w.slot, unpack}, a);
  }

  // Staging buffers first, then the message regions and the kernel's scratch.
  void place() {
    WorkspaceLayout& l = out_.layout;
    std::uint64_t off = 0;
    for (const comm::BufferSpec& s : out_.staging) {
      l.staging[static_cast<std::size_t>(s.id)] = off;
      const auto elems = static_cast<std::uint64_t>(s.rows) * static_cast<std::uint64_t>(s.heads) *
                         (comm::is_lse(s.id) ? 1u : static_cast<std::uint64_t>(p_.widths().of(s.id)));
      off += round_up(elems * (comm::is_lse(s.id) ? lse_bytes_ : value_bytes_));
    }
    const auto region = [&](std::uint64_t& at, std::uint64_t bytes) {
      at = off;
      off += round_up(bytes);
    };
    region(l.pack_send, l.pack_send_bytes);
    region(l.pack_recv, l.pack_recv_bytes);
    region(l.kernel, l.kernel_bytes);
    for (std::size_t s = 0; s < static_cast<std::size_t>(kNumSlots); ++s) {
      region(l.slot_send[s], l.slot_send_bytes[s]);
      region(l.slot_recv[s], l.slot_recv_bytes[s]);
    }
    l.total = off;
  }

  const comm::Program& p_;
  std::size_t value_bytes_, lse_bytes_;
  LoweredProgram out_;
  std::uint32_t step_ = 0;
  const char* kind_ = "";
  std::array<TableSpan, kNumSlots> pending_unpack_{};
  std::array<bool, kNumSlots> pending_accumulate_{};
};

}  // namespace detail

/// Lowers `program` for elements of `value_bytes` and LSE entries of `lse_bytes`;
/// `kernel_bytes(shape, q_rows, k_rows)` sizes the kernel's scratch for one call.
template <class KernelBytes>
[[nodiscard]] LoweredProgram lower(const comm::Program& program, std::size_t value_bytes, std::size_t lse_bytes,
                                   KernelBytes&& kernel_bytes) {
  return detail::Lowering(program, value_bytes, lse_bytes).run(kernel_bytes);
}

}  // namespace seqpar::runtime
