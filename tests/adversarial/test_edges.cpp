// SPDX-License-Identifier: Apache-2.0
// Arithmetic at the edges (issue 40 item 3): values at the ends of their types are exact or refused by
// name, never silently wrapped.
//  - A sliding window near INT64_MAX (a "no window" sentinel) is causal on every path: the strategies,
//    the kernels (CpuFlash, Reference, AttnSlice::area on a slice holding it) and DPP's chunk carry, whose
//    key bound pre.end + window - 1 wrapped to a negative row and dropped every prefix key.
//  - A transport timeout of milliseconds::max() waits (clamped to 100 years; its deadline overflowed the
//    steady clock and every wait timed out at once); a timeout in seconds of inf or 1e300 is clamped the
//    same way, NaN, 0 or a negative one refused naming it.
//  - run_pipelined_step's carry bytes count K and dK at head_dim, V and dV at head_dim_v (192/128).
//  - A softmax scale past what the accumulation type keeps exact is refused by every kernel and storage
//    type, naming softmax_scale, its value and the limit (bf16 returned non-finite gradients there).
//  - A backward with no forward of its batch and mask before it is refused on every rank.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/reference.hpp>
#include <seqpar/core/timeout.hpp>
#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/pipelined_step.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "adversarial/harness.hpp"
#include "support/distributed_check.hpp"
#include "support/expect_error.hpp"
#include "support/sanitizer.hpp"

using namespace seqpar;

namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

using test::invalid_message;  // the std::invalid_argument message of a call, empty if it was accepted

// A batch with a document longer than a chunk (split, so chunks have prefixes) among short ones.
const DocumentBatch& edge_batch() {
  static const DocumentBatch b({{37, 5, 9}, {12, 30}});
  return b;
}

schedule::ChunkPlan chunk_plan(const DocumentBatch& batch, std::int64_t capacity) {
  schedule::DynamicChunk sched;
  sched.args.token_capacity = capacity;
  sched.args.slices = 0;
  return sched.plan(batch);
}

// Runs `kernel`'s forward and backward over `slices` of one 24-row buffer (fixed random inputs); returns
// O, LSE, dQ, dK, dV concatenated.
template <class Kernel>
std::vector<double> run_kernel(const Kernel& kernel, const AttentionShape& shape,
                               const std::vector<AttnSlice>& slices) {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;
  const std::int64_t n = 24;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  ThdTensor<T> q(n, shape.heads_q, shape.qk_dim()), k(n, shape.heads_kv, shape.qk_dim()),
      v(n, shape.heads_kv, shape.v_dim()), o(n, shape.heads_q, shape.v_dim()), dout(n, shape.heads_q, shape.v_dim()),
      dq(n, shape.heads_q, shape.qk_dim()), dk(n, shape.heads_kv, shape.qk_dim()), dv(n, shape.heads_kv, shape.v_dim());
  for (auto* t : {&q, &k, &v, &dout})
    for (T& x : t->storage) x = T(normal(rng));
  LseTensor<A> lse(shape.heads_q, n);
  std::vector<std::byte> ws(kernel.workspace_bytes(shape, n, n));
  kernel.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws);
  kernel.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(), dk.view(),
                  dv.view(), ws);
  std::vector<double> all;
  for (auto* t : {&o, &dq, &dk, &dv})
    for (T x : t->storage) all.push_back(double(x));
  for (A x : lse.storage) all.push_back(double(x));
  return all;
}

// Slices of one 24-row buffer: a causal diagonal, a block after its keys (offset 7) and one before them
// (offset -3: its first rows see nothing), each under `mask_of(offset)`.
template <class MaskOf>
std::vector<AttnSlice> edge_slices(MaskOf mask_of) {
  return {{{0, 8}, {0, 8}, mask_of(0)}, {{8, 16}, {1, 8}, mask_of(7)}, {{16, 24}, {19, 24}, mask_of(-3)}};
}

// A pipeline stage that does nothing but keep its rows one to one: run_pipelined_step's own accounting
// (the attention carry it builds per layer) is what the test reads.
struct IdleStage {
  using stage_category = train::pipeline_stage_tag;
  using value_type = double;
  using accum_type = double;
  struct ChunkState {};
  AttentionShape shape;
  [[nodiscard]] int layers() const { return 2; }
  [[nodiscard]] AttentionShape attention_shape() const { return shape; }
  [[nodiscard]] train::ActivationShape input_shape(std::int64_t n) const { return {n, 1}; }
  [[nodiscard]] train::ActivationShape output_shape(std::int64_t n) const { return {n, 1}; }
  [[nodiscard]] train::LayerBytes layer_bytes() const { return {8.0, 8.0}; }
  [[nodiscard]] std::size_t held_bytes(const ChunkState&) const { return 0; }
  void forward(const train::ChunkRows&, std::span<const double>, int, const train::StageAttention<double>&, ChunkState&,
               std::span<double> out) {
    for (double& x : out) x = 0;
  }
  void recompute(const train::ChunkRows&, int, const train::StageAttention<double>&, ChunkState&) {}
  void backward(const train::ChunkRows&, int, std::span<const double>, const train::StageAttention<double>&,
                ChunkState&, std::span<double>) {}
  double loss(const train::ChunkRows&, std::span<const double>, double, std::span<double> dout) {
    for (double& x : dout) x = 0;
    return 0;
  }
};
static_assert(train::PipelineStage<IdleStage>);

}  // namespace

TEST_SUITE("adversarial") {
  TEST_CASE("edges: a window near INT64_MAX is causal on every kernel and slice computation") {
    for (const std::int64_t w : {kMax, kMax - 1, kMax / 2 + 3}) {
      CAPTURE(w);
      // A slice's pairs: the closed form subtracted x - window, which wrapped.
      for (const AttnSlice& s : edge_slices([w](std::int64_t off) { return Mask::sliding_window(w, off); })) {
        const AttnSlice causal{s.q_range, s.k_range, Mask::causal(s.mask.causal_offset)};
        CHECK(s.area() == causal.area());
        for (std::int64_t i = 0; i < s.q_range.size(); ++i)
          CHECK(s.mask.visible_keys(i, s.k_range.size()) == causal.mask.visible_keys(i, s.k_range.size()));
      }
      const auto windowed = edge_slices([w](std::int64_t off) { return Mask::sliding_window(w, off); });
      const auto causal = edge_slices([](std::int64_t off) { return Mask::causal(off); });
      const AttentionShape shape{2, 1, 8};
      CHECK(run_kernel(attention::CpuFlash<float>({1, 8, 4}), shape, windowed) ==
            run_kernel(attention::CpuFlash<float>({1, 8, 4}), shape, causal));
      CHECK(run_kernel(attention::CpuFlash<double>({1}), shape, windowed) ==
            run_kernel(attention::CpuFlash<double>({1}), shape, causal));
      CHECK(run_kernel(attention::Reference<double>{}, shape, windowed) ==
            run_kernel(attention::Reference<double>{}, shape, causal));
    }
  }

  TEST_CASE("edges: a window near INT64_MAX is causal through the strategies and DPP's chunked attention") {
    const DocumentBatch& batch = edge_batch();
    const AttentionShape shape{4, 2, 8};
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    using PerDocGather = Strategy<partition::PerDoc, comm::AllGather>;
    const std::vector<std::int64_t> windows =
        test::kUnderSanitizer ? std::vector<std::int64_t>{kMax} : std::vector<std::int64_t>{kMax, kMax - 1, 38};
    for (const std::int64_t w : windows) {
      CAPTURE(w);
      const test::MaskedBatch masked = test::windowed(batch, w);
      CHECK(test::check_strategy<ZigzagRing, attention::Reference<double>>(masked, shape, 3).max() < 1e-9);
      CHECK(test::check_strategy<Ulysses, attention::Reference<double>>(masked, shape, 2).max() < 1e-9);
      PerDocGather::Arguments per_doc;
      per_doc.masks = MaskMix::only(masked.mask);
      CHECK(test::check_attention<attention::CpuFlash<double>>(
                masked, shape, 2,
                [&](backend::inproc::Transport& t)
                    -> std::unique_ptr<runtime::AttentionEngine<attention::CpuFlash<double>>> {
                  return std::make_unique<DistributedAttention<PerDocGather, attention::CpuFlash<double>>>(
                      t, shape, per_doc, attention::CpuFlash<double>({1}));
                },
                7)
                .max() < 1e-9);
      // Chunked: chunks of 16 tokens split the 37- and 30-token documents, so pieces carry prefixes.
      const schedule::ChunkPlan plan = chunk_plan(batch, 16);
      bool prefixes = false;
      for (const Chunk& ch : plan.chunks)
        for (const Range& p : ch.prefix) prefixes = prefixes || !p.empty();
      REQUIRE(prefixes);
      for (int world : {1, 2}) {
        CAPTURE(world);
        const auto err = test::distributed_check<attention::Reference<double>>(
            masked, plan.chunks, test::forward_then_backward(plan.chunks.size()), shape, world,
            [&](backend::inproc::Transport& t)
                -> std::unique_ptr<runtime::AttentionEngine<attention::Reference<double>>> {
              return std::make_unique<DistributedAttention<ZigzagRing, attention::Reference<double>>>(t, shape);
            },
            11);
        CHECK(err.max() < 1e-9);
        CHECK(err.bytes_match);
      }
      // The carry keeps what a causal layer keeps (the window cuts no prefix).
      backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
        DistributedAttention<ZigzagRing, attention::Reference<double>> attn(t, shape);
        runtime::ChunkedAttention<attention::Reference<double>> huge(attn), causal(attn);
        huge.begin(plan.chunks, AttentionMask{w});
        causal.begin(plan.chunks);
        CHECK(huge.carry_rows() == causal.carry_rows());
        for (int c = 0; c < huge.num_chunks(); ++c)
          CHECK(huge.program(c, 0).bytes_sent(8, 8) == causal.program(c, 0).bytes_sent(8, 8));
      });
    }
  }

  TEST_CASE("edges: transport timeouts of milliseconds::max(), inf or 1e300 wait (clamped); NaN, 0, < 0 refused") {
    using std::chrono::milliseconds;
    const milliseconds longest = seqpar::detail::kLongestTimeout;
    CHECK(longest > std::chrono::hours(24 * 365 * 99));
    // Before: the deadline now() + timeout overflowed the steady clock's nanoseconds, and the first wait
    // timed out at once (or ran on undefined behaviour).
    for (const milliseconds timeout : {milliseconds::max(), milliseconds::max() / 2, milliseconds{kMax / 1000}}) {
      backend::inproc::World world(2, {.timeout = timeout});
      CHECK(world.options().timeout == longest);
      int received = 0;
      world.run([&](backend::inproc::Transport& t) {
        t.barrier();
        int x = 7;
        if (t.rank() == 0) t.send(std::as_bytes(std::span<const int>(&x, 1)), 1, 3);
        if (t.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 waits inside a deadline
          t.recv(std::as_writable_bytes(std::span<int>(&received, 1)), 0, 3);
        }
        t.barrier();
      });
      CHECK(received == 7);
    }
    CHECK(invalid_message([] { backend::inproc::World(2, {.timeout = milliseconds{-5}}); }) ==
          "inproc::World: options.timeout = -5 ms: must be > 0");
    // Seconds (the Python layer's timeout_s): inf and 1e300 wait without a bound in practice.
    constexpr double inf = std::numeric_limits<double>::infinity();
    for (const double s : {inf, 1e300, 1e18, 3.2e9})
      CHECK(seqpar::detail::timeout_from_seconds("t", "timeout_s", s) == longest);
    CHECK(seqpar::detail::timeout_from_seconds("t", "timeout_s", 0.0001) == milliseconds{1});
    CHECK(seqpar::detail::timeout_from_seconds("t", "timeout_s", 2.5) == milliseconds{2500});
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(), 0.0, -1.0, -inf}) {
      const std::string what =
          invalid_message([bad] { (void)seqpar::detail::timeout_from_seconds("t", "timeout_s", bad); });
      CAPTURE(what);
      CHECK(contains(what, "t: timeout_s = "));
      CHECK(contains(what, "must be a positive number of seconds"));
    }
  }

  TEST_CASE("edges: run_pipelined_step's carry bytes count V and dV at head_dim_v (192/128)") {
    using S = Strategy<partition::Zigzag, comm::Ring>;
    using K = attention::Reference<double>;
    const AttentionShape shape{2, 1, 192, 0.0, 128};
    train::TokenBatch batch{edge_batch(), {}};
    for (std::int64_t i = 0; i < batch.documents.total_tokens(); ++i) batch.tokens.push_back(static_cast<int>(i % 7));
    const schedule::ChunkPlan plan = chunk_plan(batch.documents, 16);
    const schedule::PipelineModel pm{.stages = 1,
                                     .layers_per_stage = 2,
                                     .static_bytes = 0,
                                     .memory_cap = 1e30,
                                     .activation_bytes_per_token = 8,
                                     .kept_bytes_per_token = 8,
                                     .seconds_per_cost = 1e-9};
    const schedule::PipelineSchedule sched = schedule::group_pipelines(plan, pm);
    std::mutex mu;
    std::int64_t rows_seen = 0;
    backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
      IdleStage stage{shape};
      const auto r = train::run_pipelined_step<S>(t, stage, batch, plan, sched, pm, {}, [] { return K{}; });
      // The carry each of the stage's two layers keeps, compiled again here.
      DistributedAttention<S, K> attn(t, shape);
      runtime::ChunkedAttention<K> chunked(attn);
      chunked.begin(plan.chunks);
      const auto rows = static_cast<std::size_t>(chunked.carry_rows());
      // K, dK: 192 values per head; V, dV: 128 (the old count took 4 x 192).
      CHECK(r.carry_bytes == 2 * rows * (2 * 192 + 2 * 128) * sizeof(double));
      const std::lock_guard lock(mu);
      rows_seen += chunked.carry_rows();
    });
    CHECK(rows_seen > 0);
  }

  TEST_CASE("edges: a softmax scale past what the accumulation type keeps exact is refused on every kernel") {
    const AttentionShape ok{2, 1, 16, 1e3}, too_large_f{2, 1, 16, 1e10}, too_large_d{2, 1, 16, 1e20};
    CHECK(attention::max_softmax_scale<float>(16) == doctest::Approx(22713.0).epsilon(1e-4));
    CHECK(attention::max_softmax_scale<double>(128) == doctest::Approx(1.90531e11).epsilon(1e-4));
    const std::string float_limit =
        "softmax_scale = 1e+10: exceeds 22713, the largest the accumulation type (float) "
        "keeps exact at head_dim 16";
    const std::string double_limit =
        "softmax_scale = 1e+20: exceeds 1.2194e+13, the largest the accumulation type "
        "(double) keeps exact at head_dim 16";
    const auto refuses = [&](const auto& kernel, const AttentionShape& bad, const std::string& why) {
      CHECK(kernel.can_implement(ok).ok);
      const Status s = kernel.can_implement(bad);
      CHECK_FALSE(s.ok);
      CHECK(contains(s.reason, why));
      // The calls refuse the same (before the inputs are read).
      using T = typename std::decay_t<decltype(kernel)>::value_type;
      using A = typename std::decay_t<decltype(kernel)>::accum_type;
      ThdTensor<T> q(4, 2, 16), k(4, 1, 16), v(4, 1, 16), o(4, 2, 16);
      LseTensor<A> lse(2, 4);
      const std::vector<AttnSlice> sl{{{0, 4}, {0, 4}, Mask::causal()}};
      std::vector<std::byte> ws(kernel.workspace_bytes(ok, 4, 4));
      CHECK(contains(
          invalid_message([&] { kernel.forward(bad, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws); }),
          why));
    };
    refuses(attention::CpuFlash<float>({1}), too_large_f, float_limit);
    refuses(attention::CpuFlash<attention::bf16>({1}), too_large_f, float_limit);
    refuses(attention::CpuFlash<double>({1}), too_large_d, double_limit);
    refuses(attention::Reference<double>{}, too_large_d, double_limit);
    refuses(attention::Reference<float>{}, too_large_d, double_limit);
    // Through DistributedAttention: every rank refuses before the first message of the call.
    const test::WorldOutcome w = test::run_world(2, [&](int, auto& t) {
      using S = Strategy<partition::Zigzag, comm::Ring>;
      DistributedAttention<S, attention::CpuFlash<float>> attn(t, too_large_f, {}, attention::CpuFlash<float>({1}));
      const DocumentBatch batch({{9, 7}});
      AttentionTensors<float> l(attn.local_tokens(batch), too_large_f);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(w.errors[static_cast<std::size_t>(r)]);
      CHECK(w.invalid[static_cast<std::size_t>(r)]);
      CHECK(contains(w.errors[static_cast<std::size_t>(r)],
                     "DistributedAttention::forward: the kernel cannot run it: "
                     "CpuFlash: " +
                         float_limit));
    }
  }

  TEST_CASE("edges: a backward with no forward of its batch and mask before it is refused on every rank") {
    using S = Strategy<partition::Zigzag, comm::Ring>;
    using Attn = DistributedAttention<S, attention::Reference<double>>;
    const AttentionShape shape{2, 1, 4};
    const DocumentBatch batch({{10, 6}}), other({{6, 10}});
    const auto backward = [](Attn& attn, const DocumentBatch& b, AttentionMask mask, AttentionTensors<double>& l) {
      attn.backward(b, mask, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                    l.dk.view(), l.dv.view());
    };
    const std::string why = "backward called before any forward of this batch under this mask on this object";
    // No forward at all; a forward of another batch; a forward of this batch under another mask.
    for (int c = 0; c < 3; ++c) {
      CAPTURE(c);
      const test::WorldOutcome w = test::run_world(2, [&](int, auto& t) {
        Attn attn(t, shape);
        AttentionTensors<double> l(attn.local_tokens(batch), shape), m(attn.local_tokens(other), shape);
        if (c == 1) attn.forward(other, m.q.view(), m.k.view(), m.v.view(), m.o.view(), m.lse.view());
        if (c == 2)
          attn.forward(batch, AttentionMask::sliding_window(3), l.q.view(), l.k.view(), l.v.view(), l.o.view(),
                       l.lse.view());
        AttentionTensors<double> fresh(attn.local_tokens(batch), shape);  // never written by a forward
        backward(attn, batch, AttentionMask::causal(), fresh);
      });
      for (int r = 0; r < 2; ++r) {
        CAPTURE(w.errors[static_cast<std::size_t>(r)]);
        CHECK(w.invalid[static_cast<std::size_t>(r)]);
        CHECK(contains(w.errors[static_cast<std::size_t>(r)], "DistributedAttention::backward: batch = fingerprint "));
        CHECK(contains(w.errors[static_cast<std::size_t>(r)], why));
      }
    }
    // After its forward (several layers on one object, another batch in between): accepted.
    const test::WorldOutcome ok = test::run_world(2, [&](int, auto& t) {
      Attn attn(t, shape);
      AttentionTensors<double> a(attn.local_tokens(batch), shape), b(attn.local_tokens(batch), shape),
          m(attn.local_tokens(other), shape);
      attn.forward(batch, a.q.view(), a.k.view(), a.v.view(), a.o.view(), a.lse.view());
      attn.forward(batch, b.q.view(), b.k.view(), b.v.view(), b.o.view(), b.lse.view());
      attn.forward(other, m.q.view(), m.k.view(), m.v.view(), m.o.view(), m.lse.view());
      backward(attn, batch, AttentionMask::causal(), b);
      backward(attn, batch, AttentionMask::causal(), a);
      backward(attn, other, AttentionMask::causal(), m);
    });
    for (const std::string& e : ok.errors) CHECK(e.empty());
  }
}
