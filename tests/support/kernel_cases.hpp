// SPDX-License-Identifier: Apache-2.0
// Kernel conformance cases, written once and run on every attention kernel (CUTLASS's one testbed for
// every GEMM): CpuFlash and Reference in tests/attention, KokkosFlash in tests/kokkos, CudaFlash in
// tests/cuda/test_cuda_kernel_cases.cpp. Each case runs forward and backward and compares with the fp64
// attention::Reference<double> on the same (rounded) inputs, at a tolerance the caller gives per value
// type: max |got - want| / max(1, max |want|), a NaN or a misplaced infinity being an infinite error.
//
// A kernel reaches its memory space through a small harness H (HostHarness below for host kernels):
//   H::kernel_type, H::value_type, H::accum_type;
//   H::Thd<U>(tokens, heads, head_dim, pad_heads): a THD tensor in the kernel's memory (a heads slice of
//     a tensor `pad_heads` heads wider when pad_heads > 0), with view(), write(ThdTensor<double>) (rounds to
//     U) and read() -> ThdTensor<double>;
//   H::Lse(heads, tokens): the same for an LSE buffer of accum_type;
//   H::Slices(host slices, q_rows, k_rows): the slice list where the kernel reads it, span();
//   H::Bytes(n): scratch in the kernel's memory, span();
//   H::adapt(shape): the shape the kernel runs for a case's shape (CudaFlash: head_dim 64 or 128);
//   H::finish(kernel): waits for the kernel's work (a stream synchronize on a GPU);
//   H::kRefusesAliasing: whether the kernel checks that outputs share no memory with other views.
#pragma once

#include <doctest/doctest.h>

#include <seqpar/attention/reference.hpp>
#include <seqpar/core/attention_shape.hpp>
#include <seqpar/core/attn_slice.hpp>
#include <seqpar/core/document_batch.hpp>
#include <seqpar/core/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace seqpar::test::kernel_cases {

/// Largest error allowed, relative to the output's scale (max(1, max |reference|)).
struct Tolerance {
  double forward = 0, backward = 0;
};

struct Case {
  std::string name;
  AttentionShape shape;  ///< the head_dim a case asks for; the harness may adapt it
  std::int64_t q_rows = 0, k_rows = 0;
  std::vector<AttnSlice> slices;
  bool strided = false;  ///< views are heads slices of a tensor 3 heads wider
  /// Key magnitudes ramp along the buffer: k(t) *= 1 + ramp * t (ramp > 0: every later key tile holds larger
  /// scores, so an online softmax's running max moves tile after tile) or 1 + |ramp| * (k_rows - 1 - t)
  /// (ramp < 0: the first tile dominates and the max never moves again).
  double k_ramp = 0.0;
};

inline std::vector<AttnSlice> documents(const std::vector<std::int64_t>& lengths, Mask mask) {
  std::vector<AttnSlice> s;
  std::int64_t at = 0;
  for (std::int64_t len : lengths) {
    s.push_back({{at, at + len}, {at, at + len}, mask});
    at += len;
  }
  return s;
}

/// Every mask kind (full, causal with positive and negative offsets, sliding windows of 1 and more, with
/// offsets), MHA / GQA / MQA, odd lengths and head dims, one-token documents, documents across key
/// tiles, rows no slice covers, slices sharing keys, an empty key range, an empty slice, unsorted query
/// ranges, strided views, and key norms that move (or never move) the online softmax's running max.
inline std::vector<Case> cases() {
  const auto one = [](std::int64_t q, std::int64_t k, Mask m) { return std::vector<AttnSlice>{{{0, q}, {0, k}, m}}; };
  std::vector<Case> cs;
  cs.push_back({"length 1 causal", {2, 2, 64}, 1, 1, one(1, 1, Mask::causal())});
  cs.push_back({"length 1 full, MQA, d128", {2, 1, 128}, 1, 1, one(1, 1, Mask::full())});
  cs.push_back({"length 7 causal", {2, 2, 64}, 7, 7, one(7, 7, Mask::causal())});
  cs.push_back({"length 7 full d40 MQA 4:1", {4, 1, 40}, 7, 7, one(7, 7, Mask::full())});
  cs.push_back({"full 37x53 d24", {2, 2, 24}, 37, 53, one(37, 53, Mask::full())});
  cs.push_back({"full 37x53 d12 GQA 3:1", {3, 1, 12}, 37, 53, one(37, 53, Mask::full())});
  cs.push_back({"causal d20 45 rows", {2, 1, 20}, 45, 45, one(45, 45, Mask::causal())});
  cs.push_back({"causal 101 d64", {2, 2, 64}, 101, 101, one(101, 101, Mask::causal())});
  cs.push_back({"causal offset +16 (queries after their keys)", {2, 1, 64}, 37, 53, one(37, 53, Mask::causal(16))});
  cs.push_back({"causal offset -5 (rows that see nothing)", {2, 2, 64}, 37, 53, one(37, 53, Mask::causal(-5))});
  cs.push_back({"causal offset -20 (first 20 rows masked)", {2, 2, 64}, 150, 150, one(150, 150, Mask::causal(-20))});
  cs.push_back({"sliding window 1", {2, 2, 16}, 33, 33, one(33, 33, Mask::sliding_window(1))});
  cs.push_back({"sliding window 9, offset 16", {8, 2, 40}, 70, 86, one(70, 86, Mask::sliding_window(9, 16))});
  cs.push_back({"sliding window 100, d128 GQA 4:1", {4, 1, 128}, 130, 130, one(130, 130, Mask::sliding_window(100))});
  cs.push_back({"GQA 8:2 causal d128", {8, 2, 128}, 150, 150, one(150, 150, Mask::causal())});
  cs.push_back({"GQA 6:2 causal, odd length 77", {6, 2, 16}, 77, 77, one(77, 77, Mask::causal())});
  cs.push_back({"document causal", {4, 2, 64}, 111, 111, documents({1, 5, 1, 70, 33, 1}, Mask::causal())});
  cs.push_back({"document sliding 7", {2, 1, 16}, 111, 111, documents({40, 1, 63, 7}, Mask::sliding_window(7))});
  cs.push_back({"documents of length 1",
                {2, 2, 64},
                40,
                40,
                DocumentBatch({std::vector<std::int64_t>(40, 1)}).document_causal_slices()});
  cs.push_back({"strided heads_slice", {4, 2, 40}, 90, 90, documents({17, 73}, Mask::causal()), true});
  // Documents across several 128-key tiles: starts and ends at, just before and just after tile edges
  // (127, 128, 129, 256), a document longer than a tile inside one, and one-token documents between them.
  cs.push_back({"document causal across key tiles",
                {4, 2, 48},
                700,
                700,
                documents({127, 1, 128, 129, 1, 214, 100}, Mask::causal())});
  cs.push_back({"sliding window 140 across key tiles, GQA 6:2",
                {6, 2, 40},
                520,
                520,
                documents({3, 389, 128}, Mask::sliding_window(140))});
  {  // rows in no slice, slices sharing keys, an empty slice, unsorted query ranges
    Case c{"gaps, shared keys, empty and unsorted slices", {2, 1, 64}, 80, 70, {}};
    c.slices = {{{30, 60}, {10, 70}, Mask::causal(30)},
                {{0, 20}, {0, 70}, Mask::causal(10)},
                {{20, 20}, {0, 70}, Mask::full()},
                {{65, 78}, {5, 40}, Mask::full()}};
    cs.push_back(c);
  }
  cs.push_back({"rows in no slice and an empty key range",
                {2, 2, 64},
                200,
                200,
                {{{10, 60}, {0, 60}, Mask::causal(-10)}, {{90, 120}, {150, 150}, Mask::causal()}}});
  cs.push_back({"two query slices reading the same keys",
                {2, 2, 64},
                200,
                100,
                {{{0, 90}, {0, 100}, Mask::full()}, {{100, 200}, {0, 100}, Mask::causal(-5)}}});
  // Log2-domain scores growing by ~0.3 per key: a lazily rescaled running max moves past its threshold
  // again and again; and the mirror case, where it never moves after the first tile.
  cs.push_back({"causal, key norms ramping up", {2, 1, 64}, 300, 300, one(300, 300, Mask::causal()), false, 0.05});
  cs.push_back({"causal, key norms ramping down", {2, 1, 64}, 300, 300, one(300, 300, Mask::causal()), false, -0.05});
  return cs;
}

/// Unequal query/key and value head sizes (AttentionShape::head_dim_v; MLA: 192/128, 576/512 absorbed), for
/// the kernels that run any pair (CpuFlash, KokkosFlash; CudaFlash, and CudnnSdpa on sm_90+, run 192/128 only,
/// through a harness at that pair; the others refuse such shapes by name): d_v smaller and larger than d_qk, widths off
/// the 16-value panels, GQA, causal, windows and documents across key tiles.
inline std::vector<Case> head_size_cases() {
  const auto one = [](std::int64_t q, std::int64_t k, Mask m) { return std::vector<AttnSlice>{{{0, q}, {0, k}, m}}; };
  const auto shape = [](int hq, int hkv, int d, int d_v) {
    AttentionShape s{hq, hkv, d};
    s.head_dim_v = d_v;
    return s;
  };
  std::vector<Case> cs;
  cs.push_back({"MLA 192/128 causal, GQA 4:2", shape(4, 2, 192, 128), 150, 150, one(150, 150, Mask::causal())});
  cs.push_back(
      {"MLA absorbed 576/512 documents", shape(2, 1, 576, 512), 140, 140, documents({1, 60, 79}, Mask::causal())});
  cs.push_back({"24/16 full 37x53", shape(2, 2, 24, 16), 37, 53, one(37, 53, Mask::full())});
  cs.push_back({"16/40 (d_v > d_qk) sliding window 9, offset 16", shape(4, 2, 16, 40), 70, 86,
                one(70, 86, Mask::sliding_window(9, 16))});
  cs.push_back({"20/12 documents across key tiles, strided", shape(4, 2, 20, 12), 400, 400,
                documents({127, 1, 129, 143}, Mask::causal()), true});
  cs.push_back({"8/1 MQA causal offset -5", shape(3, 1, 8, 1), 37, 53, one(37, 53, Mask::causal(-5))});
  return cs;
}

/// Every case of head_size_cases() on `kernel`; returns how many were checked.
template <class H>
std::size_t run_head_size_cases(typename H::kernel_type& kernel, Tolerance tol) {
  std::size_t checked = 0;
  for (const Case& c : head_size_cases()) checked += check_case<H>(c, kernel, tol) ? 1 : 0;
  return checked;
}

/// Longer cases, run with one kernel configuration (a prefix of the list where a kernel is slow: the fp64
/// reference alone costs O(pairs x d)): 1111 tokens (odd, many tiles) causal and in documents, full, and
/// two packed sequences of documents up to 1000 tokens.
inline std::vector<Case> long_cases() {
  std::vector<Case> cs;
  cs.push_back({"1111 causal GQA 2:1", {2, 1, 64}, 1111, 1111, {{{0, 1111}, {0, 1111}, Mask::causal()}}});
  cs.push_back({"1111 document causal d40, strided",
                {2, 2, 40},
                1111,
                1111,
                documents({1, 300, 1, 500, 2, 307}, Mask::causal()),
                true});
  cs.push_back({"1111 full MQA", {2, 1, 64}, 1111, 1111, {{{0, 1111}, {0, 1111}, Mask::full()}}});
  const DocumentBatch mix({{300, 1, 7, 700, 64, 65}, {129, 1, 1000}});
  cs.push_back({"packed documents, two sequences",
                {2, 1, 64},
                mix.total_tokens(),
                mix.total_tokens(),
                mix.document_causal_slices()});
  return cs;
}

// ---- comparisons ---------------------------------------------------------------------------------------

/// max |got - want| / max(1, max |want|) over the finite reference values; a NaN, or an infinity where the
/// reference has another value, is an infinite error.
inline double relative_error(std::span<const double> got, std::span<const double> want) {
  double e = 0, scale = 1;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i]) || std::isinf(got[i]) || std::isinf(want[i])) {
      if (!(got[i] == want[i])) return INFINITY;
      continue;
    }
    scale = std::max(scale, std::abs(want[i]));
    e = std::max(e, std::abs(got[i] - want[i]));
  }
  return e / scale;
}

/// Rows the reference leaves empty (LSE = -inf on a head) have O = 0 and LSE = -inf exactly; the other
/// rows' LSE within `tol` of the reference, relative to max(1, |lse|).
inline void check_lse_and_empty_rows(const ThdTensor<double>& o, const LseTensor<double>& lse,
                                     const LseTensor<double>& lse_ref, double tol) {
  int empty = 0, bad_o = 0, bad_lse = 0;
  double lse_err = 0;
  for (int h = 0; h < lse_ref.heads; ++h)
    for (std::int64_t t = 0; t < lse_ref.tokens; ++t) {
      const double want = lse_ref.view()(h, t), got = lse.view()(h, t);
      if (std::isinf(want)) {
        ++empty;
        bad_lse += got == -std::numeric_limits<double>::infinity() ? 0 : 1;
        for (int x = 0; x < o.head_dim; ++x) bad_o += o.view()(t, h, x) == 0.0 ? 0 : 1;
      } else {
        lse_err =
            std::isfinite(got) ? std::max(lse_err, std::abs(got - want) / std::max(1.0, std::abs(want))) : INFINITY;
      }
    }
  CAPTURE(empty);
  CHECK_MESSAGE(bad_lse == 0, bad_lse << " empty rows without LSE = -inf");
  CHECK_MESSAGE(bad_o == 0, bad_o << " elements of empty rows with O != 0");
  CHECK(lse_err <= tol);
}

/// (tokens, heads, d) values drawn from N(offset, scale^2).
inline ThdTensor<double> normal_tensor(std::int64_t tokens, int heads, int d, std::mt19937_64& rng, double offset = 0,
                                       double scale = 1) {
  std::normal_distribution<double> dist(offset, scale);
  ThdTensor<double> t(tokens, heads, d);
  for (double& x : t.storage) x = dist(rng);
  return t;
}

/// Writes `values` into `buf` and returns what the kernel sees (the values rounded to the storage type).
template <class Buf>
ThdTensor<double> put(Buf& buf, const ThdTensor<double>& values) {
  buf.write(values);
  return buf.read();
}

// ---- one case ------------------------------------------------------------------------------------------

/// Forward and backward of `c` on `kernel` against the fp64 reference: O (pre-filled with garbage, so
/// every row must be written), LSE, empty rows exactly O = 0 and LSE = -inf; dQ, dK, dV accumulated (+=)
/// onto non-zero values, compared with the reference backward from the kernel's own O. False when the
/// harness skips the case (H::supports), true when it was checked.
template <class H>
bool check_case(const Case& c, typename H::kernel_type& kernel, Tolerance tol) {
  using T = typename H::value_type;
  using A = typename H::accum_type;
  using Thd = typename H::template Thd<T>;
  CAPTURE(c.name);
  // A harness whose kernel refuses a class of slice tables by design (CudnnSdpa: a sliding window cut
  // by its slice's last key) names the cases it skips; every other case must pass.
  if constexpr (requires { H::supports(c); }) {
    if (!H::supports(c)) {
      MESSAGE("skipped by the harness (the kernel refuses these slices by design): " << c.name);
      return false;
    }
  }
  const AttentionShape shape = H::adapt(c.shape);
  CAPTURE(shape.head_dim);
  CAPTURE(shape.head_dim_v);
  // d: q, k, dq, dk; d_v: v, dout, o, dv (equal unless the case sets head_dim_v)
  const int hq = shape.heads_q, hkv = shape.heads_kv, d = shape.qk_dim(), d_v = shape.v_dim(), pad = c.strided ? 3 : 0;
  std::mt19937_64 rng(1234);
  Thd q(c.q_rows, hq, d, pad), k(c.k_rows, hkv, d, pad), v(c.k_rows, hkv, d_v, pad), dout(c.q_rows, hq, d_v, pad);
  const auto qd = put(q, normal_tensor(c.q_rows, hq, d, rng));
  auto kn = normal_tensor(c.k_rows, hkv, d, rng);
  if (c.k_ramp != 0.0)
    for (std::int64_t t = 0; t < c.k_rows; ++t) {
      const double f = c.k_ramp > 0 ? 1 + c.k_ramp * double(t) : 1 - c.k_ramp * double(c.k_rows - 1 - t);
      for (int h = 0; h < hkv; ++h)
        for (int x = 0; x < d; ++x) kn.view()(t, h, x) *= f;
    }
  const auto kd = put(k, kn);
  const auto vd = put(v, normal_tensor(c.k_rows, hkv, d_v, rng));
  const auto dod = put(dout, normal_tensor(c.q_rows, hq, d_v, rng));

  ThdTensor<double> o_ref(c.q_rows, hq, d_v);
  LseTensor<double> lse_ref(hq, c.q_rows);
  const attention::Reference<double> ref;
  ref.forward(shape, qd.view(), kd.view(), vd.view(), c.slices, o_ref.view(), lse_ref.view());

  const typename H::Slices slices(c.slices, c.q_rows, c.k_rows);
  typename H::Bytes ws(kernel.workspace_bytes(shape, c.q_rows, c.k_rows));
  Thd o(c.q_rows, hq, d_v, pad);
  o.write(normal_tensor(c.q_rows, hq, d_v, rng, 3.0));  // garbage: the forward writes every row
  typename H::Lse lse(hq, c.q_rows);
  LseTensor<double> sevens(hq, c.q_rows);
  std::fill(sevens.storage.begin(), sevens.storage.end(), 7.0);
  lse.write(sevens);
  kernel.forward(shape, q.view(), k.view(), v.view(), slices.span(), o.view(), lse.view(), ws.span());
  H::finish(kernel);
  const ThdTensor<double> o_got = o.read();
  CHECK(relative_error(o_got.storage, o_ref.storage) <= tol.forward);
  check_lse_and_empty_rows(o_got, lse.read(), lse_ref, tol.forward);

  // The backward adds onto what dQ, dK, dV hold; the reference starts from the same values, and reads the
  // kernel's own O (as training does: rounded to T) with the reference LSE.
  Thd dq(c.q_rows, hq, d, pad), dk(c.k_rows, hkv, d, pad), dv(c.k_rows, hkv, d_v, pad);
  auto dq_ref = put(dq, normal_tensor(c.q_rows, hq, d, rng, 0.0, 0.5));
  auto dk_ref = put(dk, normal_tensor(c.k_rows, hkv, d, rng, 0.0, 0.5));
  auto dv_ref = put(dv, normal_tensor(c.k_rows, hkv, d_v, rng, 0.0, 0.5));
  kernel.backward(shape, q.view(), k.view(), v.view(), o.view(), LseView<const A>(lse.view()), dout.view(),
                  slices.span(), dq.view(), dk.view(), dv.view(), ws.span());
  H::finish(kernel);
  ref.backward(shape, qd.view(), kd.view(), vd.view(), o_got.view(), lse_ref.view(), dod.view(), c.slices,
               dq_ref.view(), dk_ref.view(), dv_ref.view());
  CHECK(relative_error(dq.read().storage, dq_ref.storage) <= tol.backward);
  CHECK(relative_error(dk.read().storage, dk_ref.storage) <= tol.backward);
  CHECK(relative_error(dv.read().storage, dv_ref.storage) <= tol.backward);
  return true;
}

/// Every case of cases() on `kernel` (run it on each configuration worth testing: tile sizes, threads).
/// Returns how many were checked (not skipped by the harness): callers assert it, so that a harness
/// that skips everything cannot pass.
template <class H>
std::size_t run_cases(typename H::kernel_type& kernel, Tolerance tol) {
  std::size_t checked = 0;
  for (const Case& c : cases()) checked += check_case<H>(c, kernel, tol) ? 1 : 0;
  return checked;
}

/// The first `count` cases of long_cases() on `kernel` (one configuration is enough); returns how many
/// were checked.
template <class H>
std::size_t run_long_cases(typename H::kernel_type& kernel, Tolerance tol, std::size_t count = 4) {
  const std::vector<Case> cs = long_cases();
  std::size_t checked = 0;
  for (std::size_t i = 0; i < std::min(count, cs.size()); ++i) checked += check_case<H>(cs[i], kernel, tol) ? 1 : 0;
  return checked;
}

// ---- non-finite isolation ------------------------------------------------------------------------------

/// What a NaN or infinity planted at one token may reach.
enum class Isolation {
  kDocument,  ///< only outputs of its own document: other documents' outputs are bit-for-bit the clean ones
  kMask,      ///< only the rows and keys that read it under the mask (its document's other rows stay clean too)
  /// CudnnSdpa's contract (issue 38, A1): kDocument, and also the outputs of a document whose tiles, of
  /// `tile_rows` rows from its first row, cover the planted token (cuDNN loads whole tiles from an item's
  /// ragged offset; P = 0 times NaN is NaN inside its MMA).
  kDocumentOrTile,
};

/// Four documents packed in one buffer (key tiles straddle their boundaries), masks causal, causal, sliding
/// window and full; a NaN or -infinity planted at one token of q, k, v or dout must leave every output and
/// gradient that cannot depend on it (under `level`) bit-for-bit as in the clean run, and finite; a NaN in
/// q shows in its own row's O (not hidden). Planted tokens, the first `positions` of: a document's first and
/// last tokens (a key a neighbouring document's rows must not read, even with weight 0), the first token of
/// the full-mask document, then tokens mid-tile in a causal and in the sliding-window document.
template <class H>
void check_nonfinite_isolation(typename H::kernel_type& kernel, Isolation level, int positions = 6,
                               std::int64_t tile_rows = 128) {
  using T = typename H::value_type;
  using A = typename H::accum_type;
  using Thd = typename H::template Thd<T>;
  const AttentionShape shape = H::adapt({4, 2, 40});
  const int d = shape.qk_dim(), d_v = shape.v_dim();  // d: q, k, dq, dk; d_v: v, dout, o, dv
  std::vector<AttnSlice> slices;
  const std::vector<std::pair<std::int64_t, Mask>> docs{
      {100, Mask::causal()}, {150, Mask::causal()}, {90, Mask::sliding_window(33)}, {60, Mask::full()}};
  std::int64_t n = 0;
  for (const auto& [len, m] : docs) {
    slices.push_back({{n, n + len}, {n, n + len}, m});
    n += len;
  }
  std::mt19937_64 rng(99);
  const ThdTensor<double> q0 = normal_tensor(n, 4, d, rng), k0 = normal_tensor(n, 2, d, rng),
                          v0 = normal_tensor(n, 2, d_v, rng), do0 = normal_tensor(n, 4, d_v, rng);
  const typename H::Slices dev_slices(slices, n, n);
  typename H::Bytes ws(kernel.workspace_bytes(shape, n, n));
  struct Outputs {
    ThdTensor<double> o, dq, dk, dv;
    LseTensor<double> lse;
  };
  const auto run = [&](const ThdTensor<double>& qv, const ThdTensor<double>& kv, const ThdTensor<double>& vv,
                       const ThdTensor<double>& dov) {
    Thd q(n, 4, d, 0), k(n, 2, d, 0), v(n, 2, d_v, 0), dout(n, 4, d_v, 0), o(n, 4, d_v, 0), dq(n, 4, d, 0),
        dk(n, 2, d, 0), dv(n, 2, d_v, 0);
    q.write(qv), k.write(kv), v.write(vv), dout.write(dov);
    const ThdTensor<double> zq(n, 4, d), zk(n, 2, d), zv(n, 2, d_v);
    dq.write(zq), dk.write(zk), dv.write(zv);
    typename H::Lse lse(4, n);
    kernel.forward(shape, q.view(), k.view(), v.view(), dev_slices.span(), o.view(), lse.view(), ws.span());
    kernel.backward(shape, q.view(), k.view(), v.view(), o.view(), LseView<const A>(lse.view()), dout.view(),
                    dev_slices.span(), dq.view(), dk.view(), dv.view(), ws.span());
    H::finish(kernel);
    return Outputs{o.read(), dq.read(), dk.read(), dv.read(), lse.read()};
  };
  const Outputs clean = run(q0, k0, v0, do0);

  const auto doc_of = [&](std::int64_t t) {
    for (std::size_t s = 0; s < slices.size(); ++s)
      if (slices[s].q_range.contains(t)) return s;
    return slices.size();
  };
  // Does query token i see key token j (same document, visible under its mask)?
  const auto sees = [&](std::int64_t i, std::int64_t j) {
    const std::size_t s = doc_of(i);
    if (s != doc_of(j)) return false;
    const AttnSlice& sl = slices[s];
    return sl.mask.visible_keys(i - sl.q_range.begin, sl.k_range.size()).contains(j - sl.k_range.begin);
  };
  // Rows t of a and b (every head) are bit-identical and finite.
  const auto same_rows = [](const ThdTensor<double>& a, const ThdTensor<double>& b, std::int64_t t) {
    for (int h = 0; h < a.heads; ++h)
      for (int x = 0; x < a.head_dim; ++x) {
        const double u = a.view()(t, h, x), w = b.view()(t, h, x);
        if (!(std::isfinite(u) && std::memcmp(&u, &w, sizeof u) == 0)) return false;
      }
    return true;
  };
  const double bad_values[] = {std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::infinity()};
  const std::string names[] = {"q", "k", "v", "dout"};
  std::vector<std::int64_t> planted{100, 249, 340, 130, 300, 370};
  planted.resize(static_cast<std::size_t>(std::clamp(positions, 1, 6)));
  int checked = 0;
  for (std::int64_t at : planted)
    for (int which = 0; which < 4; ++which)
      for (double bad : bad_values) {
        CAPTURE(names[which]);
        CAPTURE(at);
        CAPTURE(bad);
        ThdTensor<double> qb = q0, kb = k0, vb = v0, db = do0;
        ThdTensor<double>* tgt[] = {&qb, &kb, &vb, &db};
        tgt[which]->view()(at, 0, 3) = bad;
        const Outputs got = run(qb, kb, vb, db);
        if (which == 0 && std::isnan(bad)) CHECK(std::isnan(got.o.view()(at, 0, 0)));  // not hidden
        int leaks = 0;
        for (std::int64_t t = 0; t < n; ++t) {
          // Which outputs of token t may depend on the planted value?
          bool o_dep = false, dq_dep = false, kv_dep = false;
          if (level == Isolation::kDocument) {
            o_dep = dq_dep = kv_dep = doc_of(t) == doc_of(at);
          } else if (level == Isolation::kDocumentOrTile) {
            const Range doc = slices[doc_of(t)].q_range;
            const std::int64_t tiles_end = doc.begin + (doc.size() + tile_rows - 1) / tile_rows * tile_rows;
            o_dep = dq_dep = kv_dep = doc_of(t) == doc_of(at) || (at >= doc.begin && at < tiles_end);
          } else if (which == 0) {  // q[at]: row at, and the keys it sees
            o_dep = dq_dep = t == at;
            kv_dep = sees(at, t);
          } else if (which == 3) {  // dout[at]: dq of row at, dk/dv of the keys it sees
            dq_dep = t == at;
            kv_dep = sees(at, t);
          } else {  // k or v at key `at`: rows that see it; their gradients reach every key those rows see
            o_dep = dq_dep = sees(t, at);
            for (std::int64_t i = 0; i < n && !kv_dep; ++i) kv_dep = sees(i, at) && sees(i, t);
          }
          std::string changed;  // the outputs of token t that moved although they cannot depend on the value
          if (!o_dep) {
            bool same_lse = true;
            for (int h = 0; h < 4; ++h) {
              const double a = got.lse.view()(h, t), b = clean.lse.view()(h, t);
              same_lse = same_lse && std::memcmp(&a, &b, sizeof a) == 0;
            }
            if (!same_rows(got.o, clean.o, t)) changed += " o";
            if (!same_lse) changed += " lse";
          }
          if (!dq_dep && !same_rows(got.dq, clean.dq, t)) changed += " dq";
          if (!kv_dep && !same_rows(got.dk, clean.dk, t)) changed += " dk";
          if (!kv_dep && !same_rows(got.dv, clean.dv, t)) changed += " dv";
          if (!changed.empty() && leaks++ < 3) FAIL_CHECK("token " << t << ":" << changed << " changed");
          checked += o_dep ? 0 : 1;
        }
        CHECK(leaks == 0);
      }
  CHECK(checked > 0);
}

// ---- refusals ------------------------------------------------------------------------------------------

/// Bad input is refused with std::invalid_argument before any work: outputs of the wrong extent, a v of
/// the wrong head_dim, heads_q not a multiple of heads_kv, overlapping query ranges, a key range out of
/// the buffer, a sliding window of no key, a short workspace; and (H::kRefusesAliasing) every output that
/// shares memory with an input, another output or the workspace.
template <class H>
void check_refusals(typename H::kernel_type& kernel) {
  using T = typename H::value_type;
  using A = typename H::accum_type;
  using Thd = typename H::template Thd<T>;
  const AttentionShape shape = H::adapt({4, 2, 32});
  const int d = shape.qk_dim(), d_v = shape.v_dim();  // d: q, k, dq, dk; d_v: v, dout, o, dv
  Thd q(10, 4, d, 0), k(12, 2, d, 0), v(12, 2, d_v, 0), o(10, 4, d_v, 0), dout(10, 4, d_v, 0), dq(10, 4, d, 0),
      dk(12, 2, d, 0), dv(12, 2, d_v, 0), o_short(9, 4, d_v, 0), v_narrow(12, 2, d_v / 2, 0);
  typename H::Lse lse(4, 10);
  const std::size_t ws_bytes = kernel.workspace_bytes(shape, 10, 12);
  typename H::Bytes ws(ws_bytes);
  const std::vector<AttnSlice> good{{{0, 10}, {0, 12}, Mask::causal(2)}};
  const typename H::Slices slices(good, 10, 12);
  const auto fwd = [&](const AttentionShape& s, std::span<const AttnSlice> sl, ThdView<T> vo, LseView<A> vl,
                       ThdView<T> vv, std::span<std::byte> w) {
    kernel.forward(s, q.view(), k.view(), vv, sl, vo, vl, w);
    H::finish(kernel);
  };
  const auto bwd = [&](std::span<const AttnSlice> sl, ThdView<T> vdq, ThdView<T> vdk, ThdView<T> vdv,
                       std::span<std::byte> w) {
    kernel.backward(shape, q.view(), k.view(), v.view(), o.view(), LseView<const A>(lse.view()), dout.view(), sl, vdq,
                    vdk, vdv, w);
    H::finish(kernel);
  };
  CHECK_NOTHROW(fwd(shape, slices.span(), o.view(), lse.view(), v.view(), ws.span()));
  CHECK_NOTHROW(bwd(slices.span(), dq.view(), dk.view(), dv.view(), ws.span()));
  CHECK_THROWS_AS(fwd(shape, slices.span(), o_short.view(), lse.view(), v.view(), ws.span()), std::invalid_argument);
  CHECK_THROWS_AS(fwd(shape, slices.span(), o.view(), lse.view(), v_narrow.view(), ws.span()), std::invalid_argument);
  AttentionShape bad_heads = shape;
  bad_heads.heads_q = 3;
  CHECK_THROWS_AS(fwd(bad_heads, slices.span(), o.view(), lse.view(), v.view(), ws.span()), std::invalid_argument);
  if (ws_bytes > 0)
    CHECK_THROWS_AS(fwd(shape, slices.span(), o.view(), lse.view(), v.view(), ws.span().first(ws_bytes / 2)),
                    std::invalid_argument);
  // Bad slice lists, refused where they reach the kernel (the call, or the upload to its memory).
  const std::vector<std::vector<AttnSlice>> bad_slices{
      {{{0, 6}, {0, 12}, Mask::full()}, {{5, 10}, {0, 12}, Mask::full()}},  // overlapping query ranges
      {{{0, 10}, {0, 13}, Mask::full()}},                                   // keys out of the buffer
      {{{0, 10}, {0, 12}, Mask::sliding_window(0)}},                        // a window of no key
  };
  for (const auto& bad : bad_slices) {
    CAPTURE(bad.front());
    CHECK_THROWS_AS(fwd(shape, typename H::Slices(bad, 10, 12).span(), o.view(), lse.view(), v.view(), ws.span()),
                    std::invalid_argument);
    CHECK_THROWS_AS(bwd(typename H::Slices(bad, 10, 12).span(), dq.view(), dk.view(), dv.view(), ws.span()),
                    std::invalid_argument);
  }
  if constexpr (H::kRefusesAliasing) {
    const auto expect_alias = [](const std::function<void()>& call, const char* what) {
      CHECK_THROWS_WITH_AS(call(), doctest::Contains(what), std::invalid_argument);
    };
    // forward: O over q; LSE inside O; O inside the workspace
    expect_alias([&] { fwd(shape, slices.span(), q.view(), lse.view(), v.view(), ws.span()); }, "overlaps q");
    const LseView<A> lse_in_o = LseView<A>::dense(reinterpret_cast<A*>(o.view().data), 4, 10);
    expect_alias([&] { fwd(shape, slices.span(), o.view(), lse_in_o, v.view(), ws.span()); }, "overlaps o");
    typename H::Bytes wide(ws_bytes + 10 * 4 * static_cast<std::size_t>(std::max(d, d_v)) * sizeof(T) + 64);
    const ThdView<T> o_in_ws = ThdView<T>::dense(reinterpret_cast<T*>(wide.span().data()), 10, 4, d_v);
    expect_alias([&] { fwd(shape, slices.span(), o_in_ws, lse.view(), v.view(), wide.span()); }, "workspace");
    // backward: dQ over dout; dK inside dQ; dV over v; dQ inside the workspace
    expect_alias([&] { bwd(slices.span(), dout.view(), dk.view(), dv.view(), ws.span()); }, "overlaps dout");
    const ThdView<T> dk_in_dq = ThdView<T>::dense(dq.view().data, 12, 2, d);
    expect_alias([&] { bwd(slices.span(), dq.view(), dk_in_dq, dv.view(), ws.span()); }, "overlaps dq");
    expect_alias([&] { bwd(slices.span(), dq.view(), dk.view(), v.view(), ws.span()); }, "overlaps v");
    const ThdView<T> dq_in_ws = ThdView<T>::dense(reinterpret_cast<T*>(wide.span().data()), 10, 4, d);
    expect_alias([&] { bwd(slices.span(), dq_in_ws, dk.view(), dv.view(), wide.span()); }, "workspace");
  }
  // Still usable after the refusals.
  CHECK_NOTHROW(fwd(shape, slices.span(), o.view(), lse.view(), v.view(), ws.span()));
}

// ---- the host harness ----------------------------------------------------------------------------------

/// Harness of a kernel whose memory is the host's (Reference, CpuFlash): std::vector storage.
template <class Kernel>
struct HostHarness {
  using kernel_type = Kernel;
  using value_type = typename Kernel::value_type;
  using accum_type = typename Kernel::accum_type;
  static constexpr bool kRefusesAliasing = true;

  template <class U>
  class Thd {
   public:
    Thd(std::int64_t tokens, int heads, int d, int pad) : t_(tokens, heads + pad, d), heads_(heads), pad_(pad) {}
    [[nodiscard]] ThdView<U> view() { return t_.view().heads_slice(pad_ == 0 ? 0 : 1, heads_); }
    void write(const ThdTensor<double>& src) {
      const ThdView<U> v = view();
      for (std::int64_t t = 0; t < v.tokens; ++t)
        for (int h = 0; h < v.heads; ++h)
          for (int x = 0; x < v.head_dim; ++x) v(t, h, x) = U(src.view()(t, h, x));
    }
    [[nodiscard]] ThdTensor<double> read() {
      const ThdView<U> v = view();
      ThdTensor<double> out(v.tokens, v.heads, v.head_dim);
      for (std::int64_t t = 0; t < v.tokens; ++t)
        for (int h = 0; h < v.heads; ++h)
          for (int x = 0; x < v.head_dim; ++x) out.view()(t, h, x) = double(v(t, h, x));
      return out;
    }

   private:
    ThdTensor<U> t_;
    int heads_, pad_;
  };

  class Lse {
   public:
    Lse(int heads, std::int64_t tokens) : t_(heads, tokens) {}
    [[nodiscard]] LseView<accum_type> view() { return t_.view(); }
    void write(const LseTensor<double>& src) {
      for (std::size_t i = 0; i < src.storage.size(); ++i) t_.storage[i] = accum_type(src.storage[i]);
    }
    [[nodiscard]] LseTensor<double> read() const {
      LseTensor<double> out(t_.heads, t_.tokens);
      for (std::size_t i = 0; i < out.storage.size(); ++i) out.storage[i] = double(t_.storage[i]);
      return out;
    }

   private:
    LseTensor<accum_type> t_;
  };

  class Slices {
   public:
    Slices(std::span<const AttnSlice> s, std::int64_t, std::int64_t) : s_(s.begin(), s.end()) {}
    [[nodiscard]] std::span<const AttnSlice> span() const noexcept { return s_; }

   private:
    std::vector<AttnSlice> s_;
  };

  class Bytes {
   public:
    explicit Bytes(std::size_t n) : b_(n) {}
    [[nodiscard]] std::span<std::byte> span() noexcept { return b_; }

   private:
    std::vector<std::byte> b_;
  };

  static AttentionShape adapt(AttentionShape shape) { return shape; }
  static void finish(const Kernel&) {}
};

}  // namespace seqpar::test::kernel_cases
