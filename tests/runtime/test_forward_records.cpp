// SPDX-License-Identifier: Apache-2.0
// backward's check of its O and LSE: memory that still holds a forward of another batch is refused
// before any communication (std::invalid_argument naming o or lse on the rank that passed it,
// Errc::kPeerFailed on its peers); one object serving many layers, forward 1..L then backward L..1,
// keeps working; O and LSE copied into memory a forward of another batch once wrote are accepted.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <mutex>
#include <random>
#include <string>
#include <vector>

using namespace seqpar;

namespace {

using Ring = Strategy<partition::Zigzag, comm::Ring>;
using Attn = DistributedAttention<Ring, attention::Reference<double>>;
using Local = AttentionTensors<double>;

const AttentionShape kShape{2, 1, 4};
// 16 tokens each, other documents: every rank holds 8 rows of either.
const DocumentBatch kBatch({{10, 6}}), kOther({{6, 10}});

void fill(Local& l, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  for (auto* t : {&l.q, &l.k, &l.v, &l.dout})
    for (double& x : t->storage) x = u(rng);
}

void forward(Attn& attn, const DocumentBatch& b, Local& l) {
  attn.forward(b, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
}
void backward(Attn& attn, const DocumentBatch& b, Local& l) {
  attn.backward(b, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                l.dk.view(), l.dv.view());
}

// Each rank's error message ("" if it returned normally).
template <class Body>
std::vector<std::string> run_world(int n, Body body) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::mutex mu;
  try {
    backend::inproc::World(n, {.timeout = std::chrono::seconds(5)}).run([&](backend::inproc::Transport& t) {
      try {
        body(t.rank(), t);
      } catch (const std::exception& e) {
        std::lock_guard lock(mu);
        errors[static_cast<std::size_t>(t.rank())] = e.what();
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return errors;
}

bool contains_text(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("runtime") {
  TEST_CASE(
      "backward refuses O and LSE a forward of another batch wrote, on the rank that passed them, its peers failing") {
    for (const int stale_rank : {0, 1}) {
      CAPTURE(stale_rank);
      const auto errors = run_world(2, [&](int rank, auto& t) {
        Attn attn(t, kShape);
        Local a(attn.local_tokens(kBatch), kShape), b(attn.local_tokens(kOther), kShape);
        fill(a, 1), fill(b, 2);
        forward(attn, kBatch, a);
        forward(attn, kOther, b);
        // The stale rank runs the backward of kOther with kBatch's O and LSE (an earlier step's buffers).
        Local& mine = rank == stale_rank ? a : b;
        attn.backward(kOther, b.q.view(), b.k.view(), b.v.view(), mine.o.view(), mine.lse.view(), b.dout.view(),
                      b.dq.view(), b.dk.view(), b.dv.view());
      });
      const std::string& stale = errors[static_cast<std::size_t>(stale_rank)];
      const std::string& peer = errors[static_cast<std::size_t>(1 - stale_rank)];
      CAPTURE(stale);
      CAPTURE(peer);
      CHECK(contains_text(stale, "DistributedAttention::backward: o = "));
      CHECK(contains_text(stale, "holds the output of a forward of another batch (fingerprint " +
                                     std::to_string(kBatch.fingerprint())));
      CHECK(contains_text(peer,
                          "rank " + std::to_string(stale_rank) + " refused its arguments before any communication"));
    }
    // LSE alone stale (O from the right forward): named as lse.
    const auto errors = run_world(2, [&](int, auto& t) {
      Attn attn(t, kShape);
      Local a(attn.local_tokens(kBatch), kShape), b(attn.local_tokens(kOther), kShape);
      fill(a, 1), fill(b, 2);
      forward(attn, kBatch, a);
      forward(attn, kOther, b);
      attn.backward(kOther, b.q.view(), b.k.view(), b.v.view(), b.o.view(), a.lse.view(), b.dout.view(), b.dq.view(),
                    b.dk.view(), b.dv.view());
    });
    for (const std::string& e : errors) CHECK(contains_text(e, "DistributedAttention::backward: lse = "));
  }

  TEST_CASE("one object serving many layers: forward 1..L then backward L..1 gives each layer's own gradients") {
    constexpr int kLayers = 5;
    const auto errors = run_world(2, [&](int, auto& t) {
      Attn attn(t, kShape), single(t, kShape);
      const std::int64_t n = attn.local_tokens(kBatch);
      std::vector<Local> layers(kLayers, Local(n, kShape));
      for (int l = 0; l < kLayers; ++l) fill(layers[static_cast<std::size_t>(l)], 10u + static_cast<unsigned>(l));
      for (auto& l : layers) forward(attn, kBatch, l);
      for (int l = kLayers - 1; l >= 0; --l) backward(attn, kBatch, layers[static_cast<std::size_t>(l)]);
      for (auto& l : layers) {  // each layer alone, forward then backward, on a second object
        Local want(n, kShape);
        want.q = l.q, want.k = l.k, want.v = l.v, want.dout = l.dout;
        forward(single, kBatch, want);
        backward(single, kBatch, want);
        CHECK(want.dq.storage == l.dq.storage);
        CHECK(want.dk.storage == l.dk.storage);
        CHECK(want.dv.storage == l.dv.storage);
      }
    });
    for (const std::string& e : errors) CHECK(e.empty());
  }

  TEST_CASE("backward accepts O and LSE copied into memory a forward of another batch wrote (overwritten since)") {
    const auto errors = run_world(2, [&](int, auto& t) {
      Attn attn(t, kShape);
      Local a(attn.local_tokens(kBatch), kShape), b(attn.local_tokens(kOther), kShape);
      fill(a, 1), fill(b, 2);
      forward(attn, kBatch, a);  // a's O and LSE: kBatch's
      forward(attn, kOther, b);
      a.o.storage = b.o.storage, a.lse.storage = b.lse.storage;  // a recycled buffer now holds kOther's
      attn.backward(kOther, b.q.view(), b.k.view(), b.v.view(), a.o.view(), a.lse.view(), b.dout.view(), b.dq.view(),
                    b.dk.view(), b.dv.view());
      const auto dq = b.dq.storage;
      backward(attn, kOther, b);
      CHECK(dq == b.dq.storage);
      // The same batch's stale buffers of an earlier step are its own outputs: accepted.
      forward(attn, kBatch, a);
      backward(attn, kBatch, a);
    });
    for (const std::string& e : errors) CHECK(e.empty());
  }
}
