// SPDX-License-Identifier: Apache-2.0
// Adversarial input to the public API on the in-process world: malformed and aliased views, sizes at
// the edge of int64, API papercuts and misuse. Every case must end in a clear error naming the
// argument and its value on the rank that made it, and in seqpar::Error on its peers, before any
// communication (so no peer waits for a timeout) -- or, for valid-but-unusual input, in the exact answer.
#include <doctest/doctest.h>

#include "adversarial/harness.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <thread>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace seqpar;
using namespace seqpar::test;
using namespace std::chrono_literals;

namespace {

using Ring = Strategy<partition::Zigzag, comm::Ring>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using Usp = Strategy<partition::BatchAware<partition::Uniform>, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
using Ref = attention::Reference<double>;

using Local = AttentionTensors<double>;

// Rank 1 (of 3) makes a bad call; the others make the correct one. Rank 1 must throw
// std::invalid_argument containing `what`, its peers seqpar::Error (kPeerFailed) containing it too,
// all long before the world's 60 s timeout.
template <class Call>
void expect_refused(const char* what, bool backward, Call&& corrupt) {
  const AttentionShape shape{4, 2, 8};
  const DocumentBatch batch({{20, 13}, {9}});
  const WorldOutcome w = run_world(3, [&](int rank, auto& t) {
    DistributedAttention<Ring, Ref> attn(t, shape);
    Local l(attn.local_tokens(batch), shape);
    auto q = l.q.view(), k = l.k.view(), v = l.v.view(), o = l.o.view(), dout = l.dout.view(), dq = l.dq.view(),
         dk = l.dk.view(), dv = l.dv.view();
    auto lse = l.lse.view();
    if (backward) attn.forward(batch, q, k, v, o, lse);
    if (rank == 1) corrupt(l, q, k, v, o, lse, dout, dq, dk, dv);
    if (!backward)
      attn.forward(batch, q, k, v, o, lse);
    else
      attn.backward(batch, q, k, v, o, lse, dout, dq, dk, dv);
  });
  INFO(what << ": rank 1: " << w.errors[1] << " | rank 0: " << w.errors[0]);
  CHECK(w.invalid[1]);
  CHECK(contains(w.errors[1], what));
  for (int r : {0, 2}) {
    CHECK(w.codes[static_cast<std::size_t>(r)] == static_cast<int>(Errc::kPeerFailed));
    CHECK(contains(w.errors[static_cast<std::size_t>(r)], "rank 1 refused its arguments before any communication"));
    CHECK(contains(w.errors[static_cast<std::size_t>(r)], what));
  }
  CHECK(w.took < 20s);  // released by the agreement, not by the timeout
}

}  // namespace

TEST_SUITE("adversarial") {
  TEST_CASE("views: bad strides, extents and LSE layouts are refused before any communication") {
    expect_refused("o.token_stride = 8", false, [](Local&, auto&, auto&, auto&, auto& o, auto&, auto&...) {
      o.token_stride = 8;  // rows of 4 heads x 8 overlap
    });
    expect_refused("q.token_stride = 0", false, [](Local&, auto& q, auto&...) { q.token_stride = 0; });
    expect_refused("k.token_stride", false, [](Local&, auto&, auto& k, auto&...) { k.head_stride = -8; });
    expect_refused("v.token_stride", false, [](Local&, auto&, auto&, auto& v, auto&...) { v.head_stride = 4; });
    expect_refused("lse.head_stride = 1", false,
                   [](Local&, auto&, auto&, auto&, auto&, auto& lse, auto&...) { lse.head_stride = 1; });
    expect_refused("lse.head_stride", false, [](Local&, auto&, auto&, auto&, auto&, auto& lse, auto&...) {
      lse.head_stride = std::numeric_limits<std::int64_t>::max() / 2;  // offsets leave the address space
    });
    expect_refused("o.token_stride", false, [](Local&, auto&, auto&, auto&, auto& o, auto&, auto&...) {
      o.token_stride = std::numeric_limits<std::int64_t>::max() / 3;
    });
    expect_refused("q.tokens", false, [](Local&, auto& q, auto&...) { q.tokens += 1; });
    expect_refused("o.data", false, [](Local&, auto&, auto&, auto&, auto& o, auto&, auto&...) { o.data = nullptr; });
    expect_refused(
        "dq.token_stride = 7", true,
        [](Local&, auto&, auto&, auto&, auto&, auto&, auto&, auto& dq, auto&, auto&) { dq.token_stride = 7; });
    expect_refused("dout.heads", true,
                   [](Local&, auto&, auto&, auto&, auto&, auto&, auto& dout, auto&, auto&, auto&) { dout.heads = 2; });
  }

  TEST_CASE("views: outputs that alias inputs or each other are refused") {
    expect_refused("o = [", false, [](Local&, auto& q, auto&, auto&, auto& o, auto&, auto&...) { o.data = q.data; });
    // O (4 heads) over V (2 heads) and beyond, into whatever the allocator put after V (K, on some
    // layouts): refused as overlapping an input, before anything is written.
    expect_refused("o = [", false, [](Local&, auto&, auto&, auto& v, auto& o, auto&, auto&...) { o.data = v.data; });
    expect_refused("lse = [", false, [](Local& l, auto&, auto&, auto&, auto&, auto& lse, auto&...) {
      lse.data = l.o.storage.data();  // LSE written over O
    });
    expect_refused("overlaps dout", true,
                   [](Local&, auto&, auto&, auto&, auto&, auto&, auto& dout, auto& dq, auto&, auto&) {
                     dq.data = const_cast<double*>(dout.data);
                   });
    expect_refused(
        "overlaps dk", true,
        [](Local&, auto&, auto&, auto&, auto&, auto&, auto&, auto&, auto& dk, auto& dv) { dv.data = dk.data; });
    expect_refused("overlaps q", true, [](Local&, auto& q, auto&, auto&, auto&, auto&, auto&, auto& dq, auto&, auto&) {
      dq.data = const_cast<double*>(q.data) + 3;  // partly
    });
  }

  TEST_CASE("views: a caller's workspace that is too small or overlaps a tensor is refused") {
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch batch({{20, 13}, {9}});
    const WorldOutcome w = run_world(2, [&](int rank, auto& t) {
      DistributedAttention<Ring, Ref> attn(t, shape);
      Local l(attn.local_tokens(batch), shape);
      std::vector<std::byte> ws(attn.workspace_bytes(batch) + 64);
      std::span<std::byte> span(ws);
      if (rank == 1) span = span.first(1);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), span);
    });
    CHECK(contains(w.errors[1], "workspace.size() = 1"));
    CHECK(contains(w.errors[0], "rank 1 refused"));
    const WorldOutcome w2 = run_world(1, [&](int, auto& t) {
      DistributedAttention<Ring, Ref> attn(t, shape);
      Local l(attn.local_tokens(batch), shape);
      std::vector<std::byte> ws(attn.workspace_bytes(batch) + l.o.storage.size() * sizeof(double));
      const ThdView<double> o = ThdView<double>::dense(reinterpret_cast<double*>(ws.data()), l.o.tokens, 4, 8);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), o, l.lse.view(), ws);
    });
    CHECK(contains(w2.errors[0], "workspace = ["));
    CHECK(contains(w2.errors[0], "overlaps o"));
  }

  TEST_CASE("views: packed QKV, packed dQKV and head-major layouts are accepted and exact") {
    // One buffer per token [q | k | v] and one [dq | dk | dv]: inputs interleave with inputs and
    // outputs with outputs, at disjoint offsets within the token stride. A head-major (H, T, D) O.
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch batch({{20, 13}, {9}});
    Global g(batch.total_tokens(), shape);
    std::mt19937 rng(3);
    std::normal_distribution<double> normal;
    for (auto* t : {&g.q, &g.k, &g.v, &g.dout})
      for (double& x : t->storage) x = normal(rng);
    Global want = g;
    reference(batch, shape, want);
    std::mutex mu;
    backend::inproc::World(2).run([&](backend::inproc::Transport& t) {
      DistributedAttention<Ring, Ref> attn(t, shape);
      const std::int64_t n = attn.local_tokens(batch);
      const auto& owned = attn.owned_ranges(batch);
      const std::int64_t row = (4 + 2 + 2) * 8;  // q, k, v heads of one token
      std::vector<double> qkv(static_cast<std::size_t>(n * row)), dqkv(qkv.size()),
          o_hm(static_cast<std::size_t>(n * 32)), dout(static_cast<std::size_t>(n * 32));
      const ThdView<double> q{qkv.data(), n, 4, 8, row, 8}, k{qkv.data() + 32, n, 2, 8, row, 8},
          v{qkv.data() + 48, n, 2, 8, row, 8}, dq{dqkv.data(), n, 4, 8, row, 8}, dk{dqkv.data() + 32, n, 2, 8, row, 8},
          dv{dqkv.data() + 48, n, 2, 8, row, 8}, o{o_hm.data(), n, 4, 8, 8, n * 8},
          dov = ThdView<double>::dense(dout.data(), n, 4, 8);
      std::int64_t r = 0;
      for (const Range& piece : owned)
        for (std::int64_t tok = piece.begin; tok < piece.end; ++tok, ++r)
          for (int x = 0; x < 8; ++x) {
            for (int h = 0; h < 4; ++h) q(r, h, x) = g.q.view()(tok, h, x), dov(r, h, x) = g.dout.view()(tok, h, x);
            for (int h = 0; h < 2; ++h) k(r, h, x) = g.k.view()(tok, h, x), v(r, h, x) = g.v.view()(tok, h, x);
          }
      LseTensor<double> lse(4, n);
      attn.forward(batch, q, k, v, o, lse.view());
      attn.backward(batch, q, k, v, o, lse.view(), dov, dq, dk, dv);
      std::lock_guard lock(mu);
      r = 0;
      for (const Range& piece : owned)
        for (std::int64_t tok = piece.begin; tok < piece.end; ++tok, ++r)
          for (int x = 0; x < 8; ++x) {
            for (int h = 0; h < 4; ++h) {
              CHECK(o(r, h, x) == doctest::Approx(want.o.view()(tok, h, x)).epsilon(1e-12));
              CHECK(dq(r, h, x) == doctest::Approx(want.dq.view()(tok, h, x)).epsilon(1e-10));
            }
            for (int h = 0; h < 2; ++h) {
              CHECK(dk(r, h, x) == doctest::Approx(want.dk.view()(tok, h, x)).epsilon(1e-10));
              CHECK(dv(r, h, x) == doctest::Approx(want.dv.view()(tok, h, x)).epsilon(1e-10));
            }
          }
    });
  }

  TEST_CASE("views: the strided-layout rule, case by case") {
    using detail::strided_layout_ok;
    CHECK(strided_layout_ok(8, 10, 32, 4, 8, 4));                          // THD
    CHECK(strided_layout_ok(8, 10, 8, 4, 80, 4));                          // HTD
    CHECK(strided_layout_ok(8, 10, 64, 4, 8, 4));                          // a heads_slice / packed row
    CHECK_FALSE(strided_layout_ok(8, 10, 31, 4, 8, 4));                    // rows overlap
    CHECK_FALSE(strided_layout_ok(8, 10, 32, 4, 7, 4));                    // heads overlap
    CHECK_FALSE(strided_layout_ok(8, 10, 8, 4, 79, 4));                    // HTD, heads overlap
    CHECK_FALSE(strided_layout_ok(8, 2, 0, 1, 0, 4));                      // zero stride, two tokens
    CHECK(strided_layout_ok(8, 1, 0, 1, 0, 4));                            // one token, one head: strides unused
    CHECK_FALSE(strided_layout_ok(8, 3, -32, 4, 8, 4));                    // negative
    CHECK_FALSE(strided_layout_ok(8, 3, std::int64_t{1} << 62, 4, 8, 4));  // bytes overflow
    CHECK(strided_layout_ok(1, 5, 1, 3, 5, 8));                            // LSE (H, T)
    CHECK_FALSE(strided_layout_ok(1, 5, 1, 3, 4, 8));
    // Empty views (no tokens) take any stride whose row starts still fit (fuzz_api seeds 793882863 and
    // 1475245705: an empty rank's LSE with head stride 2^62 - 1 over 4 heads overflowed h x stride).
    CHECK(strided_layout_ok(1, 0, 1, 4, 1'000'000, 8));
    CHECK(strided_layout_ok(1, 0, 1, 1, std::numeric_limits<std::int64_t>::max(), 8));  // one head: unused
    CHECK_FALSE(strided_layout_ok(1, 0, 1, 4, std::numeric_limits<std::int64_t>::max() / 2, 8));
    CHECK(strided_layout_ok(8, 0, std::int64_t{1} << 62, 4, 8, 4));  // token axis empty: its stride unused
    CHECK_FALSE(strided_layout_ok(8, 0, 32, 3, std::numeric_limits<std::int64_t>::min(), 4));  // negative, too far
  }

  TEST_CASE("views: an empty rank's LSE whose head starts overflow is refused by name, not computed") {
    // 3 tokens on 4 ranks under Uniform: rank 3 holds none; its LSE has a head stride (2^62 - 1) that
    // addresses nothing but whose row starts h x stride leave int64.
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch batch({{3}});
    std::vector<std::string> errors(4);
    std::mutex mu;
    try {
      backend::inproc::World(4, {.timeout = std::chrono::seconds(10)}).run([&](backend::inproc::Transport& t) {
        DistributedAttention<Strategy<partition::Uniform, comm::AllGather>, attention::Reference<double>> attn(t,
                                                                                                               shape);
        const std::int64_t n = attn.local_tokens(batch);
        AttentionTensors<double> l(n, shape);
        LseView<double> lse = l.lse.view();
        if (n == 0) lse.head_stride = std::numeric_limits<std::int64_t>::max() / 2;
        try {
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), lse);
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          errors[static_cast<std::size_t>(t.rank())] = e.what();
        }
      });
    } catch (const std::exception&) {
    }
    CAPTURE(errors[3]);
    CHECK(contains(errors[3], "DistributedAttention::forward: lse.head_stride = 4611686018427387903"));
    for (int r = 0; r < 3; ++r) CHECK(contains(errors[static_cast<std::size_t>(r)], "rank 3 refused its arguments"));
  }

  TEST_CASE("sizes: documents whose causal area leaves int64 are refused, areas stay exact") {
    std::string msg;
    try {
      DocumentBatch({{3'100'000'000}});
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    CHECK(contains(msg, "sequences[0][0] = 3100000000"));
    CHECK(contains(msg, "causal area"));
    const DocumentBatch big({{3'000'000'000}});
    CHECK(big.causal_area() == 4'500'000'001'500'000'000);
    const AttnSlice whole{{0, 3'000'000'000}, {0, 3'000'000'000}, Mask::causal(0)};
    CHECK(whole.area() == big.causal_area());
    const AttnSlice tail{{2'999'999'999, 3'000'000'000}, {0, 3'000'000'000}, Mask::causal(2'999'999'999)};
    CHECK(tail.area() == 3'000'000'000);
    msg.clear();
    try {
      DocumentBatch({{3'000'000'000}, {3'000'000'000}, {3'000'000'000}});
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    CHECK(contains(msg, "sequences[2][0]"));
    CHECK(contains(msg, "overflow"));
    msg.clear();
    try {
      (void)AttentionShape{4, 4, 8, std::numeric_limits<double>::infinity()}.validate();
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    CHECK(contains(msg, "softmax_scale = inf"));
  }

  TEST_CASE("papercuts: braced batches, empty batches, Hierarchical inner_size < 0") {
    const DocumentBatch one({{4096}});
    CHECK(one.num_sequences() == 1);
    CHECK(one.documents().size() == 1);
    CHECK(one.total_tokens() == 4096);
    CHECK(DocumentBatch({{3, 5}, {8}}).num_sequences() == 2);
    CHECK(DocumentBatch{}.num_sequences() == 0);
    const AttentionShape shape{4, 4, 8};
    CHECK_FALSE(Ring::can_implement({}, DocumentBatch{}, shape, Topology{2, 2}).ok);
    const WorldOutcome w = run_world(2, [&](int, auto& t) {
      DistributedAttention<Ring, Ref> attn(t, shape);
      Local l(0, shape);
      attn.forward(DocumentBatch{}, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    CHECK(contains(w.errors[0], "batch = DocumentBatch{}"));
    CHECK(w.invalid[0]);
    Usp::Arguments args;
    args.comm.inner_size = -1;
    const Status s = Usp::can_implement(args, DocumentBatch({{32}}), shape, Topology{4, 2});
    CHECK_FALSE(s.ok);
    CHECK(contains(s.reason, "inner_size = -1"));
  }

  TEST_CASE("misuse: ranks disagreeing on a strategy argument get a mismatch naming it") {
    const AttentionShape shape{4, 4, 8};
    const DocumentBatch batch({{24, 9}, {17}});
    const auto expect_mismatch = [&](const char* name, auto strategy, auto set) {
      using S = decltype(strategy);
      const WorldOutcome w = run_world(4, [&](int rank, auto& t) {
        typename S::Arguments args;
        if (rank == 2) set(args);
        DistributedAttention<S, Ref> attn(t, shape, args);
        Local l(attn.local_tokens(batch), shape);
        attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
      });
      for (std::size_t r = 0; r < 4; ++r) {
        INFO(name << ": rank " << r << ": " << w.errors[r]);
        CHECK(w.codes[r] == static_cast<int>(Errc::kMismatch));
        CHECK(contains(w.errors[r], name));
      }
    };
    expect_mismatch("comm.sharding_aware", Ring{}, [](auto& a) { a.comm.sharding_aware = true; });
    expect_mismatch("comm.inner_size", Usp{}, [](auto& a) { a.comm.inner_size = 1; });
    expect_mismatch("comm.outer.sharding_aware", Usp{}, [](auto& a) { a.comm.outer.sharding_aware = true; });
    expect_mismatch("partition.group_size", Usp{}, [](auto& a) { a.partition.group_size = 2; });
    expect_mismatch("partition.respect_nodes", Usp{}, [](auto& a) { a.partition.respect_nodes = false; });
  }

  TEST_CASE("misuse: local_tokens is local, and one object from two threads is a clear error") {
    const AttentionShape shape{4, 4, 8};
    const DocumentBatch batch({{24, 9}, {17}});
    // Only rank 0 asks (a new batch under BatchAware): it must not wait for its peers.
    const WorldOutcome w = run_world(
        4,
        [&](int rank, auto& t) {
          DistributedAttention<Usp, Ref> attn(t, shape);
          if (rank == 0) CHECK(attn.local_tokens(batch) > 0);
        },
        2s);
    CHECK(w.root.empty());

    // A kernel that holds its first forward until released: a second thread calls in meanwhile.
    struct Held : Ref {
      std::atomic<int>* state = nullptr;  // 0 idle, 1 in the kernel, 2 released
      using Ref::backward;
      void forward(const HostExec&, const AttentionShape& s, ThdView<const double> q, ThdView<const double> k,
                   ThdView<const double> v, std::span<const AttnSlice> sl, ThdView<double> o, LseView<double> lse,
                   std::span<std::byte> ws = {}) const {
        int idle = 0;
        if (state->compare_exchange_strong(idle, 1))
          while (state->load() != 2) std::this_thread::yield();
        Ref::forward(s, q, k, v, sl, o, lse, ws);
      }
    };
    std::atomic<int> state{0};
    std::string second;
    backend::inproc::World(1).run([&](backend::inproc::Transport& t) {
      Held kernel;
      kernel.state = &state;
      DistributedAttention<Ulysses, Held> attn(t, shape, {}, kernel);
      Local l(attn.local_tokens(batch), shape);
      std::thread other([&] {
        while (state.load() != 1) std::this_thread::yield();
        try {
          (void)attn.local_tokens(batch);
        } catch (const std::logic_error& e) {
          second = e.what();
        }
        state.store(2);
      });
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
      other.join();
    });
    CHECK(contains(second, "another call on this object is in progress"));
  }

  TEST_CASE("faults: the default timeouts are seconds, and configurable") {
    CHECK(backend::inproc::World::Options{}.timeout <= 60s);
    CHECK(backend::inproc::World::Options{}.timeout >= 5s);
    const auto start = std::chrono::steady_clock::now();
    const WorldOutcome w = run_world(
        2,
        [&](int rank, auto& t) {
          if (rank == 0) return;
          DistributedAttention<Ring, Ref> attn(t, AttentionShape{4, 4, 8});
          Local l(attn.local_tokens(DocumentBatch({{10}})), AttentionShape{4, 4, 8});
          attn.forward(DocumentBatch({{10}}), l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        },
        200ms);
    CHECK(w.codes[1] == static_cast<int>(Errc::kTimeout));
    CHECK(std::chrono::steady_clock::now() - start < 10s);
  }

  TEST_CASE("faults: World::run aborts, naming the rank, when a rank is stuck outside the transport") {
    // In a child process: rank 0 fails, rank 1 spins in "a kernel" forever. Without the bound,
    // World::run would wait for rank 1 forever.
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      signal(SIGABRT, SIG_DFL);  // not doctest's crash report: the parent checks the signal
      dup2(fds[1], 2);
      std::atomic<bool> never{false};
      try {
        backend::inproc::World(2, {.timeout = 100ms, .stuck_grace = 300ms}).run([&](backend::inproc::Transport& t) {
          if (t.rank() == 0) throw std::runtime_error("rank 0 fails");
          while (!never.load()) std::this_thread::sleep_for(1ms);
        });
      } catch (...) {
      }
      _exit(0);  // not reached: World::run aborts
    }
    close(fds[1]);
    int status = 0;
    bool exited = false;
    for (int i = 0; i < 1000 && !exited; ++i) {
      exited = waitpid(pid, &status, WNOHANG) == pid;
      if (!exited) std::this_thread::sleep_for(10ms);
    }
    if (!exited) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
    std::string err(4096, '\0');
    const auto got = read(fds[0], err.data(), err.size());
    close(fds[0]);
    err.resize(got > 0 ? static_cast<std::size_t>(got) : 0);
    CHECK(exited);
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGABRT);
    CHECK(contains(err, "rank(s) 1 still running"));
  }
}
