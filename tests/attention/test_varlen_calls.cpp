// SPDX-License-Identifier: Apache-2.0
// The slice-to-varlen-call mapping of the torch-flash kernel (attention/detail/varlen_calls.hpp, issue 38),
// on the CPU: every visible (query, key) pair of a slice table in exactly one call under FlashAttention's
// bottom-right mask (evaluated by the stand-in's predicate, tests/support/varlen_standin.hpp), the
// offsets and segments consistent, backward waves key-disjoint, and a check that fails when the
// alignment or a window bound is off by one. Then the stand-in kernel against the fp64 reference over
// random slice tables (forward, and the backward's accumulation into the caller's gradients).
#include <doctest/doctest.h>

#include <seqpar/attention/detail/varlen_calls.hpp>
#include <seqpar/attention/reference.hpp>
#include <seqpar/core/document_batch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/varlen_standin.hpp"

using namespace seqpar;
using attention::detail::RowSegment;
using attention::detail::VarlenCall;

namespace {

using Pairs = std::map<std::pair<std::int64_t, std::int64_t>, int>;  // (q row, k row) -> times covered

Pairs slice_pairs(const std::vector<AttnSlice>& slices) {
  Pairs out;
  for (const AttnSlice& s : slices)
    for (std::int64_t i = 0; i < s.q_range.size(); ++i) {
      const Range vis = s.mask.visible_keys(i, s.k_range.size());
      for (std::int64_t j = vis.begin; j < vis.end; ++j) ++out[{s.q_range.begin + i, s.k_range.begin + j}];
    }
  return out;
}

std::vector<std::int64_t> expand(const std::vector<RowSegment>& segs) {
  std::vector<std::int64_t> rows;
  for (const RowSegment& s : segs)
    for (std::int64_t r = s.begin; r < s.begin + s.rows; ++r) rows.push_back(r);
  return rows;
}

// How a mask predicate is evaluated: FA's (the stand-in's), or a deliberately wrong one.
enum class Eval { kFlash, kTopLeft, kLeftPlusOne, kRightPlusOne };

// The pairs the calls attend, mapped back to buffer rows through their segments and offsets (checked
// against the items on the way); also requires every packed row to see at least one key.
Pairs call_pairs(const std::vector<VarlenCall>& calls, Eval eval = Eval::kFlash) {
  Pairs out;
  for (const VarlenCall& c : calls) {
    const std::vector<std::int64_t> qrows = expand(c.q_rows), krows = expand(c.k_rows);
    REQUIRE(static_cast<std::int64_t>(qrows.size()) == c.total_q());
    REQUIRE(static_cast<std::int64_t>(krows.size()) == c.total_k());
    REQUIRE(c.cu_seqlens_q.size() == c.items.size() + 1);
    for (std::size_t b = 0; b < c.items.size(); ++b) {
      const auto& it = c.items[b];
      const std::int64_t q0 = c.cu_seqlens_q[b], k0 = c.cu_seqlens_k[b];
      const std::int64_t sq = c.cu_seqlens_q[b + 1] - q0, sk = c.cu_seqlens_k[b + 1] - k0;
      REQUIRE(sq == it.q_len);
      REQUIRE(sk == it.k_len);
      CHECK(sq <= c.max_q);
      CHECK(sk <= c.max_k);
      CHECK(qrows[static_cast<std::size_t>(q0)] == it.q_begin);
      CHECK(qrows[static_cast<std::size_t>(q0 + sq - 1)] == it.q_begin + sq - 1);
      CHECK(krows[static_cast<std::size_t>(k0)] == it.k_begin);
      CHECK(krows[static_cast<std::size_t>(k0 + sk - 1)] == it.k_begin + sk - 1);
      test::VarlenArgs a;
      a.max_k = c.max_k;
      a.is_causal = c.mask.is_causal();
      a.window_size_left = c.mask.is_causal() ? -1 : c.mask.left;
      a.window_size_right = c.mask.is_causal() ? -1 : c.mask.right;
      if (eval == Eval::kLeftPlusOne && a.window_size_left >= 0) ++a.window_size_left;
      if (eval == Eval::kRightPlusOne) {
        if (a.is_causal) a.is_causal = false, a.window_size_right = 0;
        if (a.window_size_right >= 0) ++a.window_size_right;
      }
      for (std::int64_t t = 0; t < sq; ++t) {
        int seen = 0;
        for (std::int64_t u = 0; u < sk; ++u) {
          // top-left: the diagonal of row t at key t (sq == sk's alignment), as SDPA's dense causal is.
          const bool sees = eval == Eval::kTopLeft ? test::varlen_sees(a, t, u + (sk - sq), sq, sk)
                                                   : test::varlen_sees(a, t, u, sq, sk);
          if (!sees) continue;
          ++seen;
          ++out[{qrows[static_cast<std::size_t>(q0 + t)], krows[static_cast<std::size_t>(k0 + u)]}];
        }
        if (eval == Eval::kFlash) CHECK_MESSAGE(seen > 0, "an item row that sees no key would get LSE +inf");
      }
    }
  }
  return out;
}

void check_mapping(const std::vector<AttnSlice>& slices) {
  const Pairs want = slice_pairs(slices);
  for (const auto pass : {attention::Pass::kForward, attention::Pass::kBackward}) {
    const std::vector<VarlenCall> calls = attention::detail::varlen_calls(slices, pass, "test");
    const Pairs got = call_pairs(calls);
    CHECK(got == want);                   // every visible pair exactly once (counts are 1 in want), nothing else
    std::map<std::int64_t, int> q_calls;  // a query row lies in one call at most: O and LSE are written
    for (const VarlenCall& c : calls) {
      for (const std::int64_t r : expand(c.q_rows)) CHECK(++q_calls[r] == 1);
      for (std::size_t b = 1; b < c.items.size(); ++b) CHECK(c.items[b - 1].q_begin < c.items[b].q_begin);
      if (pass == attention::Pass::kBackward) {  // a wave writes each key row at most once
        std::vector<std::int64_t> keys = expand(c.k_rows);
        std::sort(keys.begin(), keys.end());
        CHECK(std::adjacent_find(keys.begin(), keys.end()) == keys.end());
      }
      for (std::size_t s = 1; s < c.q_rows.size(); ++s)  // segments are maximal runs
        CHECK(c.q_rows[s - 1].begin + c.q_rows[s - 1].rows != c.q_rows[s].begin);
    }
  }
}

// Random slice tables over buffers of `rows` queries and keys: disjoint query ranges, keys anywhere,
// full / causal / window masks with offsets before, inside and after the keys, windows 1..huge.
std::vector<AttnSlice> random_slices(std::mt19937& rng, std::int64_t rows, std::int64_t keys) {
  std::vector<AttnSlice> out;
  std::int64_t q = 0;
  while (q < rows) {
    const std::int64_t len = std::min<std::int64_t>(rows - q, 1 + static_cast<std::int64_t>(rng() % 12));
    const std::int64_t kb = static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(keys));
    const std::int64_t kl = std::min<std::int64_t>(keys - kb, 1 + static_cast<std::int64_t>(rng() % 14));
    const std::int64_t offset = static_cast<std::int64_t>(rng() % 30) - 12;
    const std::int64_t windows[] = {1, 2, 3, 5, 8, 13, 40, std::numeric_limits<std::int64_t>::max()};
    Mask m;
    switch (rng() % 3) {
      case 0:
        m = Mask::full();
        break;
      case 1:
        m = Mask::causal(offset);
        break;
      default:
        m = Mask::sliding_window(windows[rng() % 8], offset);
        break;
    }
    if (rng() % 5 != 0) out.push_back({{q, q + len}, {kb, kb + kl}, m});  // some rows in no slice
    q += len;
  }
  std::shuffle(out.begin(), out.end(), rng);  // the mapping must not rely on the table's order
  return out;
}

}  // namespace

TEST_SUITE("attention") {
  TEST_CASE("varlen calls: every visible pair in exactly one call, offsets, waves (random slice tables)") {
    std::mt19937 rng(38);
    for (int trial = 0; trial < 300; ++trial) {
      INFO("trial " << trial);
      check_mapping(random_slices(rng, 40, 50));
    }
  }

  TEST_CASE("varlen calls: windows cut on the right by the slice's last key map exactly (no refusal)") {
    // A query block after its keys (a ring step): every row's window is cut on the right by the keys' end.
    check_mapping({{{0, 6}, {0, 9}, Mask::sliding_window(5, 7)}});
    // Rows past the keys and rows before them in one slice; a window reaching key 0 only for some rows.
    check_mapping({{{0, 20}, {0, 8}, Mask::sliding_window(4, -3)}});
    check_mapping({{{0, 20}, {0, 8}, Mask::sliding_window(100, -3)}});
    // One-token documents merged into one diagonal slice (a window of one key): one call, all views.
    const std::vector<AttnSlice> ones{{{0, 12}, {0, 12}, Mask::sliding_window(1)}};
    check_mapping(ones);
    const auto calls = attention::detail::varlen_calls(ones, attention::Pass::kForward, "test");
    REQUIRE(calls.size() == 1);
    CHECK(calls[0].mask == attention::detail::VarlenMask{0, 0});
    CHECK(calls[0].q_contiguous());
    CHECK(calls[0].k_contiguous());
  }

  TEST_CASE("varlen calls: packed documents are one causal call whose rows are views") {
    const DocumentBatch batch({{5, 1, 9, 1, 1, 30}, {17, 2}});
    const std::vector<AttnSlice> slices = batch.document_causal_slices();
    check_mapping(slices);
    for (const auto pass : {attention::Pass::kForward, attention::Pass::kBackward}) {
      const auto calls = attention::detail::varlen_calls(slices, pass, "test");
      REQUIRE(calls.size() == 1);
      CHECK(calls[0].mask.is_causal());
      CHECK(calls[0].q_contiguous());  // documents abut: the buffers themselves, no gather
      CHECK(calls[0].k_contiguous());
      CHECK(calls[0].total_q() == batch.total_tokens());
      CHECK(calls[0].max_q == 30);
    }
    // Two slices sharing keys (a query block split in two): one forward call, two backward waves.
    const std::vector<AttnSlice> shared{{{0, 4}, {0, 10}, Mask::full()}, {{4, 8}, {0, 10}, Mask::full()}};
    CHECK(attention::detail::varlen_calls(shared, attention::Pass::kForward, "test").size() == 1);
    CHECK(attention::detail::varlen_calls(shared, attention::Pass::kBackward, "test").size() == 2);
    check_mapping(shared);
  }

  TEST_CASE("varlen calls: the pair check fails when the alignment or a window bound is off by one") {
    // Causal block with its queries 3 rows after its keys start, a window of 4, plus a causal item.
    const std::vector<AttnSlice> slices{{{0, 6}, {0, 9}, Mask::sliding_window(4, 3)},
                                        {{6, 14}, {9, 14}, Mask::causal(-2)}};
    const Pairs want = slice_pairs(slices);
    const auto calls = attention::detail::varlen_calls(slices, attention::Pass::kForward, "test");
    CHECK(call_pairs(calls) == want);
    CHECK(call_pairs(calls, Eval::kTopLeft) != want);
    CHECK(call_pairs(calls, Eval::kLeftPlusOne) != want);
    CHECK(call_pairs(calls, Eval::kRightPlusOne) != want);
  }

  TEST_CASE("varlen calls: offsets past int32 are refused by name") {
    const std::int64_t big = std::int64_t{3} << 30;
    const std::vector<AttnSlice> slices{{{0, big}, {0, 4}, Mask::full()}};
    try {
      (void)attention::detail::varlen_calls(slices, attention::Pass::kForward, "TorchFlash::forward");
      FAIL("3 * 2^30 packed rows were accepted");
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      CHECK(what.find("TorchFlash::forward") != std::string::npos);
      CHECK(what.find("int32") != std::string::npos);
      CHECK(what.find(std::to_string(big)) != std::string::npos);
    }
  }

  TEST_CASE("VarlenStandin (mapping + fp64 stand-in of FA's varlen call) equals the fp64 reference") {
    // Tolerance 1e-5: the stand-in rounds its LSE to float, as FA returns it; everything else is fp64.
    constexpr double kTolerance = 1e-5;
    std::mt19937 rng(83);
    for (const AttentionShape shape : {AttentionShape{4, 4, 8}, AttentionShape{6, 2, 8}, AttentionShape{4, 1, 16}}) {
      for (int trial = 0; trial < 12; ++trial) {
        INFO("heads " << shape.heads_q << ":" << shape.heads_kv << ", trial " << trial);
        const std::int64_t n = 48, nk = 56;
        const std::vector<AttnSlice> slices = random_slices(rng, n, nk);
        std::normal_distribution<double> normal;
        const auto fill = [&](ThdTensor<double>& t) {
          for (double& x : t.storage) x = normal(rng);
        };
        ThdTensor<double> q(n, shape.heads_q, shape.head_dim), k(nk, shape.heads_kv, shape.head_dim),
            v(nk, shape.heads_kv, shape.head_dim), dout(n, shape.heads_q, shape.head_dim);
        fill(q), fill(k), fill(v), fill(dout);
        ThdTensor<double> o_ref(n, shape.heads_q, shape.head_dim), o(n, shape.heads_q, shape.head_dim);
        LseTensor<double> lse_ref(shape.heads_q, n), lse(shape.heads_q, n);
        attention::Reference<double> ref;
        test::VarlenStandin standin;
        ref.forward(shape, q.view(), k.view(), v.view(), slices, o_ref.view(), lse_ref.view());
        standin.forward(standin.exec(), shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), {});
        const auto rel = [](const std::vector<double>& got, const std::vector<double>& want) -> double {
          double scale = 0, e = 0;
          for (std::size_t i = 0; i < want.size(); ++i) {
            if (std::isinf(want[i]) || std::isinf(got[i])) {
              if (got[i] != want[i]) return std::numeric_limits<double>::infinity();
              continue;
            }
            scale = std::max(scale, std::abs(want[i]));
            e = std::max(e, std::abs(got[i] - want[i]));
          }
          return scale > 0 ? e / scale : e;
        };
        CHECK(rel(o.storage, o_ref.storage) < kTolerance);
        CHECK(rel(lse.storage, lse_ref.storage) < kTolerance);  // -inf exactly where no slice reaches
        // Backward accumulates (+=) into gradients that already hold values.
        ThdTensor<double> dq_ref(n, shape.heads_q, shape.head_dim), dk_ref(nk, shape.heads_kv, shape.head_dim),
            dv_ref(nk, shape.heads_kv, shape.head_dim);
        fill(dq_ref), fill(dk_ref), fill(dv_ref);
        ThdTensor<double> dq = dq_ref, dk = dk_ref, dv = dv_ref;
        ref.backward(shape, q.view(), k.view(), v.view(), o_ref.view(), lse_ref.view(), dout.view(), slices,
                     dq_ref.view(), dk_ref.view(), dv_ref.view());
        standin.backward(standin.exec(), shape, q.view(), k.view(), v.view(), o_ref.view(), lse_ref.view(), dout.view(),
                         slices, dq.view(), dk.view(), dv.view(), {});
        CHECK(rel(dq.storage, dq_ref.storage) < 1e-10);  // the merged O and LSE given in double: fp64 throughout
        CHECK(rel(dk.storage, dk_ref.storage) < 1e-10);
        CHECK(rel(dv.storage, dv_ref.storage) < 1e-10);
      }
    }
  }
}
