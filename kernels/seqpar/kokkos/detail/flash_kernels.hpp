// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The team kernels of attention::KokkosFlash (functors, so they compile for every backend without
/// extended lambdas). Layout conventions: a team owns a query tile of one slice and one query head
/// (forward, dQ) or a key tile of the buffer and one KV head (dK/dV); threads of the team own rows
/// (TeamThreadRange), vector lanes own columns (ThreadVectorRange). Tiles live in team scratch:
/// K^T / V^T as [d][k_tile] (the score loop runs along keys, a stride-1 vector loop), V and K as
/// [k_tile][d] and accumulators as [rows][d] (the update loop runs along the head size).
/// Two head sizes (MLA): Q, K and their gradients have d_qk columns, V, O, dO and dV have d_v; every
/// tile is sized and strided by the width of the tensor it holds (S = Q K^T and dP = dO V^T contract
/// over d_qk and d_v respectively, O and dV accumulate d_v columns, dQ and dK d_qk).
/// Non-finite isolation: every sum runs over only the (row, key) pairs the mask and the slice admit;
/// masked or out-of-slice entries are skipped, never multiplied by a zero weight (0 * Inf is NaN).
/// Only std-free, KOKKOS_INLINE_FUNCTION code runs inside the kernels (no std::clamp, no
/// Range::size(), no numeric_limits): the same functors compile for CUDA, HIP and SYCL.

#include <Kokkos_Core.hpp>

#include <cstdint>

#include "seqpar/core/attn_slice.hpp"

namespace seqpar::kokkos::detail {

#if KOKKOS_VERSION >= 30700
using Kokkos::exp;
using Kokkos::log;
#else
using Kokkos::Experimental::exp;  // Kokkos < 3.7 (Debian's 3.4) has them only here
using Kokkos::Experimental::log;
#endif

/// THD rows in the kernel's memory: (t, h) -> data + t * token_stride + h * head_stride.
template <class T>
struct Rows {
  T* data = nullptr;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
  KOKKOS_INLINE_FUNCTION T* row(std::int64_t t, int h) const { return data + t * token_stride + h * head_stride; }
};

/// (h, t) -> data[h * head_stride + t].
template <class A>
struct LseRows {
  A* data = nullptr;
  std::int64_t head_stride = 0;
  KOKKOS_INLINE_FUNCTION A& operator()(int h, std::int64_t t) const { return data[h * head_stride + t]; }
};

/// A forward / dQ work unit: slice-relative rows [row0, row0 + q_tile) of slices[slice].
struct QTile {
  std::int64_t slice;
  std::int64_t row0;
};

KOKKOS_INLINE_FUNCTION std::int64_t clamp64(std::int64_t x, std::int64_t lo, std::int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
KOKKOS_INLINE_FUNCTION std::int64_t min64(std::int64_t a, std::int64_t b) {
  return a < b ? a : b;
}
KOKKOS_INLINE_FUNCTION std::int64_t max64(std::int64_t a, std::int64_t b) {
  return a > b ? a : b;
}

/// Mask::visible_keys for device code: slice-relative keys [lo, hi) of slice-relative row qi.
KOKKOS_INLINE_FUNCTION void visible_keys(const AttnSlice& s, std::int64_t qi, std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t klen = s.k_range.end - s.k_range.begin;
  if (s.mask.kind == MaskKind::kFull) {
    lo = 0;
    hi = klen;
    return;
  }
  hi = clamp64(qi + s.mask.causal_offset + 1, 0, klen);
  lo = s.mask.kind == MaskKind::kSlidingWindow
           ? clamp64(seqpar::detail::sub_sat(qi + s.mask.causal_offset + 1, s.mask.window), 0, hi)
           : 0;
}

/// Slice-relative rows [lo, hi) that see at least one of the slice-relative keys [k0, k1) (k0 < k1):
/// masks are monotone in the row. For one key (k1 = k0 + 1) exactly the rows that see it.
KOKKOS_INLINE_FUNCTION void rows_seeing(const AttnSlice& s, std::int64_t k0, std::int64_t k1, std::int64_t& lo,
                                        std::int64_t& hi) {
  const std::int64_t len = s.q_range.end - s.q_range.begin;
  if (s.mask.kind == MaskKind::kFull) {
    lo = 0;
    hi = len;
    return;
  }
  lo = clamp64(k0 - s.mask.causal_offset, 0, len);
  hi = s.mask.kind == MaskKind::kSlidingWindow
           ? clamp64(seqpar::detail::add_sat(k1 - 1 - s.mask.causal_offset, s.mask.window), lo, len)
           : len;
}

/// Exclusive scan over the slices: the query tiles of every non-empty slice, written in the final pass.
struct TileScan {
  using value_type = std::int64_t;
  const AttnSlice* slices;
  QTile* tiles;
  std::int64_t q_tile;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t i, std::int64_t& offset, bool final) const {
    const std::int64_t len = slices[i].q_range.end - slices[i].q_range.begin;
    const std::int64_t n = len > 0 ? (len + q_tile - 1) / q_tile : 0;
    if (final)
      for (std::int64_t t = 0; t < n; ++t) tiles[offset + t] = QTile{i, t * q_tile};
    offset += n;
  }
};

/// O = 0, LSE = -inf on every row (rows no slice covers keep them); O rows have d = d_v values.
template <class T, class A>
struct Prefill {
  Rows<T> o;
  LseRows<A> lse;
  int heads, d;
  A neg_inf;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t idx) const {
    const std::int64_t t = idx / heads;
    const int h = static_cast<int>(idx % heads);
    T* row = o.row(t, h);
    for (int x = 0; x < d; ++x) row[x] = T(0);
    lse(h, t) = neg_inf;
  }
};

/// D = rowsum(dO * O) per (query head, row), into delta[h * tokens + t]; over d = d_v values.
template <class T, class A>
struct RowDot {
  Rows<const T> dout, o;
  A* delta;
  std::int64_t tokens;
  int heads, d;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t idx) const {
    const std::int64_t t = idx / heads;
    const int h = static_cast<int>(idx % heads);
    const T* a = dout.row(t, h);
    const T* b = o.row(t, h);
    A sum = 0;
    for (int x = 0; x < d; ++x) sum += A(a[x]) * A(b[x]);
    delta[h * tokens + t] = sum;
  }
};

/// Shapes shared by the team kernels.
template <class ExecSpace, class A>
struct TeamBase {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using Scratch = Kokkos::View<A*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  /// Columns per register block: the inner loops run over kW consecutive elements with kW
  /// independent accumulators (a fixed trip count, so compilers vectorise them at -O2 on the host).
  static constexpr int kW = 8;
  int d_qk = 0;  ///< values per head of Q, K, dQ, dK
  int d_v = 0;   ///< values per head of V, O, dO, dV
  int br = 0, bc = 0, level = 0;
  int ld_qk = 0;  ///< row stride of [rows][d_qk] tiles: d_qk rounded up to kW (padding is zero)
  int ld_v = 0;   ///< row stride of [rows][d_v] tiles: d_v rounded up to kW (padding is zero)
  int ldc = 0;    ///< row stride of [d][keys] and [rows][keys] tiles: bc rounded up to kW
  A scale = 0;

  static constexpr int pad(int n) { return (n + kW - 1) / kW * kW; }
  void set_tiles(int qk_dim, int v_dim, int q_tile, int k_tile) {
    d_qk = qk_dim, d_v = v_dim, br = q_tile, bc = k_tile, ld_qk = pad(qk_dim), ld_v = pad(v_dim), ldc = pad(k_tile);
  }

  /// Carves n elements of team scratch.
  KOKKOS_INLINE_FUNCTION static A* take(const member_type& team, int level, std::int64_t n) {
    return Scratch(team.team_scratch(level), static_cast<std::size_t>(n)).data();
  }
  static std::size_t bytes(std::int64_t n) { return Scratch::shmem_size(static_cast<std::size_t>(n)); }

  /// dst[r * ld + x] = src(row i0 + r, head h)[x] * mul for r < n, x < d; 0 for d <= x < ld (team-wide).
  template <class T>
  KOKKOS_INLINE_FUNCTION void load_rows(const member_type& team, Rows<const T> src, std::int64_t i0, int n, int h,
                                        A mul, int d, int ld, A* dst) const {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
      const T* row = src.row(i0 + r, h);
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld),
                           [&](int x) { dst[r * ld + x] = x < d ? A(row[x]) * mul : A(0); });
    });
  }
  /// dst[x * ldc + c] = src(row j0 + c, head h)[x] for c < n, x < d: a transposed key tile.
  template <class T>
  KOKKOS_INLINE_FUNCTION void load_cols(const member_type& team, Rows<const T> src, std::int64_t j0, int n, int h,
                                        int d, A* dst) const {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int c) {
      const T* row = src.row(j0 + c, h);
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int x) { dst[x * ldc + c] = A(row[x]); });
    });
  }
  /// out[c] = sum_{x < d} a[x] * bt[x * ldc + c] for c in [c0, c1) (one thread's vector lanes), kW
  /// columns at a time (columns of a block outside [c0, c1) are computed from whatever the tile holds
  /// there and not stored).
  KOKKOS_INLINE_FUNCTION void row_times_tile(const member_type& team, const A* a, const A* bt, int d, int c0, int c1,
                                             A* out) const {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, c0 / kW, (c1 + kW - 1) / kW), [&](int g) {
      A s[kW] = {};
      const A* b = bt + g * kW;
      for (int x = 0; x < d; ++x) {
        const A ax = a[x];
        const A* bx = b + x * ldc;
        for (int u = 0; u < kW; ++u) s[u] += ax * bx[u];
      }
      for (int u = 0; u < kW; ++u) {
        const int c = g * kW + u;
        if (c >= c0 && c < c1) out[c] = s[u];
      }
    });
  }
  /// acc[x] += sum_c w[c] * rows[c * ld + x] for c in [c0, c1), x < ld, kW columns of acc in registers.
  KOKKOS_INLINE_FUNCTION void accumulate_rows(const member_type& team, const A* w, const A* rows, int ld, int c0,
                                              int c1, A* acc) const {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld / kW), [&](int g) {
      A a[kW];
      for (int u = 0; u < kW; ++u) a[u] = acc[g * kW + u];
      for (int c = c0; c < c1; ++c) {
        const A wc = w[c];
        const A* src = rows + c * ld + g * kW;
        for (int u = 0; u < kW; ++u) a[u] += wc * src[u];
      }
      for (int u = 0; u < kW; ++u) acc[g * kW + u] = a[u];
    });
  }
};

/// Forward: one team per (query tile, query head); online softmax over the key tiles the tile's rows see.
template <class ExecSpace, class T, class A>
struct ForwardKernel : TeamBase<ExecSpace, A> {
  using Base = TeamBase<ExecSpace, A>;
  using typename Base::member_type;
  Rows<const T> q, k, v;
  Rows<T> o;
  LseRows<A> lse;
  const AttnSlice* slices = nullptr;
  const QTile* tiles = nullptr;
  int heads_q = 0, group = 1;

  // Takes (in operator()'s order): qs [br][ld_qk], acc [br][ld_v], kt [d_qk][ldc], vs [bc][ld_v],
  // sc [br][ldc], m and l [br].
  [[nodiscard]] std::size_t scratch_bytes() const {
    const std::int64_t br = this->br, bc = this->bc, ldc = this->ldc;
    return Base::bytes(br * this->ld_qk) + Base::bytes(br * this->ld_v) + Base::bytes(this->d_qk * ldc) +
           Base::bytes(bc * this->ld_v) + Base::bytes(br * ldc) + Base::bytes(br) * 2;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int d_qk = this->d_qk, d_v = this->d_v, br = this->br, bc = this->bc;
    const int ld_qk = this->ld_qk, ld_v = this->ld_v, ldc = this->ldc;
    const std::int64_t idx = team.league_rank();
    const QTile tile = tiles[idx / heads_q];
    const int h = static_cast<int>(idx % heads_q), hk = h / group;
    const AttnSlice s = slices[tile.slice];
    const int n = static_cast<int>(min64(br, s.q_range.end - s.q_range.begin - tile.row0));
    A* qs = Base::take(team, this->level, std::int64_t{br} * ld_qk);
    A* acc = Base::take(team, this->level, std::int64_t{br} * ld_v);
    A* kt = Base::take(team, this->level, std::int64_t{d_qk} * ldc);
    A* vs = Base::take(team, this->level, std::int64_t{bc} * ld_v);
    A* sc = Base::take(team, this->level, std::int64_t{br} * ldc);
    A* m = Base::take(team, this->level, br);
    A* l = Base::take(team, this->level, br);
    const std::int64_t i0 = s.q_range.begin + tile.row0;
    this->load_rows(team, q, i0, n, h, this->scale, d_qk, ld_qk, qs);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld_v), [&](int x) { acc[r * ld_v + x] = A(0); });
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        m[r] = A(0);
        l[r] = A(0);  // l == 0 marks "no key seen yet"
      });
    });
    std::int64_t klo = 0, khi = 0, unused = 0;
    visible_keys(s, tile.row0, klo, unused);
    visible_keys(s, tile.row0 + n - 1, unused, khi);
    for (std::int64_t kt0 = klo; kt0 < khi; kt0 += bc) {
      const int nk = static_cast<int>(min64(bc, khi - kt0));
      team.team_barrier();  // the previous tile's readers are done
      this->load_cols(team, k, s.k_range.begin + kt0, nk, hk, d_qk, kt);
      this->load_rows(team, v, s.k_range.begin + kt0, nk, hk, A(1), d_v, ld_v, vs);
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
        std::int64_t lo = 0, hi = 0;
        visible_keys(s, tile.row0 + r, lo, hi);
        const int c0 = static_cast<int>(clamp64(lo - kt0, 0, nk)), c1 = static_cast<int>(clamp64(hi - kt0, 0, nk));
        if (c0 >= c1) return;
        A* srow = sc + r * ldc;
        this->row_times_tile(team, qs + r * ld_qk, kt, d_qk, c0, c1, srow);
        A mx = srow[c0];
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, c0, c1), [&](int c, A& mm) { mm = srow[c] > mm ? srow[c] : mm; },
            Kokkos::Max<A>(mx));
        const bool first = l[r] == A(0);
        const A m_new = first || mx > m[r] ? mx : m[r];
        A sum = 0;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, c0, c1),
            [&](int c, A& ss) {
              const A p = exp(srow[c] - m_new);
              srow[c] = p;
              ss += p;
            },
            sum);
        const A alpha = first ? A(0) : exp(m[r] - m_new);
        A* arow = acc + r * ld_v;
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld_v), [&](int x) { arow[x] *= alpha; });
        this->accumulate_rows(team, srow, vs, ld_v, c0, c1, arow);
        Kokkos::single(Kokkos::PerThread(team), [&]() {
          m[r] = m_new;
          l[r] = l[r] * alpha + sum;
        });
      });
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
      if (l[r] == A(0)) return;  // a row that sees no key: O = 0, LSE = -inf from the prefill
      const A inv = A(1) / l[r];
      T* orow = o.row(i0 + r, h);
      const A* arow = acc + r * ld_v;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d_v), [&](int x) { orow[x] = T(arow[x] * inv); });
      Kokkos::single(Kokkos::PerThread(team), [&]() { lse(h, i0 + r) = m[r] + log(l[r]); });
    });
  }
};

/// Inputs of both backward kernels.
template <class ExecSpace, class T, class A>
struct BackwardBase : TeamBase<ExecSpace, A> {
  Rows<const T> q, k, v, dout;
  LseRows<const A> lse;
  const A* delta = nullptr;  ///< [heads_q][q_tokens]
  std::int64_t q_tokens = 0;
  const AttnSlice* slices = nullptr;
  int heads_q = 0, group = 1;

  /// P and dS of rows [0, n) (slice-relative rows b0 + r) against the key tile columns [0, nk) whose
  /// keys are slice-relative kt0 + c: p = exp(s - lse), ds = p (dp - D); masked columns get 0.
  /// qs [rows][ld_qk] and kt [d_qk][ldc] give S; os (dO) [rows][ld_v] and vt [d_v][ldc] give dP.
  KOKKOS_INLINE_FUNCTION void probabilities(const typename TeamBase<ExecSpace, A>::member_type& team,
                                            const AttnSlice& s, std::int64_t b0, int n, std::int64_t kt0, int nk, int h,
                                            const A* qs, const A* os, const A* kt, const A* vt, A* p, A* ds) const {
    const int ldc = this->ldc;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
      std::int64_t lo = 0, hi = 0;
      visible_keys(s, b0 + r, lo, hi);
      const int c0 = static_cast<int>(clamp64(lo - kt0, 0, nk)), c1 = static_cast<int>(clamp64(hi - kt0, 0, nk));
      A* prow = p + r * ldc;
      A* drow = ds + r * ldc;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nk), [&](int c) {
        prow[c] = A(0);
        drow[c] = A(0);
      });
      if (c0 >= c1) return;
      const std::int64_t i = s.q_range.begin + b0 + r;
      const A li = lse(h, i), di = delta[h * q_tokens + i];
      this->row_times_tile(team, qs + r * this->ld_qk, kt, this->d_qk, c0, c1, prow);
      this->row_times_tile(team, os + r * this->ld_v, vt, this->d_v, c0, c1, drow);
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, c0, c1), [&](int c) {
        const A pc = exp(prow[c] - li);
        prow[c] = pc;
        drow[c] = pc * (drow[c] - di);
      });
    });
  }
};

/// dQ: one team per (query tile, query head); dQ += scale * dS K over the key tiles the rows see.
template <class ExecSpace, class T, class A>
struct BackwardQKernel : BackwardBase<ExecSpace, T, A> {
  using Base = TeamBase<ExecSpace, A>;
  using typename Base::member_type;
  Rows<T> dq;
  const QTile* tiles = nullptr;

  // Takes (in operator()'s order): qs [br][ld_qk], os [br][ld_v], acc [br][ld_qk], kt [d_qk][ldc],
  // vt [d_v][ldc], kn [bc][ld_qk], p and ds [br][ldc].
  [[nodiscard]] std::size_t scratch_bytes() const {
    const std::int64_t br = this->br, bc = this->bc, ld_qk = this->ld_qk, ldc = this->ldc;
    return Base::bytes(br * ld_qk) + Base::bytes(br * this->ld_v) + Base::bytes(br * ld_qk) +
           Base::bytes(this->d_qk * ldc) + Base::bytes(this->d_v * ldc) + Base::bytes(bc * ld_qk) +
           Base::bytes(br * ldc) * 2;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int d_qk = this->d_qk, d_v = this->d_v, br = this->br, bc = this->bc;
    const int ld_qk = this->ld_qk, ld_v = this->ld_v, ldc = this->ldc;
    const std::int64_t idx = team.league_rank();
    const QTile tile = tiles[idx / this->heads_q];
    const int h = static_cast<int>(idx % this->heads_q), hk = h / this->group;
    const AttnSlice s = this->slices[tile.slice];
    const int n = static_cast<int>(min64(br, s.q_range.end - s.q_range.begin - tile.row0));
    A* qs = Base::take(team, this->level, std::int64_t{br} * ld_qk);
    A* os = Base::take(team, this->level, std::int64_t{br} * ld_v);
    A* acc = Base::take(team, this->level, std::int64_t{br} * ld_qk);
    A* kt = Base::take(team, this->level, std::int64_t{d_qk} * ldc);
    A* vt = Base::take(team, this->level, std::int64_t{d_v} * ldc);
    A* kn = Base::take(team, this->level, std::int64_t{bc} * ld_qk);
    A* p = Base::take(team, this->level, std::int64_t{br} * ldc);
    A* ds = Base::take(team, this->level, std::int64_t{br} * ldc);
    const std::int64_t i0 = s.q_range.begin + tile.row0;
    this->load_rows(team, this->q, i0, n, h, this->scale, d_qk, ld_qk, qs);
    this->load_rows(team, this->dout, i0, n, h, A(1), d_v, ld_v, os);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld_qk), [&](int x) { acc[r * ld_qk + x] = A(0); });
    });
    std::int64_t klo = 0, khi = 0, unused = 0;
    visible_keys(s, tile.row0, klo, unused);
    visible_keys(s, tile.row0 + n - 1, unused, khi);
    for (std::int64_t kt0 = klo; kt0 < khi; kt0 += bc) {
      const int nk = static_cast<int>(min64(bc, khi - kt0));
      team.team_barrier();
      this->load_cols(team, this->k, s.k_range.begin + kt0, nk, hk, d_qk, kt);
      this->load_cols(team, this->v, s.k_range.begin + kt0, nk, hk, d_v, vt);
      this->load_rows(team, this->k, s.k_range.begin + kt0, nk, hk, A(1), d_qk, ld_qk, kn);
      team.team_barrier();
      this->probabilities(team, s, tile.row0, n, kt0, nk, h, qs, os, kt, vt, p, ds);
      // Each thread reads back only its own rows of dS: no barrier between the two loops. Only the keys
      // row r sees are summed (masked keys are skipped, not multiplied by a zero dS: 0 * Inf is NaN).
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
        std::int64_t lo = 0, hi = 0;
        visible_keys(s, tile.row0 + r, lo, hi);
        const int c0 = static_cast<int>(clamp64(lo - kt0, 0, nk)), c1 = static_cast<int>(clamp64(hi - kt0, 0, nk));
        if (c0 < c1) this->accumulate_rows(team, ds + r * ldc, kn, ld_qk, c0, c1, acc + r * ld_qk);
      });
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int r) {
      T* row = dq.row(i0 + r, h);
      const A* arow = acc + r * ld_qk;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d_qk),
                           [&](int x) { row[x] = T(A(row[x]) + arow[x] * this->scale); });
    });
  }
};

/// dK, dV: one team per (key tile of the KV buffer, KV head); walks every query head of the group and
/// every slice that reads the tile, query blocks of q_tile rows at a time. No atomics: each key row
/// has one owner, and the order of accumulation is fixed (bit-reproducible).
template <class ExecSpace, class T, class A>
struct BackwardKVKernel : BackwardBase<ExecSpace, T, A> {
  using Base = TeamBase<ExecSpace, A>;
  using typename Base::member_type;
  Rows<T> dk, dv;
  std::int64_t n_slices = 0, k_tokens = 0;
  int heads_kv = 0;

  // Takes (in operator()'s order): kt [d_qk][ldc], vt [d_v][ldc], dka [bc][ld_qk], dva [bc][ld_v],
  // qs [br][ld_qk], os [br][ld_v], p and ds [br][ldc].
  [[nodiscard]] std::size_t scratch_bytes() const {
    const std::int64_t br = this->br, bc = this->bc, ld_qk = this->ld_qk, ld_v = this->ld_v, ldc = this->ldc;
    return Base::bytes(this->d_qk * ldc) + Base::bytes(this->d_v * ldc) + Base::bytes(bc * ld_qk) +
           Base::bytes(bc * ld_v) + Base::bytes(br * ld_qk) + Base::bytes(br * ld_v) + Base::bytes(br * ldc) * 2;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int d_qk = this->d_qk, d_v = this->d_v, br = this->br, bc = this->bc;
    const int ld_qk = this->ld_qk, ld_v = this->ld_v, ldc = this->ldc;
    const std::int64_t idx = team.league_rank();
    const int hk = static_cast<int>(idx % heads_kv);
    const std::int64_t j0 = idx / heads_kv * bc;
    const int nk = static_cast<int>(min64(bc, k_tokens - j0));
    A* kt = Base::take(team, this->level, std::int64_t{d_qk} * ldc);
    A* vt = Base::take(team, this->level, std::int64_t{d_v} * ldc);
    A* dka = Base::take(team, this->level, std::int64_t{bc} * ld_qk);
    A* dva = Base::take(team, this->level, std::int64_t{bc} * ld_v);
    A* qs = Base::take(team, this->level, std::int64_t{br} * ld_qk);
    A* os = Base::take(team, this->level, std::int64_t{br} * ld_v);
    A* p = Base::take(team, this->level, std::int64_t{br} * ldc);
    A* ds = Base::take(team, this->level, std::int64_t{br} * ldc);
    this->load_cols(team, this->k, j0, nk, hk, d_qk, kt);
    this->load_cols(team, this->v, j0, nk, hk, d_v, vt);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](int c) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld_qk), [&](int x) { dka[c * ld_qk + x] = A(0); });
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, ld_v), [&](int x) { dva[c * ld_v + x] = A(0); });
    });
    for (int hh = 0; hh < this->group; ++hh) {
      const int h = hk * this->group + hh;
      for (std::int64_t si = 0; si < n_slices; ++si) {
        const AttnSlice s = this->slices[si];
        const std::int64_t ks = s.k_range.begin;
        const std::int64_t a = max64(ks, j0), b = min64(s.k_range.end, j0 + nk);
        if (a >= b || s.q_range.end <= s.q_range.begin) continue;
        std::int64_t rlo = 0, rhi = 0;
        rows_seeing(s, a - ks, b - ks, rlo, rhi);
        for (std::int64_t b0 = rlo; b0 < rhi; b0 += br) {
          const int nb = static_cast<int>(min64(br, rhi - b0));
          team.team_barrier();  // the previous block's readers are done
          this->load_rows(team, this->q, s.q_range.begin + b0, nb, h, this->scale, d_qk, ld_qk, qs);
          this->load_rows(team, this->dout, s.q_range.begin + b0, nb, h, A(1), d_v, ld_v, os);
          team.team_barrier();
          // Tile column c is slice-relative key j0 + c - ks; columns outside the slice come out masked.
          this->probabilities(team, s, b0, nb, j0 - ks, nk, h, qs, os, kt, vt, p, ds);
          team.team_barrier();
          // dV += P^T dO, dK += dS^T (scale Q): thread per key row, over only the block's rows that see
          // the key. Keys of the tile outside the slice (another document, or another sequence of a
          // ring) and rows the mask hides are skipped, never multiplied by a zero P or dS: a NaN or
          // infinity in those rows' q or dout would otherwise reach this key's dK and dV (0 * Inf).
          // kW columns of the key row's dV or dK stay in registers across the block's rows: the vector
          // lanes take the ld_v / kW column groups of dV (weights P, rows of dO) and then the ld_qk / kW
          // groups of dK (weights dS, rows of scale Q), as the two head sizes may differ.
          constexpr int kW = Base::kW;
          const int groups_v = ld_v / kW, groups = groups_v + ld_qk / kW;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](int c) {
            const std::int64_t kc = j0 + c - ks;  // slice-relative key
            if (kc < 0 || kc >= s.k_range.end - ks) return;
            std::int64_t lo = 0, hi = 0;
            rows_seeing(s, kc, kc + 1, lo, hi);
            const int r0 = static_cast<int>(clamp64(lo - b0, 0, nb)), r1 = static_cast<int>(clamp64(hi - b0, 0, nb));
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, groups), [&](int g) {
              const bool value = g < groups_v;
              const A* weight = value ? p : ds;  // column c of P (dV) or dS (dK)
              const int ld = value ? ld_v : ld_qk;
              const int col = (value ? g : g - groups_v) * kW;
              const A* src = (value ? os : qs) + col;
              A* dst = (value ? dva + c * ld_v : dka + c * ld_qk) + col;
              A acc[kW];
              for (int u = 0; u < kW; ++u) acc[u] = dst[u];
              for (int r = r0; r < r1; ++r) {
                const A w = weight[r * ldc + c];
                const A* row = src + r * ld;
                for (int u = 0; u < kW; ++u) acc[u] += w * row[u];
              }
              for (int u = 0; u < kW; ++u) dst[u] = acc[u];
            });
          });
        }
      }
    }
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](int c) {
      T* krow = dk.row(j0 + c, hk);
      T* vrow = dv.row(j0 + c, hk);
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d_qk),
                           [&](int x) { krow[x] = T(A(krow[x]) + dka[c * ld_qk + x]); });
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d_v),
                           [&](int x) { vrow[x] = T(A(vrow[x]) + dva[c * ld_v + x]); });
    });
  }
};

}  // namespace seqpar::kokkos::detail
