// SPDX-License-Identifier: Apache-2.0
// Randomized misuse of the public API, bounded in time; meant to run under ASan + UBSan.
//
// Each case draws a batch, a head shape and, for every tensor argument, a view: a valid layout
// (THD or head-major, with random padding in the strides) in a buffer of exactly the size it spans,
// or a corrupted one (a stride made too small, zero, negative or huge; an extent off by one; a null
// pointer; an output pointed at an input or another output) in a small buffer. What the test
// expects is decided here, independently of the library: a layout is valid iff its element offsets,
// enumerated, are distinct and non-negative and fit the buffer. Then:
//  - kernel calls (CpuFlash<float>, forward and backward, slices of the batch): valid views give the
//    fp64 reference's answer; any corrupted layout throws std::invalid_argument, never touches memory
//    out of its buffer (ASan) and never overflows (UBSan);
//  - DistributedAttention (Zigzag x Ring, Uniform x AllToAll, PerDoc x AllGather; Reference<double>)
//    on 1 to 3 in-process ranks, one rank's argument corrupted (or none): that rank throws
//    std::invalid_argument, every other rank seqpar::Error (kPeerFailed), none waits for a timeout;
//    with nothing corrupted every rank returns;
//  - DocumentBatch with random (also negative and huge) lengths: accepted with an exact causal area
//    (checked against 128-bit arithmetic), or refused with std::invalid_argument;
//  - the planning layers: DynamicChunk, one_f_one_b, the checkpointing greedy, validate_schedule and
//    token_meta with random valid and invalid arguments (planner_case);
//  - runtime::ChunkedAttention over Zigzag x Ring on 1 to 3 in-process ranks (chunked_case; half the
//    batches with a sliding window): DynamicChunk's chunks give the reference's answer; a corrupted chunk plan, a chunk
//    index out of range or out of order (on one rank or all), a transport of another size are refused with
//    std::invalid_argument by the rank that made the mistake, its peers getting seqpar::Error (kPeerFailed), none
//    waiting;
//  - the GLPK checkpointing MILP (milp_case, when seqpar::glpk is built): random small problems, also
//    with bad orders, non-finite models and bad options: refused, or a plan no worse than the greedy's;
//  - train::shard / shard_rows / token_meta with random ranks, rows and plans of another batch
//    (train_case): the rows the plan or the ranges name, or std::invalid_argument;
//  - DistributedAttention over Zigzag x Ring on 1 to 3 in-process ranks with a drawn window (none, small,
//    or huge: up to INT64_MAX), sinks (none, finite, some heads -inf, or one rank's out of sync), a value
//    head size of its own, and a DPP schedule grouped from the chunk plan of this batch or of another of the
//    same tokens (replicated_case): exact against the fp64 oracle, or Errc::kMismatch naming the sinks on
//    every rank, or the schedule refused by name.
// Exits non-zero on the first violation, printing the seed.
//   fuzz_api [--seconds S] [--seed N] [--replay A,B,...]
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/token_meta.hpp>

#include "fuzz_driver.hpp"
#include "support/distributed_check.hpp"

#ifdef SEQPAR_FUZZ_GLPK
#include <seqpar/schedule/checkpoint_milp.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace seqpar;

namespace {

__extension__ typedef __int128 i128;  // exact arithmetic for the expectations (GCC and Clang)

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void expect(bool ok, const std::string& what) {
  if (!ok) throw Failure(what);
}

template <class T>
int pick(std::mt19937& rng, T n) {
  return static_cast<int>(rng() % static_cast<std::uint32_t>(n));
}

// A drawn THD view and the buffer it lives in.
template <class T>
struct Drawn {
  std::vector<T> buffer;
  ThdView<T> view;
  bool valid = true;
};

// Whether the layout's offsets are distinct, non-negative and inside `size` elements (brute force).
bool layout_fits(std::int64_t tokens, int heads, int dim, std::int64_t ts, std::int64_t hs, std::size_t size) {
  if (tokens == 0 || heads == 0) return true;
  std::set<std::int64_t> seen;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int x = 0; x < dim; ++x) {
        const i128 off = static_cast<i128>(t) * ts + static_cast<i128>(h) * hs + x;
        if (off < 0 || off >= static_cast<i128>(size)) return false;
        if (!seen.insert(static_cast<std::int64_t>(off)).second) return false;
      }
  return true;
}

// A view of (tokens, heads, dim): valid with probability 1 - p_bad.
template <class T>
Drawn<T> draw(std::mt19937& rng, std::int64_t tokens, int heads, int dim, double p_bad, bool extents = true) {
  Drawn<T> d;
  const bool head_major = rng() % 4 == 0;
  const std::int64_t pad_h = pick(rng, 3), pad_t = pick(rng, 5);
  std::int64_t hs = 0, ts = 0;
  if (head_major) {
    ts = dim + pad_t;
    hs = std::max<std::int64_t>(tokens - 1, 0) * ts + dim + pad_h;
  } else {
    hs = dim + pad_h;
    ts = (heads - 1) * hs + dim + pad_t;
  }
  std::int64_t t = tokens;
  bool null = false;
  if (std::uniform_real_distribution<double>(0, 1)(rng) < p_bad) {
    int kind = pick(rng, 7);
    if (!extents && kind == 5) kind = 6;
    switch (kind) {
      case 0:
        ts = pick(rng, std::max<std::int64_t>(ts, 1));
        break;  // maybe too small
      case 1:
        hs = pick(rng, std::max<std::int64_t>(hs, 1));
        break;
      case 2:
        ts = -1 - pick(rng, 40);
        break;  // negative
      case 3:
        hs = 0;
        break;  // zero
      case 4:
        ts = std::numeric_limits<std::int64_t>::max() / (1 + pick(rng, 4));
        break;  // huge
      case 5:
        t = tokens + (rng() % 2 ? 1 : -1);
        break;  // extent off by one
      default:
        null = tokens > 0;
        break;
    }
  }
  // The buffer: exactly what a valid layout spans (small sizes), else a few elements.
  // Strides of an axis of one element are unused (any value is valid there).
  const std::int64_t ts_used = t > 1 ? ts : 0, hs_used = heads > 1 ? hs : 0;
  i128 span = 0;
  if (ts_used >= 0 && hs_used >= 0 && t > 0)
    span = static_cast<i128>(t - 1) * ts_used + static_cast<i128>(heads - 1) * hs_used + dim;
  const bool small = ts_used >= 0 && hs_used >= 0 && span <= 100000;
  d.buffer.assign(small ? static_cast<std::size_t>(span) + 1 : 16, T(0.5));
  for (auto& x : d.buffer) x = T(std::normal_distribution<double>(0, 1)(rng));
  d.view = {null ? nullptr : d.buffer.data(), t, heads, dim, ts, hs};
  d.valid = !null && t == tokens && t >= 0 && small && layout_fits(t, heads, dim, ts_used, hs_used, d.buffer.size());
  return d;
}

// A dense LSE (heads, tokens) with a random head stride: valid iff >= tokens (or one head).
template <class A>
struct DrawnLse {
  std::vector<A> buffer;
  LseView<A> view;
  bool valid = true;
};
template <class A>
DrawnLse<A> draw_lse(std::mt19937& rng, int heads, std::int64_t tokens, double p_bad) {
  DrawnLse<A> d;
  std::int64_t hs = tokens + pick(rng, 3);
  if (std::uniform_real_distribution<double>(0, 1)(rng) < p_bad)
    hs = rng() % 2 ? pick(rng, std::max<std::int64_t>(tokens, 1)) : std::numeric_limits<std::int64_t>::max() / 2;
  // One head: the stride is unused, any value is valid. No tokens: the view addresses nothing, but
  // each head's row start (h x stride) is still formed, so it must fit in ptrdiff_t bytes (the
  // library's rule for every view; seeds 793882863 and 1475245705 overflowed there).
  const std::int64_t hs_used = heads > 1 && tokens > 0 ? hs : 0;
  const bool small = hs_used <= 100000;
  d.buffer.assign(small ? static_cast<std::size_t>((heads - 1) * hs_used + tokens + 1) : 16, A(0));
  d.view = {d.buffer.data(), heads, tokens, hs};
  const bool starts_fit = heads <= 1 || static_cast<i128>(heads - 1) * hs * static_cast<i128>(sizeof(A)) <=
                                            static_cast<i128>(std::numeric_limits<std::ptrdiff_t>::max());
  d.valid = small && (heads <= 1 || (tokens == 0 ? starts_fit : hs >= tokens));
  return d;
}

DocumentBatch random_batch(std::mt19937& rng) {
  std::vector<std::vector<std::int64_t>> seqs(static_cast<std::size_t>(1 + pick(rng, 2)));
  for (auto& s : seqs)
    for (int i = 0, n = 1 + pick(rng, 4); i < n; ++i) s.push_back(1 + pick(rng, 24));
  return DocumentBatch(seqs);
}

// CpuFlash<float> on drawn views against the fp64 reference.
void kernel_case(std::mt19937& rng) {
  const int hkv = 1 + pick(rng, 2), hq = hkv * (1 + pick(rng, 2)), dim = rng() % 2 ? 8 : 16;
  const AttentionShape shape{hq, hkv, dim};
  const DocumentBatch batch = random_batch(rng);
  const std::int64_t n = batch.total_tokens();
  const auto slices = batch.document_causal_slices();
  const double p_bad = rng() % 3 == 0 ? 0.0 : 0.15;
  // Extents stay right here: the kernel takes q's and k's token counts as given, so consistent
  // extents off by one would be a valid call on other buffers.
  auto q = draw<float>(rng, n, hq, dim, p_bad, false), k = draw<float>(rng, n, hkv, dim, p_bad, false),
       v = draw<float>(rng, n, hkv, dim, p_bad, false), o = draw<float>(rng, n, hq, dim, p_bad, false),
       dout = draw<float>(rng, n, hq, dim, p_bad, false), dq = draw<float>(rng, n, hq, dim, p_bad, false),
       dk = draw<float>(rng, n, hkv, dim, p_bad, false), dv = draw<float>(rng, n, hkv, dim, p_bad, false);
  auto lse = draw_lse<float>(rng, hq, n, p_bad);
  const attention::CpuFlash<float> flash;
  std::vector<std::byte> ws(flash.workspace_bytes(shape, n, n));
  const bool fwd_valid = q.valid && k.valid && v.valid && o.valid && lse.valid;
  bool threw = false;
  try {
    flash.forward(shape, q.view, k.view, v.view, slices, o.view, lse.view, ws);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  expect(threw != fwd_valid,
         std::string("CpuFlash::forward ") + (fwd_valid ? "refused valid views" : "accepted bad views"));
  if (!fwd_valid) return;
  // fp64 reference on dense copies.
  const auto dense = [&](const Drawn<float>& x) {
    ThdTensor<double> t(n, x.view.heads, dim);
    for (std::int64_t i = 0; i < n; ++i)
      for (int h = 0; h < x.view.heads; ++h)
        for (int j = 0; j < dim; ++j) t.view()(i, h, j) = x.view(i, h, j);
    return t;
  };
  auto rq = dense(q), rk = dense(k), rv = dense(v);
  ThdTensor<double> ro(n, hq, dim), rdq(n, hq, dim), rdk(n, hkv, dim), rdv(n, hkv, dim);
  LseTensor<double> rl(hq, n);
  const attention::Reference<double> ref;
  ref.forward(shape, rq.view(), rk.view(), rv.view(), slices, ro.view(), rl.view());
  for (std::int64_t i = 0; i < n; ++i)
    for (int h = 0; h < hq; ++h)
      for (int j = 0; j < dim; ++j)
        expect(std::abs(o.view(i, h, j) - ro.view()(i, h, j)) < 1e-3, "CpuFlash::forward differs from the reference");
  const bool bwd_valid = dout.valid && dq.valid && dk.valid && dv.valid;
  for (auto* g : {&dq, &dk, &dv}) std::fill(g->buffer.begin(), g->buffer.end(), 0.0f);  // the kernel accumulates
  threw = false;
  try {
    flash.backward(shape, q.view, k.view, v.view, o.view, lse.view, dout.view, slices, dq.view, dk.view, dv.view, ws);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  expect(threw != bwd_valid,
         std::string("CpuFlash::backward ") + (bwd_valid ? "refused valid views" : "accepted bad views"));
  if (!bwd_valid) return;
  auto rdo = dense(dout);
  ref.backward(shape, rq.view(), rk.view(), rv.view(), ro.view(), rl.view(), rdo.view(), slices, rdq.view(), rdk.view(),
               rdv.view());
  const auto close = [&](const Drawn<float>& got, const ThdTensor<double>& want, const char* name) {
    for (std::int64_t i = 0; i < n; ++i)
      for (int h = 0; h < want.heads; ++h)
        for (int j = 0; j < dim; ++j)
          expect(std::abs(got.view(i, h, j) - want.view()(i, h, j)) < 2e-3 * (1 + std::abs(want.view()(i, h, j))),
                 std::string("CpuFlash::backward: ") + name + " differs from the reference");
  };
  close(dq, rdq, "dq"), close(dk, rdk, "dk"), close(dv, rdv, "dv");
}

// DistributedAttention with one rank's argument corrupted (or none).
template <class S>
void distributed_case(std::mt19937& rng, const char* name) {
  const int world = 1 + pick(rng, 3);
  const int hkv = 1 + pick(rng, 2);
  const AttentionShape shape{hkv * 2 * (1 + pick(rng, 2)), hkv, 8};
  const DocumentBatch batch = random_batch(rng);
  const int bad_rank = rng() % 2 ? pick(rng, world) : -1;
  const int bad_arg = pick(rng, 11);
  if (!S::can_implement({}, batch, shape, Topology{world, world}).ok)
    return;  // refused alike on every rank  // 0..4 views of forward, 5..7 backward outputs, 8..10 aliasing
  const std::uint32_t seed = rng();
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<int> kinds(static_cast<std::size_t>(world));  // 0 none, 1 invalid_argument, 2 kPeerFailed, 3 other
  bool bad_expected = false;  // the bad rank's corrupted argument is in fact invalid (decided here)
  std::mutex mu;
  const auto start = std::chrono::steady_clock::now();
  try {
    backend::inproc::World(world, {.timeout = std::chrono::seconds(30)}).run([&](backend::inproc::Transport& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      int kind = 0;
      try {
        std::mt19937 local_rng(seed + static_cast<std::uint32_t>(r));
        DistributedAttention<S, attention::Reference<double>> attn(t, shape);
        const std::int64_t n = attn.local_tokens(batch);
        const bool me = t.rank() == bad_rank;
        const auto p = [&](int arg) { return me && bad_arg == arg ? 1.0 : 0.0; };
        auto q = draw<double>(local_rng, n, shape.heads_q, 8, p(0)), k = draw<double>(local_rng, n, hkv, 8, p(1)),
             v = draw<double>(local_rng, n, hkv, 8, p(2)), o = draw<double>(local_rng, n, shape.heads_q, 8, p(3)),
             dout = draw<double>(local_rng, n, shape.heads_q, 8, 0),
             dq = draw<double>(local_rng, n, shape.heads_q, 8, p(5)), dk = draw<double>(local_rng, n, hkv, 8, p(6)),
             dv = draw<double>(local_rng, n, hkv, 8, p(7));
        auto lse = draw_lse<double>(local_rng, shape.heads_q, n, p(4));
        ThdView<double> ov = o.view, dqv = dq.view, dvv = dv.view;
        if (me && n > 0 && bad_arg == 8) ov = q.view, ov.heads = o.view.heads;        // o over q (same extents)
        if (me && n > 0 && bad_arg == 9) dqv = dout.view, dqv.heads = dq.view.heads;  // dq over dout
        if (me && n > 0 && bad_arg == 10) dvv = dk.view;                              // dv over dk
        if (me) {
          const bool valid[] = {q.valid, k.valid, v.valid, o.valid, lse.valid, dq.valid, dk.valid, dv.valid};
          std::lock_guard lock(mu);
          bad_expected = bad_arg < 8 ? !valid[bad_arg] : n > 0;
        }
        attn.forward(batch, q.view, k.view, v.view, ov, lse.view);
        attn.backward(batch, q.view, k.view, v.view, ov, lse.view, dout.view, dqv, dk.view, dvv);
      } catch (const std::invalid_argument& e) {
        kind = 1, errors[r] = e.what();
      } catch (const Error& e) {
        kind = e.errc() == Errc::kPeerFailed ? 2 : 3, errors[r] = e.what();
      } catch (const std::exception& e) {
        kind = 3, errors[r] = e.what();
      }
      std::lock_guard lock(mu);
      kinds[r] = kind;
    });
  } catch (const std::exception& e) {
    expect(false, std::string(name) + ": World::run threw " + e.what());
  }
  expect(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), std::string(name) + ": a rank waited");
  // A drawn corruption may still be a valid view (a stride drawn "too small" that is not): the
  // brute-force layout check above decides what the bad rank must get, and its peers follow it.
  const int bad_kind = bad_rank >= 0 ? kinds[static_cast<std::size_t>(bad_rank)] : 0;
  if (bad_rank >= 0)
    expect(bad_kind == (bad_expected ? 1 : 0),
           std::string(name) + ": rank " + std::to_string(bad_rank) +
               (bad_expected ? " accepted a bad argument " : " refused a valid one ") + std::to_string(bad_arg) + ": " +
               errors[static_cast<std::size_t>(bad_rank)]);
  for (int r = 0; r < world; ++r) {
    const int got = kinds[static_cast<std::size_t>(r)];
    const std::string at =
        std::string(name) + ", rank " + std::to_string(r) + ": " + errors[static_cast<std::size_t>(r)];
    expect(got != 3, at + " (unexpected error kind)");
    if (r == bad_rank) continue;
    expect(got == (bad_kind == 1 ? 2 : 0), at + (bad_kind == 1 ? " (expected kPeerFailed)" : " (expected success)"));
  }
}

void batch_case(std::mt19937& rng) {
  std::vector<std::int64_t> lens(static_cast<std::size_t>(1 + pick(rng, 3)));
  for (auto& l : lens) {
    switch (pick(rng, 4)) {
      case 0:
        l = -pick(rng, 3);
        break;
      case 1:
        l = 1 + static_cast<std::int64_t>(rng() % 1000);
        break;
      case 2:
        l = static_cast<std::int64_t>(rng()) * 1000 + pick(rng, 1000);
        break;  // up to 4.3e12
      default:
        l = static_cast<std::int64_t>(rng() % 4'000'000'000u);
        break;
    }
  }
  i128 area = 0, tokens = 0;
  bool ok = true;
  for (std::int64_t l : lens) {
    ok = ok && l >= 1 && l <= DocumentBatch::kMaxDocumentTokens;
    area += static_cast<i128>(l) * (l + 1) / 2;
    tokens += l;
  }
  ok = ok && area <= std::numeric_limits<std::int64_t>::max() && tokens <= DocumentBatch::kMaxTokens;
  try {
    const DocumentBatch b({lens});
    expect(ok, "DocumentBatch accepted lengths it should refuse");
    expect(b.causal_area() == static_cast<std::int64_t>(area), "DocumentBatch::causal_area is not exact");
    for (const AttnSlice& s : b.document_causal_slices())
      expect(s.area() == static_cast<std::int64_t>(static_cast<i128>(s.q_range.size()) * (s.q_range.size() + 1) / 2),
             "AttnSlice::area is not exact");
  } catch (const std::invalid_argument&) {
    expect(!ok, "DocumentBatch refused valid lengths");
  }
}

// The planning layers (issue 27): DynamicChunk with random (also invalid) arguments, 1F1B and the
// checkpointing greedy with random (also non-permutation) orders and (also non-finite) models,
// validate_schedule with another stage count, token_meta with a plan of another batch. Each call
// either returns a result whose invariants hold or throws std::invalid_argument, as decided here.
void planner_case(std::mt19937& rng) {
  std::vector<std::int64_t> lens(static_cast<std::size_t>(1 + pick(rng, 6)));
  for (auto& l : lens) l = 1 + static_cast<std::int64_t>(rng() % (pick(rng, 4) == 0 ? 3000 : 60));
  const DocumentBatch batch({lens});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  schedule::DynamicChunk sched;
  const std::int64_t caps[] = {-1, 0, 1, 2, 7, 64, 500, 5000};
  sched.args.token_capacity = caps[pick(rng, 8)];
  const int slices[] = {-1, 0, 0, 1, 3, 50, schedule::DynamicChunk::kMaxSlices + 1, 2147483647};
  sched.args.slices = slices[pick(rng, 8)];
  const double per_token[] = {0.0, 0.0, 24.0, -1.0, nan};
  sched.args.cost.per_token = per_token[pick(rng, 5)];
  const bool args_ok = sched.args.token_capacity >= 1 && sched.args.slices >= 0 &&
                       sched.args.slices <= schedule::DynamicChunk::kMaxSlices && sched.args.cost.per_token >= 0;
  schedule::ChunkPlan plan;
  try {
    plan = sched.plan(batch);
    expect(args_ok, "DynamicChunk accepted invalid arguments");
  } catch (const std::invalid_argument&) {
    return;  // invalid arguments, or a capacity the slice limit cannot reach (or explicit K too few)
  }
  std::vector<int> seen(static_cast<std::size_t>(batch.total_tokens()), 0);
  for (const Chunk& c : plan.chunks) {
    expect(c.batch.total_tokens() <= sched.args.token_capacity, "DynamicChunk: a chunk over the capacity");
    for (const Range& r : c.tokens)
      for (std::int64_t t = r.begin; t < r.end; ++t) ++seen[static_cast<std::size_t>(t)];
  }
  for (int x : seen) expect(x == 1, "DynamicChunk: a token not in exactly one chunk");
  if (plan.chunks.size() > 64) return;

  // 1F1B and the greedy: an order that is a permutation (or corrupted), a model (or a non-finite one).
  const int n = static_cast<int>(plan.chunks.size()), stages = 1 + pick(rng, 4);
  std::vector<int> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  if (pick(rng, 3) == 0 && n > 0) order[static_cast<std::size_t>(pick(rng, n))] = pick(rng, 3) == 0 ? n : 0;
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = true;
  for (int i = 0; i < n; ++i) permutation = permutation && sorted[static_cast<std::size_t>(i)] == i;
  try {
    (void)schedule::one_f_one_b(order, stages);
    expect(permutation, "one_f_one_b accepted an order that is not a permutation");
  } catch (const std::invalid_argument&) {
    expect(!permutation, "one_f_one_b refused a permutation");
  }
  schedule::PipelineModel m{.stages = stages,
                            .layers_per_stage = 1 + pick(rng, 3),
                            .static_bytes = 0,
                            .memory_cap = 1e9,
                            .activation_bytes_per_token = 10,
                            .kept_bytes_per_token = 2,
                            .seconds_per_cost = 1e-9};
  const bool finite = pick(rng, 4) != 0;
  if (!finite) (pick(rng, 2) == 0 ? m.memory_cap : m.static_bytes) = pick(rng, 2) == 0 ? nan : INFINITY;
  schedule::CheckpointProblem prob{{}, m, order};
  for (const Chunk& c : plan.chunks) prob.tokens.push_back(c.batch.total_tokens());
  try {
    const schedule::CheckpointPlan cp = schedule::solve_checkpointing(prob);
    expect(permutation && finite, "solve_checkpointing accepted a bad order or a non-finite model");
    expect(cp.diagonals.size() == static_cast<std::size_t>(n + stages - 1), "solve_checkpointing: decisions size");
  } catch (const std::invalid_argument&) {
    expect(!(permutation && finite), "solve_checkpointing refused a valid problem");
  }
  if (!finite) return;
  const schedule::PipelineSchedule s = schedule::group_pipelines(plan, m);
  const int other = 1 + pick(rng, 4);
  try {
    schedule::validate_schedule(plan, s, other, m.layers_per_stage, "fuzz");
    expect(other == stages, "validate_schedule accepted a schedule of another stage count");
  } catch (const std::invalid_argument&) {
    expect(other != stages, "validate_schedule refused the grouping's own schedule");
  }

  // token_meta: a strategy's plan of this batch, or of another batch of the same token count.
  using Z = Strategy<partition::Zigzag, comm::AllToAll>;
  const Z::Planned planned = Z::plan({}, batch, {2, 2, 8}, Topology{2, 2});
  if (!planned.status) return;
  const ShardPlan& sp = planned.plan;
  std::vector<std::int64_t> shifted = lens;
  std::rotate(shifted.begin(), shifted.begin() + 1, shifted.end());
  const DocumentBatch maybe_other({shifted});
  const bool same = maybe_other == batch;
  try {
    (void)train::token_meta(maybe_other, sp, pick(rng, 2));
    expect(same, "token_meta accepted a plan of another batch");
  } catch (const std::invalid_argument&) {
    expect(!same, "token_meta refused the plan of its own batch");
  }
}

// What the newer cases drew, printed with the summary (so that a run shows each path was taken).
struct DrawnCounts {
  long chunked_exact = 0, chunked_refused = 0, milp_solved = 0, milp_refused = 0, train_ok = 0, train_refused = 0;
  long replicated_exact = 0, replicated_refused = 0;
} g_counts;

// How a rank's call ended: 0 returned, 1 std::invalid_argument, 2 kPeerFailed, 3 kMismatch, 4 other.
template <class Body>
std::vector<int> run_ranks(int world, Body body, std::vector<std::string>& errors) {
  std::vector<int> kinds(static_cast<std::size_t>(world));
  errors.assign(static_cast<std::size_t>(world), {});
  std::mutex mu;
  const auto start = std::chrono::steady_clock::now();
  try {
    backend::inproc::World(world, {.timeout = std::chrono::seconds(30)}).run([&](backend::inproc::Transport& t) {
      int kind = 0;
      std::string what;
      try {
        body(t);
      } catch (const std::invalid_argument& e) {
        kind = 1, what = e.what();
      } catch (const Error& e) {
        kind = e.errc() == Errc::kPeerFailed ? 2 : e.errc() == Errc::kMismatch ? 3 : 4, what = e.what();
      } catch (const std::exception& e) {
        kind = 4, what = e.what();
      }
      std::lock_guard lock(mu);
      kinds[static_cast<std::size_t>(t.rank())] = kind;
      errors[static_cast<std::size_t>(t.rank())] = what;
    });
  } catch (const std::exception& e) {
    expect(false, std::string("World::run threw ") + e.what());
  }
  expect(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "a rank waited for a timeout");
  return kinds;
}

// ChunkedAttention: DynamicChunk's chunks of a random batch, exact against the reference; or one
// mistake (decided here), refused by name before any data moves.
void chunked_case(std::mt19937& rng) {
  using S = Strategy<partition::Zigzag, comm::Ring>;
  using K = attention::Reference<double>;
  std::vector<std::int64_t> lens(static_cast<std::size_t>(1 + pick(rng, 4)));
  for (auto& l : lens) l = 1 + pick(rng, 40);
  // Half the batches have a sliding window (1 key to longer than any document): cut prefixes, windowed slices.
  const DocumentBatch batch = DocumentBatch({lens});
  const AttentionMask mask{rng() % 2 ? 0 : 1 + pick(rng, 45)};
  const int world = 1 + pick(rng, 3);
  const AttentionShape shape{2, 1, 8};
  schedule::DynamicChunk sched;
  sched.args.token_capacity = 8 + pick(rng, 24);
  std::vector<Chunk> chunks;
  try {
    chunks = sched.chunks(batch);
  } catch (const std::invalid_argument&) {
    return;  // a capacity the slice limit cannot reach: planner_case's business
  }
  for (const Chunk& c : chunks)
    if (!S::can_implement({}, c.batch, shape, Topology{world, world}).ok) return;  // refused alike everywhere
  const int n = static_cast<int>(chunks.size());
  int with_prefix = -1;  // a chunk that reads an earlier chunk's rows under the mask (the carry cuts to it)
  for (int c = 0; c < n; ++c)
    for (const Range& p : chunks[static_cast<std::size_t>(c)].prefix)
      if (!visible_prefix(p, mask.window).empty() && with_prefix < 0) with_prefix = c;
  const auto factory = [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<K>> {
    return std::make_unique<DistributedAttention<S, K>>(t, shape);
  };
  const int mutation = pick(rng, 8);
  if (mutation < 3) {  // valid: every chunk forward in order, backward in reverse, against the reference
    const test::Errors err = test::distributed_check<K>(
        {batch, mask}, chunks, test::forward_then_backward(chunks.size()), shape, world, factory, rng());
    expect(err.max() < 1e-9, "ChunkedAttention differs from the reference: " + std::to_string(err.max()));
    expect(err.bytes_match, "ChunkedAttention: declared bytes differ from the counted bytes");
    ++g_counts.chunked_exact;
    return;
  }
  // The calls of a run, with one mistake: bad_rank < 0 makes it on every rank.
  const int bad_rank = rng() % 2 ? pick(rng, world) : -1;
  std::vector<Chunk> given = chunks;
  int bad_c = 0;           // mutation 4: the chunk index passed
  bool expect_bad = true;  // the mistake is one the library must refuse
  std::string must_name;
  switch (mutation) {
    case 3: {  // a corrupted chunk plan (the same on every rank)
      const int c = pick(rng, n);
      Chunk& ch = given[static_cast<std::size_t>(c)];
      switch (pick(rng, 3)) {
        case 0:
          ch.prefix.push_back({});
          must_name = ".prefix.size()";
          break;
        case 1:
          if (with_prefix < 0) return;
          for (Range& p : given[static_cast<std::size_t>(with_prefix)].prefix)
            if (!p.empty()) p.end += 1;
          must_name = ".prefix[";
          break;
        default:  // the chunk that reads a prefix moved first: its prefix only a later chunk holds
          if (with_prefix < 0) return;
          std::rotate(given.begin(), given.begin() + with_prefix, given.begin() + with_prefix + 1);
          must_name = "only a later chunk holds";
          break;
      }
      break;
    }
    case 4: {  // a chunk index out of range
      const int bad[] = {-1, n, n + 7, std::numeric_limits<int>::min()};
      bad_c = bad[pick(rng, 4)];
      must_name = "c = ";
      break;
    }
    case 5:  // a chunk's forward before the forward of the chunk its prefix reads
      if (with_prefix < 0) return;
      must_name = "whose forward has not run";
      break;
    case 6:  // a backward before the forward
      must_name = "has not run forward";
      break;
    case 7:  // a chunk that is read as prefix goes backward before the chunk that reads it
      if (with_prefix < 0) return;
      must_name = "must run backward first";
      break;
    default:  // a chunk that is read as prefix goes backward before the chunk that reads it
      if (with_prefix < 0) return;
      must_name = "must run backward first";
      break;
  }
  std::vector<std::string> errors;
  const auto kinds = run_ranks(
      world,
      [&](backend::inproc::Transport& t) {
        const bool me = bad_rank < 0 || t.rank() == bad_rank;
        DistributedAttention<S, K> attn(t, shape);
        runtime::ChunkedAttention<K> chunked(attn);
        chunked.begin(mutation == 3 ? given : chunks, mask);
        std::vector<AttentionTensors<double>> l;
        for (int c = 0; c < n; ++c) l.emplace_back(chunked.local_tokens(c), shape);
        const auto fwd = [&](int c) {
          auto& x = l[static_cast<std::size_t>(c < 0 || c >= n ? 0 : c)];
          chunked.forward(c, x.q.view(), x.k.view(), x.v.view(), x.o.view(), x.lse.view());
        };
        const auto bwd = [&](int c) {
          auto& x = l[static_cast<std::size_t>(c)];
          chunked.backward(c, x.q.view(), x.k.view(), x.v.view(), x.o.view(), x.lse.view(), x.dout.view(), x.dq.view(),
                           x.dk.view(), x.dv.view());
        };
        if (mutation == 4 && me) fwd(bad_c);
        if (mutation == 5 && me) fwd(with_prefix);  // with_prefix > 0: the chunk it reads is earlier
        if (mutation == 6 && me) bwd(n - 1);
        for (int c = 0; c < n; ++c) fwd(c);
        if (mutation == 7 && me) bwd(with_prefix - 1);
        for (int c = n - 1; c >= 0; --c) bwd(c);
      },
      errors);
  (void)expect_bad;
  for (int r = 0; r < world; ++r) {
    const int got = kinds[static_cast<std::size_t>(r)];
    const std::string at = "ChunkedAttention mutation " + std::to_string(mutation) + ", rank " + std::to_string(r) +
                           " of " + std::to_string(world) + ": " + errors[static_cast<std::size_t>(r)];
    // The plan and the transport are every rank's (a local refusal on each); a call's mistake is the bad
    // rank's, and its peers learn it from the agreement.
    const bool mine = mutation == 3 || bad_rank < 0 || r == bad_rank;
    if (mine) {
      expect(got == 1, at + " (expected std::invalid_argument)");
      expect(errors[static_cast<std::size_t>(r)].find(must_name) != std::string::npos,
             at + " (should name " + must_name + ")");
    } else {
      expect(got == 2, at + " (expected kPeerFailed)");
    }
  }
  ++g_counts.chunked_refused;
}

#ifdef SEQPAR_FUZZ_GLPK
// The GLPK checkpointing program on small random problems (also bad orders, non-finite models, bad
// options): refused with std::invalid_argument, or a plan of the right size, within the model's
// bounds, feasible whenever the greedy is and recomputing no more than it.
void milp_case(std::mt19937& rng) {
  const int n = 1 + pick(rng, 6), stages = 1 + pick(rng, 3);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<int> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const bool permutation = pick(rng, 4) != 0;
  if (!permutation) order[static_cast<std::size_t>(pick(rng, n))] = pick(rng, 2) == 0 ? n : -1;
  schedule::PipelineModel m{.stages = stages,
                            .layers_per_stage = 1 + pick(rng, 4),
                            .static_bytes = static_cast<double>(pick(rng, 200)),
                            .memory_cap = 200.0 + pick(rng, 2000),
                            .activation_bytes_per_token = 10,
                            .kept_bytes_per_token = 2,
                            .seconds_per_cost = 1e-9};
  const bool finite = pick(rng, 5) != 0;
  if (!finite) (pick(rng, 2) == 0 ? m.memory_cap : m.static_bytes) = pick(rng, 2) == 0 ? nan : INFINITY;
  schedule::CheckpointProblem prob{{}, m, order};
  for (int k = 0; k < n; ++k) prob.tokens.push_back(1 + pick(rng, 60));
  schedule::MilpOptions opt;
  const double gaps[] = {0.0, 0.0, 0.02, -0.1, nan};
  const double limits[] = {0.0, 0.0, 0.5, -1.0, INFINITY, 1e9, schedule::kMaxMilpSeconds};
  opt.relative_gap = gaps[pick(rng, 5)];
  opt.time_limit_s = limits[pick(rng, 7)];
  opt.greedy_start = pick(rng, 2) == 0;
  const bool options_ok =
      opt.relative_gap >= 0 && opt.time_limit_s >= 0 && opt.time_limit_s <= schedule::kMaxMilpSeconds;
  const bool ok = permutation && finite && options_ok;
  schedule::CheckpointPlan got;
  try {
    got = schedule::solve_checkpointing_milp(prob, opt);
    expect(ok, "solve_checkpointing_milp accepted a bad order, model or options");
  } catch (const std::invalid_argument&) {
    expect(!ok, "solve_checkpointing_milp refused a valid problem");
    ++g_counts.milp_refused;
    return;
  }
  expect(got.diagonals.size() == static_cast<std::size_t>(n + stages - 1), "solve_checkpointing_milp: decisions size");
  for (int c : got.diagonals)
    expect(c >= 0 && c <= m.layers_per_stage, "solve_checkpointing_milp: a decision out of bounds");
  const schedule::CheckpointPlan greedy = schedule::solve_checkpointing(prob);
  if (greedy.feasible) {
    expect(got.feasible, "solve_checkpointing_milp: infeasible where the greedy is feasible");
    expect(got.layers_recomputed <= greedy.layers_recomputed, "solve_checkpointing_milp: worse than the greedy");
  }
  ++g_counts.milp_solved;
}
#endif

// train::shard (with the batch), shard_rows and token_meta on random ranks, rows and plans: the rows
// named, or std::invalid_argument (decided here).
void train_case(std::mt19937& rng) {
  const DocumentBatch batch = random_batch(rng);
  const std::int64_t n = batch.total_tokens();
  const int world = 1 + pick(rng, 4);
  using Z = Strategy<partition::Zigzag, comm::AllToAll>;
  const Z::Planned planned = Z::plan({}, batch, {2, 2, 8}, Topology{world, world});
  if (!planned.status) return;
  const ShardPlan& plan = planned.plan;
  // A batch of the same tokens with the documents rotated (maybe the same batch).
  std::vector<std::vector<std::int64_t>> seqs;
  for (int s = 0; s < batch.num_sequences(); ++s) {
    seqs.emplace_back();
    for (const Document& d : batch.documents())
      if (d.sequence == s) seqs.back().push_back(d.tokens.size());
    if (pick(rng, 2) == 0) std::rotate(seqs.back().begin(), seqs.back().begin() + 1, seqs.back().end());
  }
  const DocumentBatch other(seqs);
  const int rank = pick(rng, world + 2) - 1;
  const std::int64_t rows = n + (pick(rng, 4) == 0 ? (rng() % 2 ? 1 : -1) : 0);
  ThdTensor<double> global(rows, 2, 3);
  for (std::size_t i = 0; i < global.storage.size(); ++i) global.storage[i] = static_cast<double>(i);
  const bool rank_ok = rank >= 0 && rank < world;
  const std::int64_t local_rows = rank_ok ? plan.local_tokens(rank) + (pick(rng, 5) == 0 ? 1 : 0) : 1;
  ThdTensor<float> local(local_rows, 2, 3);
  const bool ok = rank_ok && rows == n && local_rows == plan.local_tokens(rank) && other == batch;
  try {
    train::shard(other, plan, rank, std::as_const(global).view(), local.view());
    expect(ok, "train::shard accepted a bad rank, a tensor of other rows or a plan of another batch");
  } catch (const std::invalid_argument&) {
    expect(!ok, "train::shard refused a valid call");
  }
  ++(ok ? g_counts.train_ok : g_counts.train_refused);
  if (ok) {
    std::int64_t at = 0;
    for (const Range& r : plan.owned[static_cast<std::size_t>(rank)])
      for (std::int64_t t = r.begin; t < r.end; ++t, ++at)
        for (int h = 0; h < 2; ++h)
          for (int x = 0; x < 3; ++x)
            expect(local.view()(at, h, x) == static_cast<float>(global.view()(t, h, x)), "train::shard: wrong row");
  }
  // Random ranges (also negative, reversed, past the end) through shard_rows and token_meta.
  std::vector<Range> ranges(static_cast<std::size_t>(pick(rng, 4)));
  bool ranges_ok = true;
  std::int64_t count = 0;
  for (Range& r : ranges) {
    r.begin = static_cast<std::int64_t>(pick(rng, n + 4)) - 2;
    r.end = pick(rng, 6) == 0 ? r.begin - 1 : r.begin + pick(rng, std::max<std::int64_t>(n - r.begin + 3, 1));
    ranges_ok = ranges_ok && r.begin >= 0 && r.begin <= r.end && r.end <= n;
    count += std::max<std::int64_t>(r.end - r.begin, 0);
  }
  ThdTensor<double> picked(ranges_ok ? count : 0, 2, 3), exact(n, 2, 3);
  exact.storage = std::vector<double>(global.storage.begin(),
                                      global.storage.begin() + static_cast<std::ptrdiff_t>(std::min(rows, n) * 6));
  exact.storage.resize(static_cast<std::size_t>(n * 6));
  try {
    train::shard_rows(std::span<const Range>(ranges), std::as_const(exact).view(), picked.view());
    expect(ranges_ok, "train::shard_rows accepted bad ranges");
  } catch (const std::invalid_argument&) {
    expect(!ranges_ok, "train::shard_rows refused valid ranges");
  }
  try {
    const train::TokenMeta meta = train::token_meta(batch, std::span<const Range>(ranges));
    expect(ranges_ok, "train::token_meta accepted bad ranges");
    expect(meta.rows() == count, "train::token_meta: row count");
    std::vector<std::int64_t> position(static_cast<std::size_t>(n)), doc(static_cast<std::size_t>(n));
    for (std::size_t d = 0; d < batch.documents().size(); ++d) {
      const Range r = batch.documents()[d].tokens;
      for (std::int64_t t = r.begin; t < r.end; ++t)
        position[static_cast<std::size_t>(t)] = t - r.begin,
        doc[static_cast<std::size_t>(t)] = static_cast<std::int64_t>(d);
    }
    std::int64_t at = 0;
    for (const Range& r : ranges)
      for (std::int64_t t = r.begin; t < r.end; ++t, ++at) {
        const auto i = static_cast<std::size_t>(at), g = static_cast<std::size_t>(t);
        expect(meta.global_index[i] == t && meta.position[i] == position[g] && meta.document[i] == doc[g],
               "train::token_meta: wrong position or document");
        expect(picked.view()(at, 1, 2) == exact.view()(t, 1, 2), "train::shard_rows: wrong row");
      }
  } catch (const std::invalid_argument&) {
    expect(!ranges_ok, "train::token_meta refused valid ranges");
  }
}

// Issue 40: windows (also huge), sinks (also -inf, also out of sync on one rank), value head sizes, and a
// schedule kept from another batch's chunk plan. Exact, or refused by name on every rank.
void replicated_case(std::mt19937& rng) {
  using S = Strategy<partition::Zigzag, comm::Ring>;
  using K = attention::Reference<double>;
  const DocumentBatch batch = random_batch(rng);
  const int world = 1 + pick(rng, 3);
  const int hkv = 1 + pick(rng, 2);
  const int widths[] = {8, 4, 12};
  const AttentionShape shape{hkv * (1 + pick(rng, 2)), hkv, 8, 0.0, widths[pick(rng, 3)]};
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::int64_t windows[] = {0, 1 + pick(rng, 12), kMax - pick(rng, 3), (std::int64_t{1} << 62) + pick(rng, 999)};
  const AttentionMask mask{windows[pick(rng, 4)]};
  const int sink_kind = pick(rng, 4);  // 0 none, 1 finite, 2 some heads -inf, 3 one rank's out of sync
  std::vector<double> sinks;
  std::normal_distribution<double> normal(0.0, 2.0);
  if (sink_kind != 0) {
    for (int h = 0; h < shape.heads_q; ++h) sinks.push_back(normal(rng));
    if (sink_kind == 2) sinks[static_cast<std::size_t>(pick(rng, shape.heads_q))] = -INFINITY;
  }
  const std::uint32_t seed = rng();
  const test::AttentionFactory<K> make = [&](backend::inproc::Transport& t) {
    return std::unique_ptr<runtime::AttentionEngine<K>>(std::make_unique<DistributedAttention<S, K>>(t, shape));
  };
  if (sink_kind == 3 && world > 1) {
    const int odd = pick(rng, world);
    std::vector<std::string> errors;
    const std::vector<int> kinds = run_ranks(
        world,
        [&](backend::inproc::Transport& t) {
          DistributedAttention<S, K> attn(t, shape);
          const std::int64_t n = attn.local_tokens(batch);
          AttentionTensors<double> l(n, shape);
          std::vector<double> mine = sinks;
          if (t.rank() == odd) mine[0] = std::nextafter(mine[0], INFINITY);  // a parameter one update behind
          attn.forward(batch, mask, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), mine);
        },
        errors);
    for (int r = 0; r < world; ++r)
      expect(
          kinds[static_cast<std::size_t>(r)] == 3 &&
              errors[static_cast<std::size_t>(r)].find("disagree on the attention sinks' values") != std::string::npos,
          "sinks out of sync on rank " + std::to_string(odd) + ": rank " + std::to_string(r) + " got " +
              errors[static_cast<std::size_t>(r)]);
    ++g_counts.replicated_refused;
  } else if (S::can_implement({}, batch, shape, Topology{world, world}).ok) {
    const test::Errors e = test::distributed_check<K>({batch, mask}, shape, world, make, seed, sinks);
    expect(e.max() < 1e-9, "replicated_case: window " + std::to_string(mask.window) + ", sinks " +
                               std::to_string(sink_kind) + ", head_dim_v " + std::to_string(shape.v_dim()) +
                               ": error " + std::to_string(e.max()));
    ++g_counts.replicated_exact;
  }
  // A DPP schedule grouped from a chunk plan of this batch or of another of the same tokens (documents
  // rotated): run only with its own plan, refused by name with another.
  std::vector<std::vector<std::int64_t>> seqs;
  for (int s = 0; s < batch.num_sequences(); ++s) {
    seqs.emplace_back();
    for (const Document& d : batch.documents())
      if (d.sequence == s) seqs.back().push_back(d.tokens.size());
    if (pick(rng, 2) == 0) std::rotate(seqs.back().begin(), seqs.back().begin() + 1, seqs.back().end());
  }
  const DocumentBatch other(seqs);
  const schedule::DynamicChunk chunker{
      {.token_capacity = 8 + pick(rng, 16), .time_target = 0, .slices = 0, .cost = {}}};
  const schedule::PipelineModel model{.stages = 1 + pick(rng, 3),
                                      .layers_per_stage = 2,
                                      .static_bytes = 0,
                                      .memory_cap = 1e12,
                                      .activation_bytes_per_token = 10,
                                      .kept_bytes_per_token = 2,
                                      .seconds_per_cost = 1e-9};
  const schedule::ChunkPlan plan = chunker.plan(batch), kept = chunker.plan(other);
  const schedule::PipelineSchedule grouped = schedule::group_pipelines(kept, model);
  const bool same = kept.fingerprint() == plan.fingerprint();
  expect(same == (other == batch), "replicated_case: a chunk plan's fingerprint does not follow its batch");
  try {
    schedule::validate_schedule(plan, grouped, model.stages, model.layers_per_stage, "fuzz");
    expect(same, "validate_schedule accepted the schedule of another batch's chunk plan");
  } catch (const std::invalid_argument& e) {
    expect(!same && std::string(e.what()).find("fuzz: schedule.plan_fingerprint = ") != std::string::npos,
           std::string("validate_schedule: ") + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const test::FuzzRun run = test::run_fuzz(argc, argv, [](std::mt19937& rng) {
    batch_case(rng);
    kernel_case(rng);
    switch (pick(rng, 3)) {
      case 0:
        distributed_case<Strategy<partition::Zigzag, comm::Ring>>(rng, "Zigzag x Ring");
        break;
      case 1:
        distributed_case<Strategy<partition::Uniform, comm::AllToAll>>(rng, "Uniform x AllToAll");
        break;
      default:
        distributed_case<Strategy<partition::PerDoc, comm::AllGather>>(rng, "PerDoc x AllGather");
        break;
    }
    planner_case(rng);  // the replayed seeds (CMakeLists) still draw the cases they were kept for
    chunked_case(rng);  // the cases added since draw after them
#ifdef SEQPAR_FUZZ_GLPK
    milp_case(rng);
#endif
    train_case(rng);
    replicated_case(rng);
  });
  if (run.status != 0) return run.status;
  std::printf("fuzz_api: %ld cases (batch, kernel, distributed, planner, chunked, milp, train) in %.0f s (%s)\n",
              run.cases, run.seconds, run.seeds().c_str());
  std::printf(
      "fuzz_api: chunked %ld exact / %ld refused as expected; milp %ld solved / %ld refused; train::shard %ld "
      "exact / %ld refused; replicated %ld exact / %ld refused\n",
      g_counts.chunked_exact, g_counts.chunked_refused, g_counts.milp_solved, g_counts.milp_refused, g_counts.train_ok,
      g_counts.train_refused, g_counts.replicated_exact, g_counts.replicated_refused);
  return 0;
}
