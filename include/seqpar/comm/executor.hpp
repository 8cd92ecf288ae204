// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/attention/merge.hpp"
#include "seqpar/comm/program.hpp"
#include "seqpar/core/error.hpp"
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

  /// The transport of each level (Level::kGroup, kInner, kOuter); levels a program does not use
  /// may be null.
  template <class Tr>
  using Levels = std::array<Tr*, kNumLevels>;

  template <Transport Tr>
  static void run(const Program& program, Levels<Tr> transports, Kernel& kernel, Buffers buffers,
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
    const auto level = [&](Level l) -> Tr& {
      Tr* t = transports[static_cast<std::size_t>(l)];
      if (t == nullptr) throw std::logic_error("comm::Executor: program uses a level without a transport");
      return *t;
    };
    std::array<InFlight<Tr>, kNumSlots> slots;
    for (std::size_t step_index = 0; step_index < program.steps.size(); ++step_index) {
      const Step& step = program.steps[step_index];
      // A failure names the step, so that this rank's error (and its peers' "rank R failed: ...")
      // says where the program stopped.
      const auto where = [&] {
        static constexpr const char* kKinds[] = {"exchange", "zero", "compute", "post", "wait"};
        return "rank " + std::to_string(program.rank) + ", step " + std::to_string(step_index + 1) + "/" +
               std::to_string(program.steps.size()) + " (" + kKinds[step.index()] + "): ";
      };
      try {
      if (const auto* ex = std::get_if<ExchangeStep>(&step)) {
        exchange(*ex, program, level(ex->level), buffers, pack_send, pack_recv);
      } else if (const auto* z = std::get_if<ZeroStep>(&step)) {
        zero(*z, buffers);
      } else if (const auto* c = std::get_if<ComputeStep>(&step)) {
        compute(*c, program, kernel, buffers, kernel_ws);
      } else if (const auto* post = std::get_if<PostStep>(&step)) {
        const auto s = static_cast<std::size_t>(post->slot);
        InFlight<Tr>& f = slots[s];
        f.step = post;
        f.transport = &level(post->level);
        std::byte* cursor = workspace.data() + lay.slot_send[s];
        for (const Transfer& t : post->sends) {
          std::byte* start = cursor;
          for (const BufferPiece& bp : t.pieces) cursor = copy_piece<false>(buffers, bp.buffer, bp.piece, cursor, d, false);
          f.requests.push_back(f.transport->isend(std::span<const std::byte>(start, cursor), t.peer, post->tag));
        }
        cursor = workspace.data() + lay.slot_recv[s];
        for (const Transfer& t : post->recvs) {
          std::size_t n = 0;
          for (const BufferPiece& bp : t.pieces) n += piece_bytes(bp.piece, bp.buffer, d);
          f.requests.push_back(f.transport->irecv(std::span<std::byte>(cursor, n), t.peer, post->tag));
          cursor += n;
        }
      } else {
        InFlight<Tr>& f = slots[static_cast<std::size_t>(std::get<WaitStep>(step).slot)];
        for (auto& r : f.requests) f.transport->wait(r);
        f.requests.clear();
        std::byte* cursor = workspace.data() + lay.slot_recv[static_cast<std::size_t>(std::get<WaitStep>(step).slot)];
        for (const Transfer& t : f.step->recvs)
          for (const BufferPiece& bp : t.pieces)
            cursor = copy_piece<true>(buffers, bp.buffer, bp.piece, cursor, d, f.step->accumulate);
      }
      } catch (const Error& e) {
        throw Error(e.code(), where() + e.detail());
      } catch (const std::invalid_argument&) {
        throw;  // a bad argument names itself
      } catch (const std::exception& e) {
        throw Error(Errc::kStepFailed, where() + e.what());
      }
    }
  }

 private:
  static constexpr std::size_t kAlign = 64;
  static constexpr std::size_t idx(BufferId b) noexcept { return static_cast<std::size_t>(b); }
  static constexpr std::size_t round_up(std::size_t n) noexcept { return (n + kAlign - 1) / kAlign * kAlign; }
  static constexpr std::size_t elem_bytes(BufferId b) noexcept {
    return is_lse(b) ? sizeof(accum_type) : sizeof(value_type);
  }

  template <class Tr>
  struct InFlight {
    const PostStep* step = nullptr;
    Tr* transport = nullptr;
    std::vector<typename Tr::Request> requests;
  };

  struct Layout {
    std::vector<std::size_t> staging;
    std::size_t send = 0, send_bytes = 0, recv = 0, recv_bytes = 0, kernel = 0, kernel_bytes = 0, total = 0;
    std::array<std::size_t, kNumSlots> slot_send{}, slot_recv{}, slot_send_bytes{}, slot_recv_bytes{};
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
      } else if (const auto* post = std::get_if<PostStep>(&step)) {
        const auto slot = static_cast<std::size_t>(post->slot);
        std::size_t sb = 0, rb = 0;
        for (const Transfer& t : post->sends)
          for (const BufferPiece& bp : t.pieces) sb += piece_bytes(bp.piece, bp.buffer, program.head_dim);
        for (const Transfer& t : post->recvs)
          for (const BufferPiece& bp : t.pieces) rb += piece_bytes(bp.piece, bp.buffer, program.head_dim);
        lay.slot_send_bytes[slot] = std::max(lay.slot_send_bytes[slot], sb);
        lay.slot_recv_bytes[slot] = std::max(lay.slot_recv_bytes[slot], rb);
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
    for (int slot = 0; slot < kNumSlots; ++slot) {
      lay.slot_send[static_cast<std::size_t>(slot)] = off;
      off += round_up(lay.slot_send_bytes[static_cast<std::size_t>(slot)]);
      lay.slot_recv[static_cast<std::size_t>(slot)] = off;
      off += round_up(lay.slot_recv_bytes[static_cast<std::size_t>(slot)]);
    }
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
      const auto q = thd(c.q, q0, nq), k = thd(c.k, k0, nk), v = thd(c.v, k0, nk), o = thd(c.o, q0, nq);
      const auto lse = b.lse[idx(c.lse)].heads_slice(q0, nq);
      if (c.backward) {
        for (const auto& wave : c.waves)
          kernel.backward(shape, q, k, v, o, LseView<const accum_type>(lse), thd(c.dout, q0, nq), wave,
                          thd(c.dq, q0, nq), thd(c.dk, k0, nk), thd(c.dv, k0, nk), kernel_ws);
        continue;
      }
      if (!c.merge && c.waves.empty()) {  // nothing visible: the defined empty result
        for (std::int64_t t = 0; t < o.tokens; ++t)
          for (int h = 0; h < nq; ++h) std::fill_n(o.row(t, h), o.head_dim, value_type(0));
        for (int h = 0; h < nq; ++h) std::fill_n(&lse(h, 0), o.tokens, -std::numeric_limits<accum_type>::infinity());
      }
      for (std::size_t w = 0; w < c.waves.size(); ++w) {
        if (w == 0 && !c.merge) {
          kernel.forward(shape, q, k, v, c.waves[w], o, lse, kernel_ws);
          continue;
        }
        // Partial result of this wave, then merged row range by row range (only the rows it covers).
        const auto o_part = b.thd[idx(BufferId::kOPart)].heads_slice(0, nq);
        const auto lse_part = b.lse[idx(BufferId::kLsePart)].heads_slice(0, nq);
        kernel.forward(shape, q, k, v, c.waves[w], o_part, lse_part, kernel_ws);
        for (const AttnSlice& s : c.waves[w]) {
          const std::int64_t r0 = s.q_range.begin, n = s.q_range.size();
          attention::merge_into(o.tokens_slice(r0, n), lse.tokens_slice(r0, n),
                                ThdView<const value_type>(o_part.tokens_slice(r0, n)),
                                LseView<const accum_type>(lse_part.tokens_slice(r0, n)));
        }
      }
    }
  }
};

}  // namespace seqpar::comm
