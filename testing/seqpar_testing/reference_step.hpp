// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `testing::single_device_step`: a TinyTransformer's training step on one device over the whole
/// packed batch, with attention::Reference (document-causal, fp64 accumulation when T is double): the
/// answer a distributed, chunked or pipelined step must reproduce.

#include <cstddef>
#include <utility>
#include <vector>

#include "seqpar/attention/reference.hpp"
#include "seqpar/train/token_batch.hpp"
#include "seqpar_testing/tiny_transformer.hpp"

namespace seqpar::testing {

/// The mean next-token loss over the batch's labelled tokens and its gradient (num_params()).
template <class T>
struct StepResult {
  T loss = 0;
  std::vector<T> grads;
};

template <class T>
[[nodiscard]] StepResult<T> single_device_step(const TinyTransformer<T>& model, const train::TokenBatch& batch) {
  constexpr const char* where = "testing::single_device_step";
  batch.validate(where);
  detail::require(batch.label_tokens() > 0, where, "batch", "no labels", "needs a document of at least 2 tokens");
  const TinyConfig& c = model.config();
  const auto n = batch.tokens.size(), d = static_cast<std::size_t>(c.dim);
  const std::vector<std::int64_t> pos = batch.positions();
  const std::vector<int> labels = batch.labels();
  const auto slices = batch.documents.document_causal_slices();
  const AttentionShape shape = c.attention_shape();
  const attention::Reference<T> ref;
  std::vector<typename TinyTransformer<T>::LayerCache> caches(static_cast<std::size_t>(c.layers));
  std::vector<T> h(n * d), next(n * d), dh(n * d), dx(n * d);
  StepResult<T> out;
  out.grads.assign(model.num_params(), T{0});
  model.embed(batch.tokens, h);
  for (int l = 0; l < c.layers; ++l) {
    model.layer_forward(
        l, h, pos, [&](auto q, auto k, auto v, auto o, auto lse) { ref.forward(shape, q, k, v, slices, o, lse); },
        caches[static_cast<std::size_t>(l)], next);
    std::swap(h, next);
  }
  const auto count = static_cast<T>(batch.label_tokens());
  out.loss = model.head(h, labels, T{1} / count, dh, out.grads) / count;
  for (int l = c.layers - 1; l >= 0; --l) {
    model.layer_backward(
        l, caches[static_cast<std::size_t>(l)], pos, dh,
        [&](auto q, auto k, auto v, auto o, auto lse, auto dout, auto dq, auto dk, auto dv) {
          ref.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv);
        },
        dx, out.grads);
    std::swap(dh, dx);
  }
  model.embed_backward(batch.tokens, dh, out.grads);
  return out;
}

}  // namespace seqpar::testing
