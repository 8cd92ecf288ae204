// SPDX-License-Identifier: Apache-2.0
// Steady state of the runtime: a forward + backward on a cached batch allocates nothing on any rank
// (in-process transport, CpuFlash), for every communicator; and ranks whose caches disagree (one hits,
// one misses) still fail cleanly with a mismatch, never a hang.
//
// Allocations are counted by replacing the global operator new in this executable: a thread-local
// counter, so each in-process rank (a thread) counts its own, including what its sends allocate.
#include <doctest/doctest.h>

#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <new>
#include <random>
#include <span>
#include <string>
#include <vector>

// This file replaces the global operator new/delete with malloc/free; GCC, seeing both through inlining,
// takes the pairing for a mismatch.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

namespace {
thread_local std::size_t t_allocations = 0;
thread_local bool t_counting = false;
[[gnu::noinline]] void allocation_while_counting() {
  asm volatile("");
}  // break here in gdb to see who allocates

void* counted_alloc(std::size_t n, std::size_t align) {
  ++t_allocations;
  if (t_counting) allocation_while_counting();
  if (n == 0) n = 1;
  void* p =
      align <= alignof(std::max_align_t) ? std::malloc(n) : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) {
  return counted_alloc(n, alignof(std::max_align_t));
}
void* operator new[](std::size_t n) {
  return counted_alloc(n, alignof(std::max_align_t));
}
void* operator new(std::size_t n, std::align_val_t a) {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, alignof(std::max_align_t));
  } catch (...) {
    return nullptr;
  }
}
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

using namespace seqpar;

namespace {

DocumentBatch mixed_batch(std::uint32_t seed, int sequences) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int s = 0; s < sequences; ++s) {
    std::vector<std::int64_t> docs;
    const int n = std::uniform_int_distribution<int>(1, 5)(rng);
    for (int i = 0; i < n; ++i) docs.push_back(std::uniform_int_distribution<std::int64_t>(1, 90)(rng));
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

/// Runs warm-up calls, then counts the allocations of one forward + backward per rank; returns the
/// most any rank made.
/// With `sinks`, the calls with attention sinks (the gather of their gradient included).
template <class S>
std::size_t steady_state_allocations(const DocumentBatch& batch, int world, typename S::Arguments args = {},
                                     bool sinks = false) {
  const AttentionShape shape{8, 4, 16};
  std::size_t worst = 0;
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
    DistributedAttention<S, attention::CpuFlash<float>> attn(t, shape, args);
    const std::int64_t n = attn.local_tokens(batch);
    ThdTensor<float> q(n, 8, 16), k(n, 4, 16), v(n, 4, 16), o(n, 8, 16), dout(n, 8, 16), dq(n, 8, 16), dk(n, 4, 16),
        dv(n, 4, 16);
    LseTensor<float> lse(8, n);
    std::mt19937 rng(static_cast<std::uint32_t>(t.rank()) + 1);
    std::normal_distribution<float> normal;
    for (auto* x : {&q, &k, &v, &dout})
      for (float& e : x->storage) e = normal(rng);
    const std::vector<float> sink_logits{0.5f, -1.f, 2.f, 0.f, 1.f, -2.f, 0.25f, 3.f};
    std::vector<float> dsinks(8);
    const auto step = [&] {
      if (sinks) {
        attn.forward(batch, q.view(), k.view(), v.view(), o.view(), lse.view(), std::span<const float>(sink_logits));
        attn.backward(batch, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                      dv.view(), std::span<const float>(sink_logits), std::span<float>(dsinks));
        return;
      }
      attn.forward(batch, q.view(), k.view(), v.view(), o.view(), lse.view());
      attn.backward(batch, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                    dv.view());
    };
    // Warm-up: plans, lowered programs, workspace, sub-communicators and the mailboxes' recycled
    // buffers all come to exist here.
    for (int i = 0; i < 3; ++i) step();
    const std::size_t before = t_allocations;
    t_counting = true;
    step();
    t_counting = false;
    const std::size_t made = t_allocations - before;
    std::lock_guard lock(mu);
    worst = std::max(worst, made);
  });
  return worst;
}

/// The same for a chunked run (DPP): begin on the same chunks, every chunk's forward, then every
/// backward in reverse, on a batch whose long document is split across chunks (so the prefix carry
/// moves); returns the most any rank allocated in one such pass after warm-up. `window`: the batch's
/// sliding window (0: none), which cuts the prefixes and makes the prefix slices windowed.
template <class S>
std::size_t chunked_steady_state_allocations(int world, typename S::Arguments args = {}, std::int64_t window = 0) {
  const AttentionShape shape{4, 2, 16};
  const DocumentBatch batch = DocumentBatch({{150, 7, 12, 30}, {9, 40, 5}});
  const std::vector<Chunk> chunks =
      schedule::DynamicChunk{{.token_capacity = 96, .time_target = 0, .slices = 3, .cost = {}}}.chunks(batch);
  REQUIRE(chunks.size() <= 8);  // every chunk batch stays in the engine's plan cache
  std::size_t worst = 0;
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
    DistributedAttention<S, attention::CpuFlash<float>> attn(t, shape, args);
    runtime::ChunkedAttention<attention::CpuFlash<float>> chunked(attn);
    chunked.begin(chunks, AttentionMask{window});
    REQUIRE(chunked.carry_rows() >= 0);
    const int nc = chunked.num_chunks();
    struct Local {
      ThdTensor<float> q, k, v, o, dout, dq, dk, dv;
      LseTensor<float> lse;
    };
    std::vector<Local> loc;
    std::mt19937 rng(static_cast<std::uint32_t>(t.rank()) + 7);
    std::normal_distribution<float> normal;
    for (int c = 0; c < nc; ++c) {
      const std::int64_t n = chunked.local_tokens(c);
      loc.push_back({ThdTensor<float>(n, 4, 16), ThdTensor<float>(n, 2, 16), ThdTensor<float>(n, 2, 16),
                     ThdTensor<float>(n, 4, 16), ThdTensor<float>(n, 4, 16), ThdTensor<float>(n, 4, 16),
                     ThdTensor<float>(n, 2, 16), ThdTensor<float>(n, 2, 16), LseTensor<float>(4, n)});
      for (auto* x : {&loc.back().q, &loc.back().k, &loc.back().v, &loc.back().dout})
        for (float& e : x->storage) e = normal(rng);
    }
    std::vector<std::vector<Chunk>> copies(4, chunks);  // begin takes its chunks by value: moved in, not copied
    const auto step = [&](std::size_t i) {
      chunked.begin(std::move(copies[i]), AttentionMask{window});
      for (int c = 0; c < nc; ++c) {
        Local& l = loc[static_cast<std::size_t>(c)];
        chunked.forward(c, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
      }
      for (int c = nc - 1; c >= 0; --c) {
        Local& l = loc[static_cast<std::size_t>(c)];
        chunked.backward(c, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                         l.dk.view(), l.dv.view());
      }
    };
    for (std::size_t i = 0; i < 3; ++i) step(i);
    const std::size_t before = t_allocations;
    t_counting = true;
    step(3);
    t_counting = false;
    const std::size_t made = t_allocations - before;
    std::lock_guard lock(mu);
    worst = std::max(worst, made);
  });
  return worst;
}

}  // namespace

TEST_SUITE("runtime") {
  TEST_CASE("a chunked (DPP) forward + backward on cached chunks allocates nothing on any rank") {
    using partition::Uniform, partition::Zigzag, partition::PerDoc;
    for (int world : {2, 4}) {
      CAPTURE(world);
      CHECK(chunked_steady_state_allocations<Strategy<Uniform, comm::AllToAll>>(world) == 0);
      CHECK(chunked_steady_state_allocations<Strategy<Zigzag, comm::Ring>>(world) == 0);
      Strategy<PerDoc, comm::AllGather>::Arguments gather;
      gather.comm.sharding_aware = true;
      CHECK(chunked_steady_state_allocations<Strategy<PerDoc, comm::AllGather>>(world, gather) == 0);
      CHECK(chunked_steady_state_allocations<Strategy<Zigzag, comm::Ring>>(world, {}, 20) == 0);  // windowed
    }
  }

  TEST_CASE("a second forward + backward on a cached batch allocates nothing on any rank") {
    using partition::Uniform, partition::Zigzag, partition::Hybrid, partition::PerDoc;
    for (int world : {2, 4, 8}) {
      CAPTURE(world);
      const DocumentBatch batch = mixed_batch(static_cast<std::uint32_t>(world), 2);
      CHECK(steady_state_allocations<Strategy<Uniform, comm::AllToAll>>(batch, world) == 0);
      CHECK(steady_state_allocations<Strategy<Zigzag, comm::Ring>>(batch, world) == 0);
      Strategy<PerDoc, comm::Ring>::Arguments aware;
      aware.comm.sharding_aware = true;
      CHECK(steady_state_allocations<Strategy<PerDoc, comm::Ring>>(batch, world, aware) == 0);
      Strategy<Hybrid, comm::AllGather>::Arguments gather;
      gather.comm.sharding_aware = true;
      CHECK(steady_state_allocations<Strategy<Hybrid, comm::AllGather>>(batch, world, gather) == 0);
      using Hier = comm::Hierarchical<comm::AllToAll, comm::Ring>;
      Strategy<Zigzag, Hier>::Arguments hier;
      hier.ranks_per_node = 2;
      CHECK(steady_state_allocations<Strategy<Zigzag, Hier>>(batch, world, hier) == 0);
      CHECK(steady_state_allocations<Strategy<partition::BatchAware<Uniform>, comm::AllToAll>>(batch, world) == 0);
      // With attention sinks: the epilogue and the gradient's gather allocate nothing after the first call.
      CHECK(steady_state_allocations<Strategy<Zigzag, comm::Ring>>(batch, world, {}, true) == 0);
      CHECK(steady_state_allocations<Strategy<Zigzag, Hier>>(batch, world, hier, true) == 0);
    }
  }

  TEST_CASE("the counter sees allocations (the test above can fail)") {
    const std::size_t before = t_allocations;
    auto* p = new std::vector<int>(100);
    delete p;
    CHECK(t_allocations - before >= 2);
  }

  TEST_CASE("ranks whose program caches disagree (one hits, one misses) both fail with a mismatch") {
    const DocumentBatch a = DocumentBatch::single({30, 20, 14});
    const DocumentBatch b = DocumentBatch::single({30, 20, 15});
    std::vector<std::string> errors(2);
    std::mutex mu;
    try {
      backend::inproc::World(2, {.timeout = std::chrono::milliseconds(5000)}).run([&](backend::inproc::Transport& t) {
        DistributedAttention<Strategy<partition::Zigzag, comm::Ring>, attention::CpuFlash<float>> attn(t, {2, 2, 8});
        const auto call = [&](const DocumentBatch& batch) {
          const std::int64_t n = attn.local_tokens(batch);
          ThdTensor<float> q(n, 2, 8), o(n, 2, 8);
          LseTensor<float> lse(2, n);
          attn.forward(batch, q.view(), q.view(), q.view(), o.view(), lse.view());
        };
        try {
          call(a);                      // both ranks: a miss, then a cached program for `a`
          call(t.rank() == 0 ? a : b);  // rank 0 hits its cache, rank 1 misses with another batch
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          errors[static_cast<std::size_t>(t.rank())] = e.what();
          throw;
        }
      });
    } catch (const std::exception&) {
    }
    for (const std::string& e : errors) {
      CAPTURE(e);
      CHECK(e.find("disagree") != std::string::npos);
    }
  }
}
