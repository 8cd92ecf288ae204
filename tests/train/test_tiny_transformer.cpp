// SPDX-License-Identifier: Apache-2.0
// train::TinyTransformer: the hand-written backward against central finite differences of the loss
// (fp64, every parameter block, a packed batch of several documents with the fp64 reference
// attention), row-block independence (a layer run on two halves of the rows with the attention over
// the whole block equals one run), and its argument checks.
#include <doctest/doctest.h>

#include <seqpar/attention/reference.hpp>
#include <seqpar/core/document_batch.hpp>
#include <seqpar/train/tiny_transformer.hpp>

#include <cmath>
#include <initializer_list>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/expect_error.hpp"

using namespace seqpar;
using Model = train::TinyTransformer<double>;

namespace {

struct Batch {
  DocumentBatch docs;
  std::vector<int> tokens, labels;
  std::vector<std::int64_t> positions;
};

Batch make_batch(const std::vector<std::vector<std::int64_t>>& seqs, int vocab, std::uint64_t seed) {
  Batch b{DocumentBatch(seqs), {}, {}, {}};
  std::mt19937_64 rng(seed);
  for (const auto& seq : seqs)
    for (std::int64_t len : seq)
      for (std::int64_t i = 0; i < len; ++i) {
        b.tokens.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(vocab)));
        b.positions.push_back(i);
      }
  std::size_t at = 0;
  for (const auto& seq : seqs)
    for (std::int64_t len : seq)
      for (std::int64_t i = 0; i < len; ++i, ++at) b.labels.push_back(i + 1 < len ? b.tokens[at + 1] : -1);
  return b;
}

// Mean loss over labelled tokens of the whole batch and (optionally) its gradient.
double step(const Model& m, const Batch& b, std::vector<double>* grads) {
  const train::TinyConfig& c = m.config();
  const std::size_t n = b.tokens.size(), d = static_cast<std::size_t>(c.dim);
  const auto slices = b.docs.document_causal_slices();
  const AttentionShape shape = c.attention_shape();
  const attention::Reference<double> ref;
  const auto attend = [&](auto q, auto k, auto v, auto o, auto lse) { ref.forward(shape, q, k, v, slices, o, lse); };
  const auto attend_bwd = [&](auto q, auto k, auto v, auto o, auto lse, auto dout, auto dq, auto dk, auto dv) {
    ref.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv);
  };
  std::vector<Model::LayerCache> caches(static_cast<std::size_t>(c.layers));
  std::vector<double> h(n * d), next(n * d), dh(n * d), dx(n * d);
  std::vector<double> g(m.num_params(), 0.0);
  m.embed(b.tokens, h);
  for (int l = 0; l < c.layers; ++l) {
    m.layer_forward(l, h, b.positions, attend, caches[static_cast<std::size_t>(l)], next);
    std::swap(h, next);
  }
  double count = 0;
  for (int y : b.labels) count += y >= 0 ? 1 : 0;
  const double loss = m.head(h, b.labels, 1.0 / count, dh, g) / count;
  if (grads == nullptr) return loss;
  for (int l = c.layers - 1; l >= 0; --l) {
    m.layer_backward(l, caches[static_cast<std::size_t>(l)], b.positions, dh, attend_bwd, dx, g);
    std::swap(dh, dx);
  }
  m.embed_backward(b.tokens, dh, g);
  *grads = g;
  return loss;
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
    const Batch b = make_batch({{5, 1, 7}, {9, 3}}, 13, 3);
    std::vector<double> grads;
    step(m, b, &grads);
    std::mt19937_64 rng(5);
    int checked = 0;
    for (const Model::Block& blk : m.blocks()) {
      // A few entries of every block (all of the small ones).
      for (int probe = 0; probe < 6; ++probe) {
        const std::size_t i = blk.offset + static_cast<std::size_t>(rng() % blk.size);
        const double keep = m.params()[i], eps = 1e-5;
        m.params()[i] = keep + eps;
        const double up = step(m, b, nullptr);
        m.params()[i] = keep - eps;
        const double down = step(m, b, nullptr);
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
    const Batch b = make_batch({{6, 4}}, 7, 9);
    const auto slices = b.docs.document_causal_slices();
    const attention::Reference<double> ref;
    const AttentionShape shape = m.config().attention_shape();
    const auto attend = [&](auto q, auto k, auto v, auto o, auto lse) { ref.forward(shape, q, k, v, slices, o, lse); };
    const auto attend_bwd = [&](auto q, auto k, auto v, auto o, auto lse, auto dout, auto dq, auto dk, auto dv) {
      ref.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv);
    };
    const std::size_t n = b.tokens.size(), d = 8;
    std::vector<double> x(n * d), out(n * d), again(n * d), dout(n * d, 0.5), dx(n * d), g(m.num_params());
    m.embed(b.tokens, x);
    Model::LayerCache cache;
    m.layer_forward(0, x, b.positions, attend, cache, out);
    const std::size_t full = cache.bytes();
    CHECK(full == n * m.activation_values_per_row() * sizeof(double));
    cache.checkpoint();
    CHECK(cache.checkpointed());
    CHECK(cache.bytes() == n * d * sizeof(double));
    expect_error([&] { m.layer_backward(0, cache, b.positions, dout, attend_bwd, dx, g); },
                 {"TinyTransformer::layer_backward", "cache", "recompute"});
    m.layer_forward(0, cache.x, b.positions, attend, cache, again);
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
