// SPDX-License-Identifier: Apache-2.0
// executor_overhead: what DistributedAttention costs on top of the attention it runs. The same work
// (one packed sequence of a document-causal mix, 32K tokens, GQA 32:8, head_dim 128, fp32) is timed
//  (a) as one attention::CpuFlash<float> call over the whole batch on `--threads` (2) threads, and
//  (b) through DistributedAttention on 2, 4 and 8 in-process ranks with Ulysses (Uniform x AllToAll),
//      zigzag ring (Zigzag x Ring, plain and sharding-aware) and FlashCP's Hybrid x AllGather
//      (sharding-aware),
// for the forward pass alone and for forward + backward. Per row: the median over `--reps`
// repetitions (after `--warmup` calls), the ratio b / a, GFLOP/s (4 * d * Hq * visible pairs forward,
// 2.5x that backward) and the heap allocations of one steady-state call (a call on a batch whose plan
// is already cached), counted by the operator new replacement below and reported as the maximum over
// ranks and repetitions. The goal, printed beside each row: ratio <= 1.15 at 2 ranks, <= 1.3 at
// 8 ranks, and no allocation.
// The dpp-chunked cases (DPP): a long-tail batch of the same size (one document of 3/8 of the tokens, one
// of 1/8, short ones) cut by DynamicChunk (capacity --chunk-tokens, default tokens / 5) into chunks with
// split documents, run through runtime::ChunkedAttention over Ulysses or the zigzag ring, beside the
// unchunked run of the same batch on the same ranks: ratio chunked / unchunked, heap allocations of a
// pass (goal 0), and the prefix bytes the transport counted (the carry runs on a transport of its own)
// against those the carry's programs declare (goal: equal).
// Timing: in each repetition the ranks leave a barrier, run forward, meet at a second barrier and run
// backward; the fwd row is the forward's span (first rank's start to last rank's end: steady_clock is
// one clock for every thread of the process), the fwd+bwd row the sum of both spans. The baseline runs
// forward and backward back to back.
//   usage: executor_overhead [--smoke] [--json FILE] [--reps N] [--warmup N] [--threads N] [--tokens N]
//                            [--ranks a,b,c] [--cases a,b] [--chunk-tokens N]
#include <seqpar/backend/inproc/world.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/json.hpp"

// ---- allocation counting ---------------------------------------------------------------------------
// Every operator new of the program comes here. A thread-local count makes each in-process rank's
// allocations its own (a rank is one thread, and its kernel runs inline at one thread per rank); the
// process-wide count covers the whole-batch baseline, whose kernel allocates, if at all, on pool workers.
namespace {
std::atomic<std::uint64_t> process_allocations{0};
thread_local std::uint64_t thread_allocations = 0;  // constant-initialised: safe inside operator new

void note_allocation() noexcept {
  ++thread_allocations;
  process_allocations.fetch_add(1, std::memory_order_relaxed);
}

void* allocate(std::size_t n, std::size_t alignment) noexcept {
  note_allocation();
  if (n == 0) n = 1;
  if (alignment <= alignof(std::max_align_t)) return std::malloc(n);
  void* p = nullptr;
  return posix_memalign(&p, alignment, n) == 0 ? p : nullptr;
}

void* allocate_or_throw(std::size_t n, std::size_t alignment) {
  if (void* p = allocate(n, alignment)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) {
  return allocate_or_throw(n, 0);
}
void* operator new[](std::size_t n) {
  return allocate_or_throw(n, 0);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return allocate(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return allocate(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a));
}
// malloc and posix_memalign memory are both released by free.
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}

using namespace seqpar;
using Clock = std::chrono::steady_clock;

namespace {

using Kernel = attention::CpuFlash<float>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
using HybridAllGather = Strategy<partition::Hybrid, comm::AllGather>;

struct Config {
  bool smoke = false;
  int reps = 5, warmup = 1;
  int threads = 2;  // compute threads of the whole run: the baseline's, and shared by the ranks
  std::int64_t tokens = 32768;
  AttentionShape shape{32, 8, 128};
  std::vector<int> ranks{2, 4, 8};
  std::vector<std::string> cases = all_cases();
  std::int64_t chunk_tokens = 0;  // DynamicChunk's token capacity for the dpp-chunked cases (0: tokens / 5)
  static std::vector<std::string> all_cases() {
    return {"ulysses",
            "zigzag-ring",
            "zigzag-ring-sharding-aware",
            "hybrid-allgather-sharding-aware",
            "dpp-chunked-ulysses",
            "dpp-chunked-zigzag-ring"};
  }
  [[nodiscard]] static bool chunked(const std::string& name) { return name.rfind("dpp-chunked-", 0) == 0; }
};

// One sequence of `tokens` tokens: a few long documents (two of tokens/32 and two of tokens/64, 3/32
// of the tokens but a third of the visible pairs) and many short ones (16 to tokens/128 tokens), in a
// shuffled order so that long documents straddle rank boundaries. Sized so that the whole run (13
// configurations x (warm-up + reps) forward and backward calls) takes about 20 minutes on 2 cores: the
// machine is shared, and a longer run sees more of other people's load (or split it with --ranks).
// Drawn with mt19937_64's raw output (fixed by the standard, unlike the distributions), so the mix is
// the same with every standard library.
std::vector<std::int64_t> document_mix(std::int64_t tokens) {
  std::mt19937_64 rng(20260514);
  std::vector<std::int64_t> docs;
  std::int64_t left = tokens;
  for (std::int64_t len : {tokens / 32, tokens / 32, tokens / 64, tokens / 64})
    if (len >= 1 && len <= left) docs.push_back(len), left -= len;
  const std::int64_t shortest = 16, longest = std::max<std::int64_t>(shortest, tokens / 128);
  while (left > 0) {
    const std::int64_t len = shortest + static_cast<std::int64_t>(rng() % std::uint64_t(longest - shortest + 1));
    docs.push_back(std::min(len, left));
    left -= docs.back();
  }
  for (std::size_t i = docs.size() - 1; i > 0; --i) std::swap(docs[i], docs[rng() % (i + 1)]);
  return docs;
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// 1-minute load average (the machine is shared: a loaded run reads slower), NaN where unavailable.
double load_average() {
  std::ifstream f("/proc/loadavg");
  double load = std::numeric_limits<double>::quiet_NaN();
  f >> load;
  return load;
}

template <class T>
bool all_finite(const std::vector<T>& v) {
  return std::all_of(v.begin(), v.end(), [](T x) { return std::isfinite(x); });
}

// Inputs are a function of (tensor, global token, head, dim), uniform in [-2, 2): the baseline and
// every rank fill their own rows, and no copy of the whole batch is kept (at 32K tokens Q alone is
// 0.5 GB, and the machine is shared). The kernel's speed does not depend on the values.
enum class Input : std::uint64_t { kQ = 1, kK, kV, kDout };

// Fills `t`, whose local rows are the global rows `owned` in order, with input `which`.
void fill_rows(ThdTensor<float>& t, Input which, const std::vector<Range>& owned) {
  const std::int64_t row = std::int64_t{t.heads} * t.head_dim;
  float* out = t.storage.data();
  for (const Range& r : owned)
    for (std::int64_t i = r.begin * row; i < r.end * row; ++i) {
      // splitmix64 of the element's global index, tagged with the tensor
      std::uint64_t z = (static_cast<std::uint64_t>(which) << 56) + static_cast<std::uint64_t>(i);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      *out++ = float(z >> 40) * 0x1p-22f - 2.f;
    }
}

// The dpp-chunked cases' batch: one sequence of `tokens` tokens with a long tail, one document of 3/8 of
// the tokens and one of 1/8 (DynamicChunk splits them across chunks, so the KV prefix moves) among short
// ones (16 to tokens/128 tokens), shuffled. Drawn like document_mix.
std::vector<std::int64_t> long_tail_mix(std::int64_t tokens) {
  std::mt19937_64 rng(20261204);
  std::vector<std::int64_t> docs;
  std::int64_t left = tokens;
  for (std::int64_t len : {tokens * 3 / 8, tokens / 8})
    if (len >= 1 && len <= left) docs.push_back(len), left -= len;
  const std::int64_t shortest = 16, longest = std::max<std::int64_t>(shortest, tokens / 128);
  while (left > 0) {
    const std::int64_t len = shortest + static_cast<std::int64_t>(rng() % std::uint64_t(longest - shortest + 1));
    docs.push_back(std::min(len, left));
    left -= docs.back();
  }
  for (std::size_t i = docs.size() - 1; i > 0; --i) std::swap(docs[i], docs[rng() % (i + 1)]);
  return docs;
}

// The batch every case runs, and the baseline's O on every kSampleStride-th token (all heads): the
// reference the ranks' O is compared with.
struct Batch {
  static constexpr std::int64_t kSampleStride = 16;
  DocumentBatch documents;
  std::int64_t area = 0;  // visible (query, key) pairs
  std::vector<float> o_sample;
  explicit Batch(const DocumentBatch& batch) : documents(batch), area(total_area(batch.document_causal_slices())) {}
};

struct Row {
  std::string name{};  // "cpu-flash" for the baseline
  int ranks = 1, threads_per_rank = 0;
  std::string pass{};  // "fwd" | "fwd+bwd"
  std::vector<double> seconds{};
  std::uint64_t allocations = 0;  // per call, max over ranks and repetitions
  double max_abs_diff_o = 0;      // against the baseline's O
  double load = 0;
  bool finite = true;
  double ratio = 1, gflops = 0, goal_ratio = 0;
  // dpp-chunked rows: ratio is chunked / unchunked (the same strategy on the same batch and ranks); the
  // goal is no allocation and prefix bytes counted by the transport = declared by the carry's programs.
  bool chunked = false;
  int chunks = 0;
  std::uint64_t prefix_bytes_counted = 0, prefix_bytes_declared = 0;  // summed over ranks, one fwd+bwd pass
  bool declared_known = false;  // the runtime declares its prefix bytes (not the hand-run carry of before)
  [[nodiscard]] bool baseline() const { return ranks == 1 && name.rfind("cpu-flash", 0) == 0; }
  [[nodiscard]] bool goal_met() const {
    if (chunked) return allocations == 0 && declared_known && prefix_bytes_counted == prefix_bytes_declared;
    return baseline() || (ratio <= goal_ratio && allocations == 0);
  }
};

// The issue sets 1.15 at 2 ranks and 1.3 at 8; 4 ranks are held to the 8-rank bound, since they too
// share the 2 cores between more threads than cores and pay more communication steps than 2.
double goal_ratio(int ranks) {
  return ranks <= 2 ? 1.15 : 1.3;
}

// (a): one CpuFlash call over the whole batch. Fills batch.o_sample.
std::vector<Row> run_baseline(Batch& batch, const Config& c) {
  const AttentionShape& shape = c.shape;
  const int d = shape.head_dim;
  const std::int64_t n = batch.documents.total_tokens();
  const std::vector<Range> all{{0, n}};
  const std::vector<AttnSlice> slices = batch.documents.document_causal_slices();
  const Kernel flash({.threads = c.threads});
  std::vector<std::byte> ws(flash.workspace_bytes(shape, n, n));
  ThdTensor<float> q(n, shape.heads_q, d), k(n, shape.heads_kv, d), v(n, shape.heads_kv, d), dout(n, shape.heads_q, d),
      o(n, shape.heads_q, d), dq(n, shape.heads_q, d), dk(n, shape.heads_kv, d), dv(n, shape.heads_kv, d);
  LseTensor<float> lse(shape.heads_q, n);
  fill_rows(q, Input::kQ, all), fill_rows(k, Input::kK, all), fill_rows(v, Input::kV, all);
  fill_rows(dout, Input::kDout, all);
  const auto forward = [&] { flash.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws); };
  // CpuFlash adds into dQ, dK, dV; zeroing them belongs to the call (DistributedAttention's backward
  // overwrites its outputs, zeroing included), so it is timed.
  const auto backward = [&] {
    for (auto* t : {&dq, &dk, &dv}) std::fill(t->storage.begin(), t->storage.end(), 0.f);
    flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(), dk.view(),
                   dv.view(), ws);
  };
  Row fwd{.name = "cpu-flash", .ranks = 1, .threads_per_rank = c.threads, .pass = "fwd"};
  Row both{.name = "cpu-flash", .ranks = 1, .threads_per_rank = c.threads, .pass = "fwd+bwd"};
  for (int i = 0; i < c.warmup; ++i) {
    forward();
    backward();
  }
  for (int rep = 0; rep < c.reps; ++rep) {
    const std::uint64_t a0 = process_allocations.load();
    const auto t0 = Clock::now();
    forward();
    const auto t1 = Clock::now();
    const std::uint64_t a1 = process_allocations.load();
    backward();
    const auto t2 = Clock::now();
    const std::uint64_t a2 = process_allocations.load();
    fwd.seconds.push_back(seconds_between(t0, t1));
    both.seconds.push_back(seconds_between(t0, t2));
    fwd.allocations = std::max(fwd.allocations, a1 - a0);
    both.allocations = std::max(both.allocations, a2 - a0);
  }
  fwd.load = both.load = load_average();
  fwd.finite = all_finite(o.storage) && all_finite(lse.storage);
  both.finite = fwd.finite && all_finite(dq.storage) && all_finite(dk.storage) && all_finite(dv.storage);
  const std::int64_t row = std::int64_t{shape.heads_q} * d;
  for (std::int64_t t = 0; t < n; t += Batch::kSampleStride)
    batch.o_sample.insert(batch.o_sample.end(), o.storage.begin() + t * row, o.storage.begin() + (t + 1) * row);
  return {fwd, both};
}

// What one rank saw: per repetition the start and end of its forward and of its backward, and the
// allocations of its forward and of both.
struct RankTimes {
  std::vector<Clock::time_point> forward_start, forward_end, backward_start, backward_end;
  std::vector<std::uint64_t> forward_allocations, allocations;
  double max_abs_diff_o = 0;
  bool finite = true;
};

// Per rank, the repetitions' records, preallocated so that recording one allocates nothing on the rank's thread.
std::vector<RankTimes> rank_times(int ranks, int reps) {
  std::vector<RankTimes> times(static_cast<std::size_t>(ranks));
  for (RankTimes& r : times) {
    const auto n = static_cast<std::size_t>(reps);
    r.forward_start.resize(n), r.forward_end.resize(n), r.backward_start.resize(n), r.backward_end.resize(n);
    r.forward_allocations.resize(n), r.allocations.resize(n);
  }
  return times;
}

// Largest |O - the whole-batch kernel's O| over the sampled tokens of `o`, whose rows are the global
// rows `owned` in order.
double o_difference(const ThdTensor<float>& o, const std::vector<Range>& owned, const Batch& batch) {
  const std::int64_t row = std::int64_t{o.heads} * o.head_dim;
  double diff = 0;
  std::int64_t at = 0;
  for (const Range& r : owned) {
    for (std::int64_t t = r.begin; t < r.end; ++t)
      if (t % Batch::kSampleStride == 0) {
        const float* mine_o = o.storage.data() + (at + t - r.begin) * row;
        const float* whole_o = batch.o_sample.data() + t / Batch::kSampleStride * row;
        for (std::int64_t i = 0; i < row; ++i) diff = std::max<double>(diff, std::abs(mine_o[i] - whole_o[i]));
      }
    at += r.size();
  }
  return diff;
}

// The fwd and fwd+bwd rows of what the ranks recorded: per repetition the forward's span (first rank's
// start to last rank's end) and that plus the backward's, allocations the most of any rank.
std::vector<Row> rows_of(const std::vector<RankTimes>& times, const std::string& name, int ranks, int kernel_threads,
                         int reps) {
  Row fwd{.name = name, .ranks = ranks, .threads_per_rank = kernel_threads, .pass = "fwd"};
  Row both{.name = name, .ranks = ranks, .threads_per_rank = kernel_threads, .pass = "fwd+bwd"};
  const auto span = [&](auto start, auto end, std::size_t i) {
    Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
    for (const RankTimes& r : times) first = std::min(first, (r.*start)[i]), last = std::max(last, (r.*end)[i]);
    return seconds_between(first, last);
  };
  for (std::size_t i = 0; i < static_cast<std::size_t>(reps); ++i) {
    const double f = span(&RankTimes::forward_start, &RankTimes::forward_end, i);
    fwd.seconds.push_back(f);
    both.seconds.push_back(f + span(&RankTimes::backward_start, &RankTimes::backward_end, i));
    for (const RankTimes& r : times) {
      fwd.allocations = std::max(fwd.allocations, r.forward_allocations[i]);
      both.allocations = std::max(both.allocations, r.allocations[i]);
    }
  }
  for (Row* row : {&fwd, &both}) {
    for (const RankTimes& r : times) {
      row->finite = row->finite && r.finite;
      row->max_abs_diff_o = std::max(row->max_abs_diff_o, r.max_abs_diff_o);
    }
    row->load = load_average();
    row->goal_ratio = goal_ratio(ranks);
  }
  return {fwd, both};
}

// (b): strategy S on `ranks` in-process ranks. Returns the fwd and fwd+bwd rows.
template <class S>
std::vector<Row> run_distributed(const std::string& name, typename S::Arguments args, int ranks, const Batch& batch,
                                 const Config& c) {
  const AttentionShape& shape = c.shape;
  const int d = shape.head_dim;
  // The in-process ranks are threads of this process, so the ranks' kernel threads add up: the
  // baseline's `threads` (2, the machine's cores) split among the ranks, at least one each. From 2
  // ranks up that is one thread per rank, run inline by the rank itself (no pool), and 4 or 8 ranks
  // share the 2 cores by time slicing: the ratio there includes the cost of oversubscription.
  const int kernel_threads = std::max(1, c.threads / ranks);
  std::vector<RankTimes> times = rank_times(ranks, c.reps);
  backend::inproc::World(ranks).run([&](auto& transport) {
    DistributedAttention<S, Kernel> attn(transport, shape, args, Kernel({.threads = kernel_threads}));
    const DocumentBatch& b = batch.documents;
    const std::vector<Range> owned = attn.owned_ranges(b);
    const std::int64_t n = attn.local_tokens(b);
    // The local shard: the owned global rows, in plan order (several chunks under zigzag or hybrid).
    ThdTensor<float> q(n, shape.heads_q, d), k(n, shape.heads_kv, d), v(n, shape.heads_kv, d),
        dout(n, shape.heads_q, d), o(n, shape.heads_q, d), dq(n, shape.heads_q, d), dk(n, shape.heads_kv, d),
        dv(n, shape.heads_kv, d);
    fill_rows(q, Input::kQ, owned), fill_rows(k, Input::kK, owned), fill_rows(v, Input::kV, owned);
    fill_rows(dout, Input::kDout, owned);
    LseTensor<float> lse(shape.heads_q, n);
    const auto forward = [&] { attn.forward(b, q.view(), k.view(), v.view(), o.view(), lse.view()); };
    const auto backward = [&] {
      attn.backward(b, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                    dv.view());
    };
    RankTimes& mine = times[static_cast<std::size_t>(transport.rank())];
    // The first call plans, compiles and sizes the workspace; later ones are the steady state.
    for (int i = 0; i < c.warmup; ++i) {
      forward();
      backward();
    }
    // The barrier between forward and backward keeps a rank that finished its forward early from
    // taking a core from ranks still in theirs (4 and 8 ranks share 2 cores), which would lengthen the
    // forward's span; fwd+bwd is then the sum of the two spans.
    for (int rep = 0; rep < c.reps; ++rep) {
      const auto i = static_cast<std::size_t>(rep);
      transport.barrier();
      const std::uint64_t a0 = thread_allocations;
      mine.forward_start[i] = Clock::now();
      forward();
      mine.forward_end[i] = Clock::now();
      const std::uint64_t a1 = thread_allocations;
      transport.barrier();
      const std::uint64_t a2 = thread_allocations;
      mine.backward_start[i] = Clock::now();
      backward();
      mine.backward_end[i] = Clock::now();
      mine.forward_allocations[i] = a1 - a0;
      mine.allocations[i] = (a1 - a0) + (thread_allocations - a2);
    }
    // Sanity: every output finite, and O the same as the whole-batch kernel's (up to fp32 rounding).
    mine.finite = all_finite(o.storage) && all_finite(lse.storage) && all_finite(dq.storage) &&
                  all_finite(dk.storage) && all_finite(dv.storage);
    mine.max_abs_diff_o = o_difference(o, owned, batch);
  });
  return rows_of(times, name, ranks, kernel_threads, c.reps);
}

// The dpp-chunked cases: the batch cut into `chunks`, run chunk by chunk through ChunkedAttention over
// strategy S on `ranks` in-process ranks (every forward, then every backward in reverse; each pass
// begins on the same chunks, so the plans and the carry's programs are cached). Timed and counted as
// run_distributed does; also the prefix bytes the transport counted (its bytes less the strategy's) and
// those the carry's programs declare. `Chunked` is a parameter so that the rows build against a runtime
// that does not declare them (the comparison with the hand-run carry this replaced).
template <class S, class Chunked = runtime::ChunkedAttention<Kernel>>
std::vector<Row> run_chunked(const std::string& name, typename S::Arguments args, int ranks, const Batch& batch,
                             const std::vector<schedule::Chunk>& chunks, const Config& c) {
  const AttentionShape& shape = c.shape;
  const int d = shape.head_dim;
  const int kernel_threads = std::max(1, c.threads / ranks);
  std::vector<RankTimes> times = rank_times(ranks, c.reps);
  std::vector<std::uint64_t> counted(static_cast<std::size_t>(ranks)), declared(static_cast<std::size_t>(ranks));
  bool declares = false;
  backend::inproc::World(ranks).run([&](auto& transport) {
    DistributedAttention<S, Kernel> attn(transport, shape, args, Kernel({.threads = kernel_threads}));
    // The carry runs on the attention's transport and kernel; its bytes are the prefix program's, as the
    // runtime counts them around the program's run (apart from the call's agreement and the strategy's).
    Chunked chunked(attn);
    chunked.begin(chunks);
    const int nc = chunked.num_chunks();
    struct Local {
      ThdTensor<float> q, k, v, dout, o, dq, dk, dv;
      LseTensor<float> lse;
    };
    std::vector<Local> loc;
    for (int ch = 0; ch < nc; ++ch) {
      const std::int64_t n = chunked.local_tokens(ch);
      loc.push_back({ThdTensor<float>(n, shape.heads_q, d), ThdTensor<float>(n, shape.heads_kv, d),
                     ThdTensor<float>(n, shape.heads_kv, d), ThdTensor<float>(n, shape.heads_q, d),
                     ThdTensor<float>(n, shape.heads_q, d), ThdTensor<float>(n, shape.heads_q, d),
                     ThdTensor<float>(n, shape.heads_kv, d), ThdTensor<float>(n, shape.heads_kv, d),
                     LseTensor<float>(shape.heads_q, n)});
      const auto& owned = chunked.owned_global(ch);
      fill_rows(loc.back().q, Input::kQ, owned), fill_rows(loc.back().k, Input::kK, owned);
      fill_rows(loc.back().v, Input::kV, owned), fill_rows(loc.back().dout, Input::kDout, owned);
    }
    // begin takes its chunks by value: the copies are made here, moved in inside the timed passes.
    std::vector<std::vector<schedule::Chunk>> copies(static_cast<std::size_t>(c.warmup + c.reps), chunks);
    std::uint64_t prefix_bytes = 0, declared_bytes = 0;
    const auto forward = [&] {
      for (int ch = 0; ch < nc; ++ch) {
        Local& l = loc[static_cast<std::size_t>(ch)];
        chunked.forward(ch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        prefix_bytes += chunked.last_bytes_sent();
        if constexpr (requires(Chunked & x) { x.program(0, 0); })
          declared_bytes += chunked.program(ch, 0).bytes_sent(sizeof(float), sizeof(float));
      }
    };
    const auto backward = [&] {
      for (int ch = nc - 1; ch >= 0; --ch) {
        Local& l = loc[static_cast<std::size_t>(ch)];
        chunked.backward(ch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                         l.dk.view(), l.dv.view());
        prefix_bytes += chunked.last_bytes_sent();
        if constexpr (requires(Chunked & x) { x.program(0, 0); })
          declared_bytes += chunked.program(ch, 2).bytes_sent(sizeof(float), sizeof(float));
      }
    };
    RankTimes& mine = times[static_cast<std::size_t>(transport.rank())];
    std::size_t next = 0;
    for (int i = 0; i < c.warmup; ++i) {
      chunked.begin(std::move(copies[next++]));
      forward();
      backward();
    }
    for (int rep = 0; rep < c.reps; ++rep) {
      const auto i = static_cast<std::size_t>(rep);
      transport.barrier();
      prefix_bytes = declared_bytes = 0;  // what the last pass moved
      const std::uint64_t a0 = thread_allocations;
      mine.forward_start[i] = Clock::now();
      chunked.begin(std::move(copies[next++]));
      forward();
      mine.forward_end[i] = Clock::now();
      const std::uint64_t a1 = thread_allocations;
      transport.barrier();
      const std::uint64_t a2 = thread_allocations;
      mine.backward_start[i] = Clock::now();
      backward();
      mine.backward_end[i] = Clock::now();
      mine.forward_allocations[i] = a1 - a0;
      mine.allocations[i] = (a1 - a0) + (thread_allocations - a2);
    }
    counted[static_cast<std::size_t>(transport.rank())] = prefix_bytes;
    declared[static_cast<std::size_t>(transport.rank())] = declared_bytes;
    if constexpr (requires(Chunked & x) { x.program(0, 0); }) declares = true;
    for (int ch = 0; ch < nc; ++ch) {
      const Local& l = loc[static_cast<std::size_t>(ch)];
      mine.finite = mine.finite && all_finite(l.o.storage) && all_finite(l.lse.storage) && all_finite(l.dq.storage) &&
                    all_finite(l.dk.storage) && all_finite(l.dv.storage);
      mine.max_abs_diff_o = std::max(mine.max_abs_diff_o, o_difference(l.o, chunked.owned_global(ch), batch));
    }
  });
  std::vector<Row> rows = rows_of(times, name, ranks, kernel_threads, c.reps);
  for (Row& row : rows) {
    row.goal_ratio = 0;
    row.chunked = true;
    row.chunks = static_cast<int>(chunks.size());
    row.declared_known = declares;
    for (std::size_t r = 0; r < counted.size(); ++r) {
      row.prefix_bytes_counted += counted[r];
      row.prefix_bytes_declared += declared[r];
    }
  }
  return rows;
}
// The strategy a dpp-chunked case runs over: its rows beside the unchunked run of the same batch.
std::vector<Row> run_chunked_case(const std::string& name, int ranks, const Batch& batch,
                                  const std::vector<schedule::Chunk>& chunks, const Config& c) {
  std::vector<Row> rows;
  const auto both = [&]<class S>(S*) {
    rows = run_distributed<S>(name + " unchunked", {}, ranks, batch, c);
    for (Row& r : run_chunked<S>(name, {}, ranks, batch, chunks, c)) rows.push_back(r);
  };
  if (name == "dpp-chunked-ulysses")
    both(static_cast<Ulysses*>(nullptr));
  else if (name == "dpp-chunked-zigzag-ring")
    both(static_cast<ZigzagRing*>(nullptr));
  else
    throw std::invalid_argument("executor_overhead: unknown case " + name);
  return rows;
}

std::vector<Row> run_case(const std::string& name, int ranks, const Batch& batch, const Config& c) {
  if (name == "ulysses") return run_distributed<Ulysses>(name, {}, ranks, batch, c);
  if (name == "zigzag-ring") return run_distributed<ZigzagRing>(name, {}, ranks, batch, c);
  if (name == "zigzag-ring-sharding-aware") {
    ZigzagRing::Arguments args;
    args.comm.sharding_aware = true;
    return run_distributed<ZigzagRing>(name, args, ranks, batch, c);
  }
  if (name == "hybrid-allgather-sharding-aware") {  // FlashCP: Hybrid placement, sharding-aware gather
    HybridAllGather::Arguments args;
    args.comm.sharding_aware = true;
    return run_distributed<HybridAllGather>(name, args, ranks, batch, c);
  }
  throw std::invalid_argument("executor_overhead: unknown case " + name);
}

constexpr const char* kHeader = "%-32s %5s %4s %-7s %9s %6s %8s %7s %9s %5s  %-23s %s\n";
constexpr const char* kLine = "%-32s %5d %4d %-7s %9.3f %6s %8.1f %7llu %9.1e %5.2f  %-23s %s\n";

// thr: kernel threads per rank; allocs: per call (max over ranks); diff O: max |O - baseline O| (sampled);
// load: 1-minute load average after the row (above the thread count: other processes shared the cores).
void print_header() {
  std::printf(kHeader, "case", "ranks", "thr", "pass", "seconds", "ratio", "GFLOP/s", "allocs", "diff O", "load",
              "goal", "met");
}

void print_row(const Row& r) {
  char ratio[16] = "-", goal[32] = "-";
  if (!r.baseline()) {
    std::snprintf(ratio, sizeof ratio, "%.3f", r.ratio);
    std::snprintf(goal, sizeof goal, "ratio <= %.2f, 0 allocs", r.goal_ratio);
  }
  std::printf(kLine, r.name.c_str(), r.ranks, r.threads_per_rank, r.pass.c_str(), median(r.seconds), ratio, r.gflops,
              static_cast<unsigned long long>(r.allocations), r.max_abs_diff_o, r.load, goal,
              r.baseline()   ? ""
              : r.goal_met() ? "yes"
                             : "NO");
  std::fflush(stdout);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      c.smoke = true;
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--reps" && i + 1 < argc) {
      c.reps = std::max(1, std::stoi(argv[++i]));
    } else if (a == "--warmup" && i + 1 < argc) {
      c.warmup = std::max(1, std::stoi(argv[++i]));  // >= 1: the first call is never steady state
    } else if (a == "--threads" && i + 1 < argc) {
      c.threads = std::max(1, std::stoi(argv[++i]));
    } else if (a == "--tokens" && i + 1 < argc) {
      c.tokens = std::stoll(argv[++i]);
    } else if (a == "--ranks" && i + 1 < argc) {
      c.ranks.clear();
      for (const std::string& x : split_list(argv[++i])) c.ranks.push_back(std::stoi(x));
    } else if (a == "--cases" && i + 1 < argc) {
      c.cases = split_list(argv[++i]);
    } else if (a == "--chunk-tokens" && i + 1 < argc) {
      c.chunk_tokens = std::max<std::int64_t>(1, std::stoll(argv[++i]));
    } else {
      std::fprintf(stderr,
                   "unknown argument %s\nusage: executor_overhead [--smoke] [--json FILE] [--reps N] [--warmup N] "
                   "[--threads N] [--tokens N] [--ranks a,b,c] [--cases a,b] [--chunk-tokens N]\n",
                   a.c_str());
      return 2;
    }
  }
  for (const std::string& name : c.cases)
    if (const auto all = Config::all_cases(); std::find(all.begin(), all.end(), name) == all.end()) {
      std::fprintf(stderr,
                   "unknown case %s (cases: ulysses, zigzag-ring, zigzag-ring-sharding-aware, "
                   "hybrid-allgather-sharding-aware, dpp-chunked-ulysses, dpp-chunked-zigzag-ring)\n",
                   name.c_str());
      return 2;
    }
  if (c.smoke) {  // every case and rank count, on a batch small enough for seconds (GQA kept at 4:1)
    c.tokens = 2048, c.shape = AttentionShape{8, 2, 64}, c.reps = 2;
  }

  const std::vector<std::int64_t> docs = document_mix(c.tokens);
  Batch batch(DocumentBatch::single(docs));
  const double fwd_flops = 4.0 * c.shape.head_dim * c.shape.heads_q * double(batch.area);
  std::printf(
      "executor_overhead: %lld tokens in %zu documents (longest %lld), %lld visible pairs, heads %d:%d, d %d, fp32; "
      "median of %d reps after %d warm-up call(s); %d compute thread(s); load average %.2f\n\n",
      static_cast<long long>(c.tokens), docs.size(),
      static_cast<long long>(*std::max_element(docs.begin(), docs.end())), static_cast<long long>(batch.area),
      c.shape.heads_q, c.shape.heads_kv, c.shape.head_dim, c.reps, c.warmup, c.threads, load_average());
  print_header();

  const auto finish = [&](Row& r, double baseline_seconds, double flops = 0) {
    const double s = median(r.seconds);
    r.ratio = s / baseline_seconds;
    r.gflops = (r.pass == "fwd" ? 1.0 : 3.5) * (flops > 0 ? flops : fwd_flops) / s * 1e-9;
    print_row(r);
  };
  // Rewritten after every case, so that a long run that is interrupted keeps the rows it measured.
  const auto write_rows = [&](const std::vector<Row>& rows) {
    if (json.empty()) return true;
    std::vector<bench::JsonRecord> records;
    for (const Row& r : rows) {
      const auto [lo, hi] = std::minmax_element(r.seconds.begin(), r.seconds.end());
      bench::JsonRecord j;
      j.add("case", r.name)
          .add("ranks", r.ranks)
          .add("threads_per_rank", r.threads_per_rank)
          .add("pass", r.pass)
          .add("tokens", c.tokens)
          .add("documents", docs.size())
          .add("heads_q", c.shape.heads_q)
          .add("heads_kv", c.shape.heads_kv)
          .add("head_dim", c.shape.head_dim)
          .add("reps", c.reps)
          .add("seconds", median(r.seconds))
          .add("seconds_min", *lo)
          .add("seconds_max", *hi)
          .add("ratio", r.ratio)
          .add("gflops", r.gflops)
          .add("allocations", r.allocations)
          .add("max_abs_diff_o", r.max_abs_diff_o)
          .add("load_average", r.load);
      if (r.chunked)
        j.add("chunks", r.chunks)
            .add("ratio_to", "unchunked")
            .add("prefix_bytes_counted", r.prefix_bytes_counted)
            .add("prefix_bytes_declared", r.prefix_bytes_declared)
            .add("declared_known", r.declared_known);
      if (r.chunked)
        j.add("goal", "0 allocations, prefix bytes counted = declared");
      else if (r.baseline())
        j.add("goal", "baseline");
      else
        j.add("goal_ratio", r.goal_ratio).add("goal_allocations", 0);
      j.add("goal_met", r.goal_met());
      records.push_back(j);
    }
    return bench::write_json(json, records);
  };
  std::vector<Row> rows = run_baseline(batch, c);
  const double base[2] = {median(rows[0].seconds), median(rows[1].seconds)};
  for (Row& r : rows) finish(r, base[r.pass == "fwd+bwd"]);
  if (!write_rows(rows)) return 1;
  try {
    for (int ranks : c.ranks)
      for (const std::string& name : c.cases) {
        if (Config::chunked(name)) continue;  // below, on their own batch
        for (Row& r : run_case(name, ranks, batch, c)) {
          finish(r, base[r.pass == "fwd+bwd"]);
          rows.push_back(r);
        }
        if (!write_rows(rows)) return 1;
      }
  } catch (const std::exception& e) {  // a strategy refused the batch, or a rank failed
    std::fprintf(stderr, "executor_overhead: %s\n", e.what());
    return 1;
  }

  // The dpp-chunked cases: a long-tail batch cut by DynamicChunk, its own whole-batch baseline (for O),
  // each strategy unchunked and chunked on the same ranks.
  if (std::any_of(c.cases.begin(), c.cases.end(), Config::chunked)) {
    const std::vector<std::int64_t> tail = long_tail_mix(c.tokens);
    Batch chunked_batch(DocumentBatch::single(tail));
    const std::int64_t capacity = c.chunk_tokens > 0 ? c.chunk_tokens : std::max<std::int64_t>(1, c.tokens / 5);
    const std::vector<schedule::Chunk> chunks =
        schedule::DynamicChunk{{.token_capacity = capacity, .time_target = 0, .slices = 0, .cost = {}}}.chunks(
            chunked_batch.documents);
    int split = 0;
    for (const schedule::Chunk& ch : chunks)
      for (const Range& p : ch.prefix) split += p.empty() ? 0 : 1;
    std::printf(
        "\ndpp-chunked: %lld tokens in %zu documents (longest %lld), cut by DynamicChunk (capacity %lld) into %zu "
        "chunks, %d piece(s) with a prefix; chunked rows: ratio = chunked / unchunked, prefix bytes summed over "
        "ranks for one fwd+bwd pass\n",
        static_cast<long long>(c.tokens), tail.size(),
        static_cast<long long>(*std::max_element(tail.begin(), tail.end())), static_cast<long long>(capacity),
        chunks.size(), split);
    print_header();
    const double tail_flops = 4.0 * c.shape.head_dim * c.shape.heads_q * double(chunked_batch.area);
    std::vector<Row> base_rows = run_baseline(chunked_batch, c);
    const double chunked_base[2] = {median(base_rows[0].seconds), median(base_rows[1].seconds)};
    for (Row& r : base_rows) {
      r.name = "cpu-flash (long tail)";
      finish(r, chunked_base[r.pass == "fwd+bwd"], tail_flops);
      rows.push_back(r);
    }
    try {
      for (int ranks : c.ranks)
        for (const std::string& name : c.cases) {
          if (!Config::chunked(name)) continue;
          std::vector<Row> got = run_chunked_case(name, ranks, chunked_batch, chunks, c);
          double unchunked[2] = {1, 1};
          for (Row& r : got) {
            if (!r.chunked) {
              finish(r, chunked_base[r.pass == "fwd+bwd"], tail_flops);
              unchunked[r.pass == "fwd+bwd"] = median(r.seconds);
            } else {
              r.ratio = median(r.seconds) / unchunked[r.pass == "fwd+bwd"];
              r.gflops = (r.pass == "fwd" ? 1.0 : 3.5) * tail_flops / median(r.seconds) * 1e-9;
              std::printf(
                  "%-32s %5d %4d %-7s %9.3f %6.3f %8.1f %7llu %9.1e %5.2f  prefix bytes %llu counted, %s declared  "
                  "%s\n",
                  r.name.c_str(), r.ranks, r.threads_per_rank, r.pass.c_str(), median(r.seconds), r.ratio, r.gflops,
                  static_cast<unsigned long long>(r.allocations), r.max_abs_diff_o, r.load,
                  static_cast<unsigned long long>(r.prefix_bytes_counted),
                  r.declared_known ? std::to_string(r.prefix_bytes_declared).c_str() : "not",
                  r.goal_met() ? "yes" : "NO");
              std::fflush(stdout);
            }
            rows.push_back(r);
          }
          if (!write_rows(rows)) return 1;
        }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "executor_overhead: %s\n", e.what());
      return 1;
    }
  }

  // Outputs must be finite and O must match the whole-batch kernel's: otherwise the rows did not time
  // the same attention. fp32 with different summation orders: ~1e-6 on O of magnitude ~1.
  constexpr double kTolerance = 1e-4;
  bool sane = true;
  for (const Row& r : rows)
    if (!r.finite || !(r.max_abs_diff_o <= kTolerance)) {
      std::fprintf(stderr, "%s on %d rank(s), %s: %s\n", r.name.c_str(), r.ranks, r.pass.c_str(),
                   r.finite ? "O differs from the whole-batch kernel's" : "non-finite output");
      sane = false;
    }

  return sane ? 0 : 1;
}
