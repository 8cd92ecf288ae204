// SPDX-License-Identifier: Apache-2.0
// Failure behaviour of DistributedAttention on the in-process world: ranks that disagree, a rank that
// throws mid-program, a rank that never shows up, and bad input. Every case must end in a clear
// error on every rank within a bounded time, never a hang or a wrong answer.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

using namespace seqpar;
using namespace std::chrono_literals;

namespace {

using Ring = Strategy<partition::Zigzag, comm::Ring>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;

/// Reference kernel that throws from its forward on one chosen rank: a failure in the middle of a
/// program, after communication has started.
struct ThrowingKernel : attention::Reference<double> {
  bool fail = false;
  using Reference<double>::backward;
  void forward(const HostExec&, const AttentionShape& s, ThdView<const double> q, ThdView<const double> k,
               ThdView<const double> v, std::span<const AttnSlice> sl, ThdView<double> o, LseView<double> lse,
               std::span<std::byte> ws = {}) const {
    if (fail) throw std::runtime_error("injected kernel failure");
    Reference<double>::forward(s, q, k, v, sl, o, lse, ws);
  }
};
static_assert(attention::AttentionKernel<ThrowingKernel>);

using Local = AttentionTensors<double>;  // only q, k, v, o, lse are used here

// Runs `body(rank, transport)` on a world of n ranks with a short timeout; returns each rank's error
// message ("" if it returned normally) and the exception World::run rethrew.
template <class Body>
std::pair<std::vector<std::string>, std::string> run_world(int n, Body body, std::chrono::milliseconds timeout = 5s) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::mutex mu;
  std::string root;
  try {
    backend::inproc::World(n, {.timeout = timeout}).run([&](backend::inproc::Transport& t) {
      try {
        body(t.rank(), t);
      } catch (const std::exception& e) {
        std::lock_guard lock(mu);
        errors[static_cast<std::size_t>(t.rank())] = e.what();
        throw;
      }
    });
  } catch (const std::exception& e) {
    root = e.what();
  }
  return {errors, root};
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("ranks that pass different batches all raise a mismatch naming it") {
    const AttentionShape shape{4, 2, 8};
    const auto [errors, root] = run_world(3, [&](int rank, auto& t) {
      const DocumentBatch batch = rank == 1 ? DocumentBatch({{20, 11}}) : DocumentBatch({{20, 10}});
      DistributedAttention<Ring, attention::Reference<double>> attn(t, shape);
      Local l(attn.local_tokens(batch), shape);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    for (const std::string& e : errors) {
      CHECK(contains(e, "disagree on the batch's total tokens"));
    }
    CHECK(contains(root, "disagree"));
  }

  TEST_CASE("ranks that pass different shapes or documents all raise a mismatch") {
    const auto [errors, root] = run_world(2, [&](int rank, auto& t) {
      const AttentionShape shape{4, rank == 0 ? 2 : 4, 8};
      const DocumentBatch batch = DocumentBatch::single({30});
      DistributedAttention<Ulysses, attention::Reference<double>> attn(t, shape);
      Local l(attn.local_tokens(batch), shape);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    CHECK(contains(errors[0], "shape.heads_kv"));
    CHECK(contains(errors[1], "shape.heads_kv"));
    const auto [errors2, root2] = run_world(2, [&](int rank, auto& t) {
      const AttentionShape shape{4, 4, 8};
      const DocumentBatch batch = rank == 0 ? DocumentBatch({{15, 15}}) : DocumentBatch({{10, 20}});
      DistributedAttention<Ulysses, attention::Reference<double>> attn(t, shape);
      Local l(attn.local_tokens(batch), shape);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    CHECK(contains(errors2[0], "document lengths"));
    CHECK(contains(errors2[1], "document lengths"));
  }

  TEST_CASE("a rank that throws mid-program makes its peers fail, naming the rank and the step") {
    const AttentionShape shape{4, 4, 8};
    const DocumentBatch batch({{40, 25}});
    const auto start = std::chrono::steady_clock::now();
    const auto [errors, root] = run_world(4, [&](int rank, auto& t) {
      ThrowingKernel kernel;
      kernel.fail = rank == 2;
      DistributedAttention<Ring, ThrowingKernel> attn(t, shape, {}, kernel);
      Local l(attn.local_tokens(batch), shape);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    CHECK(std::chrono::steady_clock::now() - start < 4s);  // released by the failure, not by the timeout
    CHECK(contains(errors[2], "rank 2, step 2/"));         // step 1 posts the first transfer
    CHECK(contains(errors[2], "injected kernel failure"));
    // Ranks 3 and 0 need what rank 2 never sends (rank 3 its step-2 block, rank 0 rank 3's forward of it).
    // Rank 1 needs nothing more from rank 2 once rank 2 has posted its first transfer: it may finish its
    // forward before the failure reaches it (a loaded machine), or be stopped by it; it must not hang.
    for (int r : {0, 3}) {
      INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
      CHECK(contains(errors[static_cast<std::size_t>(r)], "rank 2 failed"));
      CHECK(contains(errors[static_cast<std::size_t>(r)], "step"));
    }
    INFO("rank 1: " << errors[1]);
    CHECK((errors[1].empty() || contains(errors[1], "rank 2 failed")));
    CHECK(contains(root, "injected kernel failure"));  // World::run rethrows the root cause
  }

  TEST_CASE("a rank that never calls makes its peers time out within the bound") {
    const AttentionShape shape{4, 4, 8};
    const DocumentBatch batch = DocumentBatch::single({40});
    const auto start = std::chrono::steady_clock::now();
    const auto [errors, root] = run_world(
        3,
        [&](int rank, auto& t) {
          if (rank == 1) return;  // leaves without a word
          DistributedAttention<Ring, attention::Reference<double>> attn(t, shape);
          Local l(attn.local_tokens(batch), shape);
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        },
        300ms);
    CHECK(std::chrono::steady_clock::now() - start < 3s);
    CHECK(errors[1].empty());
    CHECK((contains(errors[0], "timed out") || contains(errors[0], "failed")));
    CHECK((contains(errors[2], "timed out") || contains(errors[2], "failed")));
    CHECK(contains(root, "timed out"));
  }

  TEST_CASE("bad input is rejected before any communication, naming the argument") {
    const AttentionShape shape{4, 2, 8};
    const DocumentBatch batch({{20, 13}});
    // Every case runs on both ranks: each must throw std::invalid_argument itself (no rank waits).
    const auto expect = [&](const char* what, auto&& call) {
      const auto [errors, root] = run_world(2, [&](int, auto& t) { call(t); });
      INFO(what << " -> " << root);
      CHECK(contains(root, what));
      CHECK(contains(errors[0], what));
      CHECK(contains(errors[1], what));
    };
    expect("q.tokens", [&](auto& t) {
      DistributedAttention<Ring, attention::Reference<double>> attn(t, shape);
      Local l(attn.local_tokens(batch) + 1, shape);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    expect("k.heads", [&](auto& t) {
      DistributedAttention<Ring, attention::Reference<double>> attn(t, shape);
      Local l(attn.local_tokens(batch), {4, 4, 8});
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    expect("lse.tokens", [&](auto& t) {
      DistributedAttention<Ring, attention::Reference<double>> attn(t, shape);
      Local l(attn.local_tokens(batch), shape);
      LseTensor<double> bad(shape.heads_q, attn.local_tokens(batch) + 2);
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), bad.view());
    });
    expect("heads_q = 6", [&](auto& t) {
      DistributedAttention<Ring, attention::Reference<double>> attn(t, AttentionShape{6, 4, 8});
    });
    expect("args.ranks_per_node = -2", [&](auto& t) {
      Ring::Arguments args;
      args.ranks_per_node = -2;
      DistributedAttention<Ring, attention::Reference<double>> attn(t, shape, args);
    });
    expect("refuses", [&](auto& t) {  // Ulysses over 2 ranks with 1 query head
      DistributedAttention<Ulysses, attention::Reference<double>> attn(t, AttentionShape{1, 1, 8});
      Local l(10, AttentionShape{1, 1, 8});
      attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    });
    expect("sequences[0][1] = 0", [&](auto&) { DocumentBatch({{5, 0}}); });
  }
}
