// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::comm {

/// Runs any communicator's program over a transport and a kernel. The one loop every strategy
/// shares: exchanges pack their pieces into one all_to_all_v, compute steps call the kernel on head
/// sub-views, zero steps clear accumulators. All scratch lives in a caller-provided workspace sized
/// by `workspace_bytes`; running a program allocates nothing.
template <attention::AttentionKernel Kernel>
class Executor {
 public:
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;

  /// Views of every buffer: the caller fills the caller buffers (kQ..kDv), `run` the staging ones.
  struct Buffers {
    std::array<ThdView<value_type>, kNumBuffers> thd{};
    std::array<LseView<accum_type>, kNumBuffers> lse{};
  };

  [[nodiscard]] static std::size_t workspace_bytes(const Program& program, const Kernel& kernel) {
    return layout(program, kernel).total;
  }

  template <Transport Tr>
  static void run(const Program& program, Tr& transport, Kernel& kernel, Buffers buffers,
                  std::span<std::byte> workspace) {
    const Layout lay = layout(program, kernel);
    if (workspace.size() < lay.total)
      throw std::invalid_argument("comm::Executor::run: workspace.size() = " + std::to_string(workspace.size()) +
                                  ": needs " + std::to_string(lay.total) + " bytes");
    const int d = program.head_dim;
    for (std::size_t i = 0; i < program.staging.size(); ++i) {
      const BufferSpec& s = program.staging[i];
      std::byte* base = workspace.data() + lay.staging[i];
      if (is_lse(s.id))
        buffers.lse[idx(s.id)] = LseView<accum_type>::dense(reinterpret_cast<accum_type*>(base), s.heads, s.rows);
      else
        buffers.thd[idx(s.id)] = ThdView<value_type>::dense(reinterpret_cast<value_type*>(base), s.rows, s.heads, d);
    }
    const auto pack_send = workspace.subspan(lay.send, lay.send_bytes);
    const auto pack_recv = workspace.subspan(lay.recv, lay.recv_bytes);
    const auto kernel_ws = workspace.subspan(lay.kernel, lay.kernel_bytes);
    for (const Step& step : program.steps) {
      if (const auto* ex = std::get_if<ExchangeStep>(&step))
        exchange(*ex, program, transport, buffers, pack_send, pack_recv);
      else if (const auto* z = std::get_if<ZeroStep>(&step))
        zero(*z, buffers);
      else
        compute(std::get<ComputeStep>(step), program, kernel, buffers, kernel_ws);
    }
  }

 private:
  static constexpr std::size_t kAlign = 64;
  static constexpr std::size_t idx(BufferId b) noexcept { return static_cast<std::size_t>(b); }
  static constexpr std::size_t round_up(std::size_t n) noexcept { return (n + kAlign - 1) / kAlign * kAlign; }
  static constexpr std::size_t elem_bytes(BufferId b) noexcept {
    return is_lse(b) ? sizeof(accum_type) : sizeof(value_type);
  }

  struct Layout {
    std::vector<std::size_t> staging;
    std::size_t send = 0, send_bytes = 0, recv = 0, recv_bytes = 0, kernel = 0, kernel_bytes = 0, total = 0;
  };

  static std::size_t piece_bytes(const Piece& p, BufferId b, int d) noexcept {
    return static_cast<std::size_t>(p.elements(d, is_lse(b))) * elem_bytes(b);
  }

  static Layout layout(const Program& program, const Kernel& kernel) {
    Layout lay;
    std::size_t off = 0;
    for (const BufferSpec& s : program.staging) {
      lay.staging.push_back(off);
      const std::size_t n = static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.heads) *
                            (is_lse(s.id) ? 1u : static_cast<std::size_t>(program.head_dim));
      off += round_up(n * elem_bytes(s.id));
    }
    for (const Step& step : program.steps) {
      if (const auto* ex = std::get_if<ExchangeStep>(&step)) {
        std::size_t s = 0, r = 0;
        for (const Move& m : ex->moves) {
          for (const auto& peer : m.send)
            for (const Piece& p : peer) s += piece_bytes(p, m.src, program.head_dim);
          for (const auto& peer : m.recv)
            for (const Piece& p : peer) r += piece_bytes(p, m.dst, program.head_dim);
        }
        lay.send_bytes = std::max(lay.send_bytes, s);
        lay.recv_bytes = std::max(lay.recv_bytes, r);
      } else if (const auto* c = std::get_if<ComputeStep>(&step)) {
        const auto rows = [&](BufferId b) {
          if (is_caller_buffer(b)) return program.local_tokens;
          const BufferSpec* s = program.staging_spec(b);
          return s ? s->rows : std::int64_t{0};
        };
        for (const HeadGroup& g : c->head_groups) {
          const AttentionShape shape{static_cast<int>(g.q_heads.size()), static_cast<int>(g.kv_heads.size()),
                                     program.head_dim, program.softmax_scale};
          lay.kernel_bytes = std::max(lay.kernel_bytes, kernel.workspace_bytes(shape, rows(c->q), rows(c->k)));
        }
      }
    }
    lay.send = off;
    off += round_up(lay.send_bytes);
    lay.recv = off;
    off += round_up(lay.recv_bytes);
    lay.kernel = off;
    off += round_up(lay.kernel_bytes);
    lay.total = off;
    return lay;
  }

  // THD pieces travel rows outer, heads inner; LSE pieces heads outer, rows inner (its contiguous axis).
  template <bool kUnpack>
  static std::byte* copy_piece(const Buffers& b, BufferId id, const Piece& p, std::byte* cursor, int d,
                               bool accumulate) {
    const auto move_run = [&](auto* elems, std::size_t n) {
      using E = std::remove_pointer_t<decltype(elems)>;
      if constexpr (!kUnpack) {
        std::memcpy(cursor, elems, n * sizeof(E));
      } else if (!accumulate) {
        std::memcpy(elems, cursor, n * sizeof(E));
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          E x;
          std::memcpy(&x, cursor + i * sizeof(E), sizeof(E));
          elems[i] += x;
        }
      }
      cursor += n * sizeof(E);
    };
    if (is_lse(id)) {
      const LseView<accum_type>& v = b.lse[idx(id)];
      for (std::int64_t h = p.heads.begin; h < p.heads.end; ++h)
        move_run(&v(static_cast<int>(h), p.rows.begin), static_cast<std::size_t>(p.rows.size()));
    } else {
      const ThdView<value_type>& v = b.thd[idx(id)];
      const bool heads_contiguous = v.head_stride == d;
      for (std::int64_t t = p.rows.begin; t < p.rows.end; ++t) {
        if (heads_contiguous) {
          move_run(v.row(t, static_cast<int>(p.heads.begin)), static_cast<std::size_t>(p.heads.size() * d));
        } else {
          for (std::int64_t h = p.heads.begin; h < p.heads.end; ++h)
            move_run(v.row(t, static_cast<int>(h)), static_cast<std::size_t>(d));
        }
      }
    }
    return cursor;
  }

  template <Transport Tr>
  static void exchange(const ExchangeStep& ex, const Program& program, Tr& transport, const Buffers& b,
                       std::span<std::byte> send_buf, std::span<std::byte> recv_buf) {
    const int peers = transport.size();
    const int d = program.head_dim;
    std::vector<std::size_t> send_counts(static_cast<std::size_t>(peers), 0), recv_counts(send_counts);
    std::byte* cursor = send_buf.data();
    for (int p = 0; p < peers; ++p) {
      std::byte* start = cursor;
      for (const Move& m : ex.moves)
        for (const Piece& piece : m.send.at(static_cast<std::size_t>(p)))
          cursor = copy_piece<false>(b, m.src, piece, cursor, d, false);
      send_counts[static_cast<std::size_t>(p)] = static_cast<std::size_t>(cursor - start);
      for (const Move& m : ex.moves)
        for (const Piece& piece : m.recv.at(static_cast<std::size_t>(p)))
          recv_counts[static_cast<std::size_t>(p)] += piece_bytes(piece, m.dst, d);
    }
    std::size_t recv_total = 0;
    for (std::size_t c : recv_counts) recv_total += c;
    transport.all_to_all_v(send_buf.first(static_cast<std::size_t>(cursor - send_buf.data())), send_counts,
                           recv_buf.first(recv_total), recv_counts);
    cursor = recv_buf.data();
    for (int p = 0; p < peers; ++p)
      for (const Move& m : ex.moves)
        for (const Piece& piece : m.recv[static_cast<std::size_t>(p)])
          cursor = copy_piece<true>(b, m.dst, piece, cursor, d, m.accumulate);
  }

  static void zero(const ZeroStep& z, const Buffers& b) {
    for (BufferId id : z.buffers) {
      if (is_lse(id)) {
        const auto& v = b.lse[idx(id)];
        for (int h = 0; h < v.heads; ++h)
          for (std::int64_t t = 0; t < v.tokens; ++t) v(h, t) = accum_type(0);
      } else {
        const auto& v = b.thd[idx(id)];
        for (std::int64_t t = 0; t < v.tokens; ++t)
          for (int h = 0; h < v.heads; ++h) std::fill_n(v.row(t, h), v.head_dim, value_type(0));
      }
    }
  }

  static void compute(const ComputeStep& c, const Program& program, Kernel& kernel, const Buffers& b,
                      std::span<std::byte> kernel_ws) {
    for (const HeadGroup& g : c.head_groups) {
      const int q0 = static_cast<int>(g.q_heads.begin), nq = static_cast<int>(g.q_heads.size());
      const int k0 = static_cast<int>(g.kv_heads.begin), nk = static_cast<int>(g.kv_heads.size());
      const AttentionShape shape{nq, nk, program.head_dim, program.softmax_scale};
      const auto thd = [&](BufferId id, int first, int n) { return b.thd[idx(id)].heads_slice(first, n); };
      const auto lse = b.lse[idx(c.lse)].heads_slice(q0, nq);
      if (!c.backward) {
        kernel.forward(shape, thd(c.q, q0, nq), thd(c.k, k0, nk), thd(c.v, k0, nk), c.slices, thd(c.o, q0, nq), lse,
                       kernel_ws);
      } else {
        kernel.backward(shape, thd(c.q, q0, nq), thd(c.k, k0, nk), thd(c.v, k0, nk), thd(c.o, q0, nq),
                        LseView<const accum_type>(lse), thd(c.dout, q0, nq), c.slices, thd(c.dq, q0, nq),
                        thd(c.dk, k0, nk), thd(c.dv, k0, nk), kernel_ws);
      }
    }
  }
};

}  // namespace seqpar::comm
