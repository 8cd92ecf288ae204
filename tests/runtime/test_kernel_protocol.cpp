// SPDX-License-Identifier: Apache-2.0
// Kernels in the engine's protocol: a kernel's can_implement is asked with the local checks, before
// the agreement (a refusal on one rank reaches its peers as Errc::kPeerFailed and no byte of the
// program moves), and a kernel's preparation step runs once per cached program, its Params passed to
// every call.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/distributed_check.hpp"

using namespace seqpar;
using namespace std::chrono_literals;

namespace {

using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using Ring = Strategy<partition::Zigzag, comm::Ring>;

/// CpuFlash<double> built for a limited range of shapes (as CudaFlash is for head dims 64 and 128):
/// head dims up to `max_head_dim`, head groups of at least `min_heads_q` query heads. Its calls refuse
/// what its can_implement refuses, from the same predicate.
class LimitedFlash {
 public:
  using kernel_category = attention::kernel_tag;
  using value_type = double;
  using accum_type = double;
  using exec_type = HostExec;

  LimitedFlash(int max_head_dim, int min_heads_q) : max_head_dim_(max_head_dim), min_heads_q_(min_heads_q) {}

  [[nodiscard]] const HostExec& exec() const noexcept { return flash_.exec(); }
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& s, std::int64_t q_rows, std::int64_t k_rows) const {
    return flash_.workspace_bytes(s, q_rows, k_rows);
  }
  [[nodiscard]] Status can_implement(const AttentionShape& s) const { return implementable(s, "LimitedFlash"); }

  void forward(const HostExec& exec, const AttentionShape& s, ThdView<const double> q, ThdView<const double> k,
               ThdView<const double> v, std::span<const AttnSlice> sl, ThdView<double> o, LseView<double> lse,
               std::span<std::byte> ws) const {
    seqpar::detail::throw_if_refused(implementable(s, "LimitedFlash::forward"));
    flash_.forward(exec, s, q, k, v, sl, o, lse, ws);
  }
  void backward(const HostExec& exec, const AttentionShape& s, ThdView<const double> q, ThdView<const double> k,
                ThdView<const double> v, ThdView<const double> o, LseView<const double> lse, ThdView<const double> dout,
                std::span<const AttnSlice> sl, ThdView<double> dq, ThdView<double> dk, ThdView<double> dv,
                std::span<std::byte> ws) const {
    seqpar::detail::throw_if_refused(implementable(s, "LimitedFlash::backward"));
    flash_.backward(exec, s, q, k, v, o, lse, dout, sl, dq, dk, dv, ws);
  }

 private:
  [[nodiscard]] Status implementable(const AttentionShape& s, const char* where) const {
    if (s.head_dim > max_head_dim_)
      return seqpar::detail::refuse_invalid(
          where, "shape.head_dim", s.head_dim,
          "this kernel is built for head dims up to " + std::to_string(max_head_dim_));
    if (s.heads_q < min_heads_q_)
      return seqpar::detail::refuse_invalid(
          where, "shape.heads_q", s.heads_q,
          "this kernel needs at least " + std::to_string(min_heads_q_) + " query heads per call");
    return flash_.can_implement(s);
  }

  attention::CpuFlash<double> flash_;
  int max_head_dim_, min_heads_q_;
};
static_assert(attention::AttentionKernel<LimitedFlash>);

/// A kernel without can_implement is not an attention kernel.
struct WithoutCanImplement {
  using kernel_category = attention::kernel_tag;
  using value_type = double;
  using accum_type = double;
  using exec_type = HostExec;
  [[nodiscard]] HostExec exec() const { return HostExec(1); }
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape&, std::int64_t, std::int64_t) const { return 0; }
  void forward(const HostExec&, const AttentionShape&, ThdView<const double>, ThdView<const double>,
               ThdView<const double>, std::span<const AttnSlice>, ThdView<double>, LseView<double>,
               std::span<std::byte>) const {}
  void backward(const HostExec&, const AttentionShape&, ThdView<const double>, ThdView<const double>,
                ThdView<const double>, ThdView<const double>, LseView<const double>, ThdView<const double>,
                std::span<const AttnSlice>, ThdView<double>, ThdView<double>, ThdView<double>,
                std::span<std::byte>) const {}
};
static_assert(!attention::AttentionKernel<WithoutCanImplement>);

/// What each rank saw: its error message and code (kPeerFailed, ...) or none, and its world
/// transport's counters after the call.
struct RankOutcome {
  std::string what;
  bool invalid_argument = false;
  int errc = 0;
  std::uint64_t messages = 0, bytes = 0;
  std::vector<std::uint64_t> bytes_to_peer;
};

// Every rank builds `make(rank, transport)` and calls forward (or backward) once on `batch`.
template <class Kernel, class StrategyT, class Make>
std::vector<RankOutcome> call_once(int world, const DocumentBatch& batch, const AttentionShape& shape, Make make,
                                   bool backward = false) {
  std::vector<RankOutcome> out(static_cast<std::size_t>(world));
  try {
    backend::inproc::World(world, {.timeout = 5s}).run([&](backend::inproc::Transport& t) {
      RankOutcome& me = out[static_cast<std::size_t>(t.rank())];
      const auto record = [&] {
        me.messages = t.counters().messages_sent;
        me.bytes = t.counters().bytes_sent;
        me.bytes_to_peer = t.counters().bytes_to_peer;
      };
      try {
        DistributedAttention<StrategyT, Kernel> attn(t, shape, {}, make(t.rank()));
        AttentionTensors<double> l(attn.local_tokens(batch), shape);
        if (backward)
          attn.backward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                        l.dk.view(), l.dv.view());
        else
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
      } catch (const std::invalid_argument& e) {
        record();
        me.what = e.what();
        me.invalid_argument = true;
        throw;
      } catch (const Error& e) {
        record();
        me.what = e.what();
        me.errc = static_cast<int>(e.errc());
        throw;
      }
      record();
    });
  } catch (const std::exception&) {  // each rank's own error is in `out`
  }
  return out;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// The agreement's all_gather is the only traffic: one block of the same size to every peer.
void check_only_agreement(const std::vector<RankOutcome>& out) {
  const auto world = out.size();
  for (std::size_t r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << out[r].what);
    CHECK(out[r].messages == world - 1);
    const std::uint64_t block = out[r].bytes / (world - 1);
    CHECK(block > 0);
    CHECK(out[r].bytes == block * (world - 1));
    for (std::size_t p = 0; p < world; ++p) CHECK(out[r].bytes_to_peer[p] == (p == r ? 0 : block));
  }
}

/// Reference<double> with a preparation step: Params record what prepare saw; the calls with Params
/// check that they get their own call's, and count themselves (as do the calls without).
struct PreparedReference {
  using kernel_category = attention::kernel_tag;
  using value_type = double;
  using accum_type = double;
  using exec_type = HostExec;

  struct Params {
    AttentionShape shape;
    std::vector<AttnSlice> slices;
    std::int64_t q_rows = 0, k_rows = 0;
    attention::Pass pass = attention::Pass::kForward;
  };
  struct Counts {
    std::atomic<int> prepares{0}, prepared_calls{0}, plain_calls{0}, mismatched{0};
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
  attention::Reference<double> ref;

  [[nodiscard]] HostExec exec() const { return HostExec(1); }
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape&, std::int64_t, std::int64_t) const { return 0; }
  [[nodiscard]] Status can_implement(const AttentionShape& s) const { return ref.can_implement(s); }

  [[nodiscard]] Params prepare(const HostExec&, const AttentionShape& s, std::span<const AttnSlice> host_slices,
                               std::int64_t q_rows, std::int64_t k_rows, attention::Pass pass) const {
    ++counts->prepares;
    return {s, {host_slices.begin(), host_slices.end()}, q_rows, k_rows, pass};
  }

  void forward(const HostExec& exec, const AttentionShape& s, ThdView<const double> q, ThdView<const double> k,
               ThdView<const double> v, std::span<const AttnSlice> sl, ThdView<double> o, LseView<double> lse,
               std::span<std::byte> ws) const {
    ++counts->plain_calls;
    ref.forward(exec, s, q, k, v, sl, o, lse, ws);
  }
  void backward(const HostExec& exec, const AttentionShape& s, ThdView<const double> q, ThdView<const double> k,
                ThdView<const double> v, ThdView<const double> o, LseView<const double> lse, ThdView<const double> dout,
                std::span<const AttnSlice> sl, ThdView<double> dq, ThdView<double> dk, ThdView<double> dv,
                std::span<std::byte> ws) const {
    ++counts->plain_calls;
    ref.backward(exec, s, q, k, v, o, lse, dout, sl, dq, dk, dv, ws);
  }
  void forward(const HostExec& exec, const Params& p, const AttentionShape& s, ThdView<const double> q,
               ThdView<const double> k, ThdView<const double> v, std::span<const AttnSlice> sl, ThdView<double> o,
               LseView<double> lse, std::span<std::byte> ws) const {
    note(p, attention::Pass::kForward, s, q.tokens, k.tokens, sl);
    ref.forward(exec, s, q, k, v, sl, o, lse, ws);
  }
  void backward(const HostExec& exec, const Params& p, const AttentionShape& s, ThdView<const double> q,
                ThdView<const double> k, ThdView<const double> v, ThdView<const double> o, LseView<const double> lse,
                ThdView<const double> dout, std::span<const AttnSlice> sl, ThdView<double> dq, ThdView<double> dk,
                ThdView<double> dv, std::span<std::byte> ws) const {
    note(p, attention::Pass::kBackward, s, q.tokens, k.tokens, sl);
    ref.backward(exec, s, q, k, v, o, lse, dout, sl, dq, dk, dv, ws);
  }

 private:
  void note(const Params& p, attention::Pass pass, const AttentionShape& s, std::int64_t q_rows, std::int64_t k_rows,
            std::span<const AttnSlice> sl) const {
    ++counts->prepared_calls;
    const bool same = p.pass == pass && p.shape == s && p.q_rows == q_rows && p.k_rows == k_rows &&
                      std::equal(p.slices.begin(), p.slices.end(), sl.begin(), sl.end());
    if (!same) ++counts->mismatched;
  }
};
static_assert(attention::PreparingKernel<PreparedReference>);
static_assert(!attention::PreparingKernel<attention::CpuFlash<float>>);

}  // namespace

TEST_SUITE("runtime") {
  TEST_CASE(
      "a kernel that refuses the shape on one rank: it throws invalid_argument, its peers kPeerFailed, "
      "and no byte of the program moves") {
    const AttentionShape shape{6, 3, 16};
    const DocumentBatch batch({{40, 23}, {30, 33}});
    // Ulysses (all-to-all first) and ring attention (transfers posted before the first compute): with the
    // check inside the program, rank 1 would have sent its step-1 bytes before refusing.
    const auto expect = [&](const std::vector<RankOutcome>& out, const char* named) {
      CHECK(out[1].invalid_argument);
      CHECK(contains(out[1].what, named));
      for (std::size_t r : {std::size_t{0}, std::size_t{2}}) {
        INFO("rank " << r << ": " << out[r].what);
        CHECK(out[r].errc == static_cast<int>(Errc::kPeerFailed));
        CHECK(contains(out[r].what, "rank 1 refused its arguments before any communication"));
        CHECK(contains(out[r].what, named));
      }
      check_only_agreement(out);
    };
    SUBCASE("a head dim the kernel is not built for") {
      const auto make = [](int rank) { return LimitedFlash(rank == 1 ? 8 : 128, 1); };
      expect(call_once<LimitedFlash, Ulysses>(3, batch, shape, make), "shape.head_dim = 16");
      expect(call_once<LimitedFlash, Ring>(3, batch, shape, make), "shape.head_dim = 16");
      // A backward with no forward before it (issue 40): rank 1 names its kernel's refusal (checked first),
      // its peers the missing forward; every rank refuses in the agreement, no byte of the program moves.
      const auto backward = call_once<LimitedFlash, Ulysses>(3, batch, shape, make, true);
      CHECK(backward[1].invalid_argument);
      CHECK(contains(backward[1].what, "shape.head_dim = 16"));
      for (std::size_t r : {std::size_t{0}, std::size_t{2}}) {
        INFO("rank " << r << ": " << backward[r].what);
        CHECK(backward[r].invalid_argument);
        CHECK(contains(backward[r].what, "backward called before any forward of this batch"));
      }
      check_only_agreement(backward);
    }
    SUBCASE("a head group narrower than the kernel takes: the engine's shape passes, Ulysses' groups do not") {
      const auto make = [](int rank) { return LimitedFlash(128, rank == 1 ? 6 : 1); };
      expect(call_once<LimitedFlash, Ulysses>(3, batch, shape, make), "shape.heads_q = 2");
      // Ring attention calls the kernel with every head: it runs.
      const auto ring = call_once<LimitedFlash, Ring>(3, batch, shape, make);
      for (const RankOutcome& r : ring) CHECK(r.what.empty());
    }
  }

  TEST_CASE("CpuFlash refuses a softmax scale its accumulation type cannot hold before any communication") {
    const AttentionShape shape{4, 2, 8, 1e-60};  // 0 in float
    const DocumentBatch batch({{20, 13}});
    using Flash = attention::CpuFlash<float>;
    std::vector<RankOutcome> out(3);
    try {
      backend::inproc::World(3, {.timeout = 5s}).run([&](backend::inproc::Transport& t) {
        RankOutcome& me = out[static_cast<std::size_t>(t.rank())];
        try {
          DistributedAttention<Ring, Flash> attn(t, shape);
          AttentionTensors<float> l(attn.local_tokens(batch), shape);
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        } catch (const std::invalid_argument& e) {
          me.what = e.what();
          me.invalid_argument = true;
        }
        me.messages = t.counters().messages_sent;
        me.bytes = t.counters().bytes_sent;
        me.bytes_to_peer = t.counters().bytes_to_peer;
      });
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
    for (const RankOutcome& r : out) {
      CHECK(r.invalid_argument);
      CHECK(contains(r.what, "CpuFlash: softmax_scale = 1e-60: is not representable in the accumulation type (float)"));
    }
    check_only_agreement(out);
  }

  TEST_CASE("a preparing kernel is prepared once per cached program and every call gets its own Params") {
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch batch({{37, 20, 7}, {50, 14}});
    SUBCASE("exact against the reference (Ring: partial calls merged; Ulysses: head groups)") {
      PreparedReference kernel;
      const test::Errors ring = test::check_strategy<Ring, PreparedReference>(batch, shape, 3, {}, kernel);
      CHECK(ring.max() < 1e-12);
      CHECK(ring.bytes_match);
      const test::Errors ulysses = test::check_strategy<Ulysses, PreparedReference>(batch, shape, 2, {}, kernel);
      CHECK(ulysses.max() < 1e-12);
      CHECK(kernel.counts->prepares > 0);
      CHECK(kernel.counts->prepared_calls > 0);
      CHECK(kernel.counts->plain_calls == 0);
      CHECK(kernel.counts->mismatched == 0);
    }
    SUBCASE("prepared on a cache miss only") {
      backend::inproc::World(3).run([&](backend::inproc::Transport& t) {
        PreparedReference kernel;
        const auto counts = kernel.counts;
        DistributedAttention<Ring, PreparedReference> attn(t, shape, {}, kernel);
        AttentionTensors<double> l(attn.local_tokens(batch), shape);
        const auto run = [&] {
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
          attn.backward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                        l.dk.view(), l.dv.view());
        };
        run();
        const int prepares = counts->prepares, calls = counts->prepared_calls;
        CHECK(prepares == calls);  // one Params per kernel call of the two programs
        run();
        run();
        CHECK(counts->prepares == prepares);
        CHECK(counts->prepared_calls == 3 * calls);
        CHECK(counts->plain_calls == 0);
        CHECK(counts->mismatched == 0);
      });
    }
  }
}
