// SPDX-License-Identifier: Apache-2.0
// testing::TinyTransformer: the hand-written backward against central finite differences of the loss
// (fp64, every parameter block, a packed batch of several documents: testing::single_device_step), activation
// checkpointing (a checkpointed cache keeps only the layer input, refuses backward, and recomputes bit for bit),
// and its argument checks.
#include <doctest/doctest.h>

#include <seqpar/attention/reference.hpp>
#include <seqpar/core/document_batch.hpp>
#include <seqpar_testing/reference_step.hpp>
#include <seqpar_testing/tiny_transformer.hpp>

#include <cmath>
#include <initializer_list>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/expect_error.hpp"

using namespace seqpar;
using Model = testing::TinyTransformer<double>;

namespace {

train::TokenBatch make_batch(const std::vector<std::vector<std::int64_t>>& seqs, int vocab, std::uint64_t seed) {
  train::TokenBatch b{DocumentBatch(seqs), {}};
  std::mt19937_64 rng(seed);
  for (std::int64_t i = 0; i < b.documents.total_tokens(); ++i)
    b.tokens.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(vocab)));
  return b;
}

// The call throws std::invalid_argument whose message names every part.
template <class F>
void expect_error(F&& f, std::initializer_list<const char*> parts) {
  const std::string msg = test::invalid_message(std::forward<F>(f));
  CAPTURE(msg);
  CHECK(!msg.empty());
  for (const char* p : parts) CHECK(msg.find(p) != std::string::npos);
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("TinyTransformer: backward equals central finite differences of the loss, every parameter block") {
    Model m({.vocab = 13, .dim = 8, .layers = 2, .heads_q = 4, .heads_kv = 2, .head_dim = 4, .ffn = 12});
    m.init(11);
    const train::TokenBatch b = make_batch({{5, 1, 7}, {9, 3}}, 13, 3);
    const std::vector<double> grads = testing::single_device_step(m, b).grads;
    std::mt19937_64 rng(5);
    int checked = 0;
    for (const Model::Block& blk : m.blocks()) {
      // A few entries of every block (all of the small ones).
      for (int probe = 0; probe < 6; ++probe) {
        const std::size_t i = blk.offset + static_cast<std::size_t>(rng() % blk.size);
        const double keep = m.params()[i], eps = 1e-5;
        m.params()[i] = keep + eps;
        const double up = testing::single_device_step(m, b).loss;
        m.params()[i] = keep - eps;
        const double down = testing::single_device_step(m, b).loss;
        m.params()[i] = keep;
        const double fd = (up - down) / (2 * eps);
        CAPTURE(blk.name);
        CAPTURE(i);
        CHECK(grads[i] == doctest::Approx(fd).epsilon(1e-6).scale(1e-3));
        ++checked;
      }
    }
    CHECK(checked == 6 * static_cast<int>(m.blocks().size()));
    // The gradient is not trivially zero anywhere it should not be.
    for (const Model::Block& blk : m.blocks()) {
      double norm = 0;
      for (std::size_t i = 0; i < blk.size; ++i) norm += std::abs(grads[blk.offset + i]);
      CAPTURE(blk.name);
      CHECK(norm > 0);
    }
  }

  TEST_CASE("TinyTransformer: a checkpointed cache refuses backward until recomputed, and recomputation is exact") {
    Model m({.vocab = 7, .dim = 8, .layers = 1, .heads_q = 2, .heads_kv = 2, .head_dim = 4, .ffn = 8});
    m.init(2);
    const train::TokenBatch b = make_batch({{6, 4}}, 7, 9);
    const auto slices = b.documents.document_causal_slices();
    const attention::Reference<double> ref;
    const AttentionShape shape = m.config().attention_shape();
    const auto attend = [&](auto q, auto k, auto v, auto o, auto lse) { ref.forward(shape, q, k, v, slices, o, lse); };
    const auto attend_bwd = [&](auto q, auto k, auto v, auto o, auto lse, auto dout, auto dq, auto dk, auto dv) {
      ref.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv);
    };
    const std::size_t n = b.tokens.size(), d = 8;
    std::vector<double> x(n * d), out(n * d), again(n * d), dout(n * d, 0.5), dx(n * d), g(m.num_params());
    m.embed(b.tokens, x);
    const std::vector<std::int64_t> positions = b.positions();
    Model::LayerCache cache;
    m.layer_forward(0, x, positions, attend, cache, out);
    const std::size_t full = cache.bytes();
    CHECK(full == n * m.activation_values_per_row() * sizeof(double));
    cache.checkpoint();
    CHECK(cache.checkpointed());
    CHECK(cache.bytes() == n * d * sizeof(double));
    expect_error([&] { m.layer_backward(0, cache, positions, dout, attend_bwd, dx, g); },
                 {"TinyTransformer::layer_backward", "cache", "recompute"});
    m.layer_forward(0, cache.x, positions, attend, cache, again);
    CHECK(again == out);
    CHECK(cache.bytes() == full);
  }

  TEST_CASE("TinyTransformer: bad arguments name themselves") {
    expect_error([] { Model({.head_dim = 3}); }, {"TinyTransformer", "head_dim", "3"});
    expect_error([] { Model({.vocab = 1}); }, {"TinyTransformer", "vocab", "1"});
    Model m({.vocab = 5, .dim = 4, .layers = 1, .heads_q = 1, .heads_kv = 1, .head_dim = 2, .ffn = 4});
    std::vector<double> h(8);
    expect_error([&] { m.embed(std::vector<int>{1, 5}, h); }, {"TinyTransformer::embed", "tokens[1]", "5"});
    expect_error([&] { m.embed(std::vector<int>{1}, h); }, {"TinyTransformer::embed", "h.size()", "8"});
  }
}
