// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `testing::TinyTransformer<T>`: a small decoder-only transformer with a hand-written backward, for
/// proving that seqpar's distributed attention (and schedules built on it: chunking, pipelines)
/// leave a training step exactly as a single device computes it, and for demos. Not a production
/// model: plain loops, no fused kernels; the attention is whatever the caller passes.
///
/// Per layer (pre-norm): a = RMSNorm(x); q, k, v = a Wq, a Wk, a Wv; RoPE on q and k (per document
/// position); o = attention(q, k, v) (the caller's: GQA with heads_q / heads_kv query heads per KV
/// head); h = x + o Wo; b = RMSNorm(h); out = h + (silu(b Wg) * (b Wu)) Wd (SwiGLU). The model
/// starts with an embedding lookup and ends with a final RMSNorm, logits against the embedding (tied
/// output) and cross-entropy against next-token labels. Activations are row-major (rows = tokens,
/// `dim` values each), so a block of rows of q, k, v, o is a dense THD view (tokens, heads, head_dim).
///
/// Rows are independent everywhere except in the attention, which is why a stage of a pipeline, or a
/// rank of a context-parallel group, can run a layer on any block of rows: the caller's attention call
/// sees the block's q, k, v and does the cross-row (and cross-rank) work.
///
/// @code
/// testing::TinyTransformer<double> model({.vocab = 64, .dim = 32, .layers = 2});
/// model.init(7);
/// std::vector<double> h(n * dim), g(model.num_params());
/// model.embed(tokens, h);
/// for (int l = 0; l < layers; ++l) model.layer_forward(l, h, positions, attend, cache[l], h_next) ...
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::testing {

/// Sizes of a TinyTransformer.
struct TinyConfig {
  int vocab = 64;
  int dim = 32;  ///< model width
  int layers = 2;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 8;  ///< even (RoPE rotates pairs)
  int ffn = 64;      ///< SwiGLU hidden width
  double rope_base = 10000.0;
  double norm_eps = 1e-6;

  [[nodiscard]] AttentionShape attention_shape() const noexcept { return {heads_q, heads_kv, head_dim}; }
  void validate(const char* where = "TinyConfig") const {
    detail::require(vocab >= 2, where, "vocab", vocab, "must be >= 2");
    detail::require(dim >= 1, where, "dim", dim, "must be >= 1");
    detail::require(layers >= 1, where, "layers", layers, "must be >= 1");
    detail::require(ffn >= 1, where, "ffn", ffn, "must be >= 1");
    detail::require(head_dim >= 2 && head_dim % 2 == 0, where, "head_dim", head_dim, "must be even and >= 2 (RoPE)");
    attention_shape().validate(where);
    detail::require(rope_base > 1 && std::isfinite(rope_base), where, "rope_base", rope_base, "must be finite and > 1");
    detail::require(norm_eps > 0 && std::isfinite(norm_eps), where, "norm_eps", norm_eps, "must be finite and > 0");
  }
};

namespace detail_tiny {

// C[n x m] (+)= A[n x k] B[k x m]
template <class T>
void gemm_nn(std::int64_t n, int k, int m, const T* a, const T* b, T* c, bool accumulate) {
  for (std::int64_t i = 0; i < n; ++i) {
    T* ci = c + i * m;
    if (!accumulate) std::fill_n(ci, m, T{0});
    for (int x = 0; x < k; ++x) {
      const T ax = a[i * k + x];
      const T* bx = b + static_cast<std::int64_t>(x) * m;
      for (int j = 0; j < m; ++j) ci[j] += ax * bx[j];
    }
  }
}
// C[n x k] += D[n x m] B[k x m]^T
template <class T>
void gemm_nt(std::int64_t n, int m, int k, const T* d, const T* b, T* c) {
  for (std::int64_t i = 0; i < n; ++i)
    for (int x = 0; x < k; ++x) {
      T s{0};
      for (int j = 0; j < m; ++j) s += d[i * m + j] * b[static_cast<std::int64_t>(x) * m + j];
      c[i * k + x] += s;
    }
}
// G[k x m] += A[n x k]^T D[n x m]
template <class T>
void gemm_tn(std::int64_t n, int k, int m, const T* a, const T* d, T* g) {
  for (std::int64_t i = 0; i < n; ++i)
    for (int x = 0; x < k; ++x) {
      const T ax = a[i * k + x];
      T* gx = g + static_cast<std::int64_t>(x) * m;
      for (int j = 0; j < m; ++j) gx[j] += ax * d[i * m + j];
    }
}

}  // namespace detail_tiny

/// Parameters in one flat vector (gradients use the same layout).
template <class T>
class TinyTransformer {
 public:
  /// A named parameter block of the flat vector.
  struct Block {
    std::string name;
    std::size_t offset = 0, size = 0;
  };
  /// Activations one layer keeps for a block of rows. A checkpointed layer keeps only `x` (its input)
  /// and recomputes the rest before its backward (`layer_forward` again).
  struct LayerCache {
    std::vector<T> x, rstd1, a, q, k, v, o, h1, rstd2, b, g, u, s;
    LseTensor<T> lse;
    /// Drops everything but the input (activation checkpointing).
    void checkpoint() {
      for (std::vector<T>* t : {&rstd1, &a, &q, &k, &v, &o, &h1, &rstd2, &b, &g, &u, &s}) std::vector<T>().swap(*t);
      lse = {};
    }
    [[nodiscard]] bool checkpointed() const noexcept { return a.empty() && !x.empty(); }
    /// Bytes held (what the memory model counts).
    [[nodiscard]] std::size_t bytes() const noexcept {
      std::size_t n = lse.storage.size();
      for (const std::vector<T>* t : {&x, &rstd1, &a, &q, &k, &v, &o, &h1, &rstd2, &b, &g, &u, &s}) n += t->size();
      return n * sizeof(T);
    }
  };

  explicit TinyTransformer(TinyConfig config) : cfg_(config) {
    cfg_.validate("TinyTransformer");
    const std::size_t d = static_cast<std::size_t>(cfg_.dim), f = static_cast<std::size_t>(cfg_.ffn);
    const std::size_t qd = static_cast<std::size_t>(cfg_.heads_q) * static_cast<std::size_t>(cfg_.head_dim);
    const std::size_t kd = static_cast<std::size_t>(cfg_.heads_kv) * static_cast<std::size_t>(cfg_.head_dim);
    add("embedding", static_cast<std::size_t>(cfg_.vocab) * d);
    for (int l = 0; l < cfg_.layers; ++l) {
      const std::string p = "layer" + std::to_string(l) + ".";
      add(p + "attn_norm", d);
      add(p + "wq", d * qd);
      add(p + "wk", d * kd);
      add(p + "wv", d * kd);
      add(p + "wo", qd * d);
      add(p + "mlp_norm", d);
      add(p + "w_gate", d * f);
      add(p + "w_up", d * f);
      add(p + "w_down", f * d);
    }
    add("final_norm", d);
    params_.assign(size_, T{0});
  }

  [[nodiscard]] const TinyConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] std::size_t num_params() const noexcept { return size_; }
  [[nodiscard]] std::span<T> params() noexcept { return params_; }
  [[nodiscard]] std::span<const T> params() const noexcept { return params_; }
  [[nodiscard]] const std::vector<Block>& blocks() const noexcept { return blocks_; }
  /// Blocks [first, last) of layer l (its 9 matrices and norms).
  [[nodiscard]] std::size_t layer_offset(int l) const { return blocks_.at(1 + 9 * static_cast<std::size_t>(l)).offset; }
  [[nodiscard]] std::size_t layer_size() const noexcept {
    return blocks_[9].offset + blocks_[9].size - blocks_[1].offset;
  }

  /// Deterministic initialization: norms 1, matrices N(0, 1/fan_in), embedding N(0, 1/dim).
  void init(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (const Block& b : blocks_) {
      const bool norm = b.name.find("norm") != std::string::npos;
      // The embedding at variance 1/dim: the tied output's logits start near unit variance.
      const double fan_in = b.name == "embedding" ? cfg_.dim : static_cast<double>(b.size) / fan_out(b.name);
      for (std::size_t i = 0; i < b.size; ++i)
        params_[b.offset + i] = norm ? T{1} : static_cast<T>(normal(rng) / std::sqrt(fan_in));
    }
  }

  /// Values per row of one layer's activations when nothing is checkpointed (LayerCache, incl. LSE).
  [[nodiscard]] std::size_t activation_values_per_row() const noexcept {
    const std::size_t d = static_cast<std::size_t>(cfg_.dim), hd = static_cast<std::size_t>(cfg_.head_dim);
    return 4 * d + 2 + 2 * static_cast<std::size_t>(cfg_.heads_q) * hd +
           2 * static_cast<std::size_t>(cfg_.heads_kv) * hd + static_cast<std::size_t>(cfg_.heads_q) +
           3 * static_cast<std::size_t>(cfg_.ffn);
  }

  /// h[rows x dim] = embedding rows of `tokens`.
  void embed(std::span<const int> tokens, std::span<T> h) const {
    check_rows("TinyTransformer::embed", "h", h.size(), tokens.size());
    const auto d = static_cast<std::size_t>(cfg_.dim);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      check_token("TinyTransformer::embed", tokens[i], i);
      std::copy_n(params_.data() + static_cast<std::size_t>(tokens[i]) * d, d, h.data() + i * d);
    }
  }
  /// grads(embedding) += scatter of dh by token.
  void embed_backward(std::span<const int> tokens, std::span<const T> dh, std::span<T> grads) const {
    check_rows("TinyTransformer::embed_backward", "dh", dh.size(), tokens.size());
    check_grads("TinyTransformer::embed_backward", grads);
    const auto d = static_cast<std::size_t>(cfg_.dim);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      check_token("TinyTransformer::embed_backward", tokens[i], i);
      T* g = grads.data() + static_cast<std::size_t>(tokens[i]) * d;
      for (std::size_t j = 0; j < d; ++j) g[j] += dh[i * d + j];
    }
  }

  /// One layer on a block of rows. `positions[i]`: row i's position in its document (RoPE).
  /// `attend(q, k, v, o, lse)` runs the attention of the block (views over the cache's q, k, v, o).
  /// Keeps the activations in `cache` (whose `x` may already hold `x`: recomputation) and writes out.
  template <class Attend>
  void layer_forward(int layer, std::span<const T> x, std::span<const std::int64_t> positions, Attend&& attend,
                     LayerCache& cache, std::span<T> out) const {
    constexpr const char* where = "TinyTransformer::layer_forward";
    check_layer(where, layer);
    const std::int64_t n = static_cast<std::int64_t>(positions.size());
    check_rows(where, "x", x.size(), positions.size());
    check_rows(where, "out", out.size(), positions.size());
    const int d = cfg_.dim, f = cfg_.ffn, qd = cfg_.heads_q * cfg_.head_dim, kd = cfg_.heads_kv * cfg_.head_dim;
    const LayerParams p = layer_params(layer);
    const auto sz = [](std::int64_t rows, int w) {
      return static_cast<std::size_t>(rows) * static_cast<std::size_t>(w);
    };
    if (cache.x.data() != x.data()) cache.x.assign(x.begin(), x.end());
    cache.rstd1.resize(sz(n, 1));
    cache.a.resize(sz(n, d));
    rmsnorm(n, cache.x.data(), p.attn_norm, cache.a.data(), cache.rstd1.data());
    cache.q.resize(sz(n, qd));
    cache.k.resize(sz(n, kd));
    cache.v.resize(sz(n, kd));
    detail_tiny::gemm_nn(n, d, qd, cache.a.data(), p.wq, cache.q.data(), false);
    detail_tiny::gemm_nn(n, d, kd, cache.a.data(), p.wk, cache.k.data(), false);
    detail_tiny::gemm_nn(n, d, kd, cache.a.data(), p.wv, cache.v.data(), false);
    rope(positions, cache.q.data(), cfg_.heads_q, +1);
    rope(positions, cache.k.data(), cfg_.heads_kv, +1);
    cache.o.assign(sz(n, qd), T{0});
    cache.lse = LseTensor<T>(cfg_.heads_q, n);
    attend(thd<const T>(cache.q, n, cfg_.heads_q), thd<const T>(cache.k, n, cfg_.heads_kv),
           thd<const T>(cache.v, n, cfg_.heads_kv), thd<T>(cache.o, n, cfg_.heads_q), cache.lse.view());
    cache.h1.assign(cache.x.begin(), cache.x.end());
    detail_tiny::gemm_nn(n, qd, d, cache.o.data(), p.wo, cache.h1.data(), true);
    cache.rstd2.resize(sz(n, 1));
    cache.b.resize(sz(n, d));
    rmsnorm(n, cache.h1.data(), p.mlp_norm, cache.b.data(), cache.rstd2.data());
    cache.g.resize(sz(n, f));
    cache.u.resize(sz(n, f));
    cache.s.resize(sz(n, f));
    detail_tiny::gemm_nn(n, d, f, cache.b.data(), p.w_gate, cache.g.data(), false);
    detail_tiny::gemm_nn(n, d, f, cache.b.data(), p.w_up, cache.u.data(), false);
    for (std::size_t i = 0; i < cache.s.size(); ++i) cache.s[i] = silu(cache.g[i]) * cache.u[i];
    std::copy(cache.h1.begin(), cache.h1.end(), out.begin());
    detail_tiny::gemm_nn(n, f, d, cache.s.data(), p.w_down, out.data(), true);
  }

  /// Backward of `layer_forward` (the cache must be complete: recompute a checkpointed layer first).
  /// `attend_backward(q, k, v, o, lse, dout, dq, dk, dv)` is the attention's backward (dq, dk, dv
  /// zeroed by the caller's kernel contract: they are zero-filled here). dx = d(loss)/dx; grads +=.
  template <class AttendBackward>
  void layer_backward(int layer, const LayerCache& cache, std::span<const std::int64_t> positions,
                      std::span<const T> dout, AttendBackward&& attend_backward, std::span<T> dx,
                      std::span<T> grads) const {
    constexpr const char* where = "TinyTransformer::layer_backward";
    check_layer(where, layer);
    detail::require(!cache.a.empty() || cache.x.empty(), where, "cache", "checkpointed",
                    "recompute the layer (layer_forward) before its backward");
    const std::int64_t n = static_cast<std::int64_t>(positions.size());
    check_rows(where, "cache.x", cache.x.size(), positions.size());
    check_rows(where, "dout", dout.size(), positions.size());
    check_rows(where, "dx", dx.size(), positions.size());
    check_grads(where, grads);
    const int d = cfg_.dim, f = cfg_.ffn, qd = cfg_.heads_q * cfg_.head_dim, kd = cfg_.heads_kv * cfg_.head_dim;
    const LayerParams p = layer_params(layer);
    LayerParams gp = layer_params(layer, grads.data());
    const auto sz = [](std::int64_t rows, int w) {
      return static_cast<std::size_t>(rows) * static_cast<std::size_t>(w);
    };
    // MLP: out = h1 + s Wd, s = silu(g) u.
    std::vector<T> dh1(dout.begin(), dout.end()), ds(sz(n, f), T{0});
    detail_tiny::gemm_tn(n, f, d, cache.s.data(), dout.data(), gp.w_down);
    detail_tiny::gemm_nt(n, d, f, dout.data(), p.w_down, ds.data());
    std::vector<T> dg(sz(n, f)), du(sz(n, f));
    for (std::size_t i = 0; i < ds.size(); ++i) {
      const T sg = sigmoid(cache.g[i]);
      du[i] = ds[i] * cache.g[i] * sg;
      dg[i] = ds[i] * cache.u[i] * sg * (T{1} + cache.g[i] * (T{1} - sg));
    }
    detail_tiny::gemm_tn(n, d, f, cache.b.data(), dg.data(), gp.w_gate);
    detail_tiny::gemm_tn(n, d, f, cache.b.data(), du.data(), gp.w_up);
    std::vector<T> db(sz(n, d), T{0});
    detail_tiny::gemm_nt(n, f, d, dg.data(), p.w_gate, db.data());
    detail_tiny::gemm_nt(n, f, d, du.data(), p.w_up, db.data());
    rmsnorm_backward(n, cache.h1.data(), p.mlp_norm, cache.rstd2.data(), db.data(), dh1.data(), gp.mlp_norm);
    // Attention: h1 = x + o Wo.
    std::vector<T> dov(sz(n, qd), T{0});
    detail_tiny::gemm_tn(n, qd, d, cache.o.data(), dh1.data(), gp.wo);
    detail_tiny::gemm_nt(n, d, qd, dh1.data(), p.wo, dov.data());
    std::vector<T> dq(sz(n, qd), T{0}), dk(sz(n, kd), T{0}), dv(sz(n, kd), T{0});
    attend_backward(thd<const T>(cache.q, n, cfg_.heads_q), thd<const T>(cache.k, n, cfg_.heads_kv),
                    thd<const T>(cache.v, n, cfg_.heads_kv), thd<const T>(cache.o, n, cfg_.heads_q), cache.lse.view(),
                    thd<const T>(dov, n, cfg_.heads_q), thd<T>(dq, n, cfg_.heads_q), thd<T>(dk, n, cfg_.heads_kv),
                    thd<T>(dv, n, cfg_.heads_kv));
    rope(positions, dq.data(), cfg_.heads_q, -1);
    rope(positions, dk.data(), cfg_.heads_kv, -1);
    detail_tiny::gemm_tn(n, d, qd, cache.a.data(), dq.data(), gp.wq);
    detail_tiny::gemm_tn(n, d, kd, cache.a.data(), dk.data(), gp.wk);
    detail_tiny::gemm_tn(n, d, kd, cache.a.data(), dv.data(), gp.wv);
    std::vector<T> da(sz(n, d), T{0});
    detail_tiny::gemm_nt(n, qd, d, dq.data(), p.wq, da.data());
    detail_tiny::gemm_nt(n, kd, d, dk.data(), p.wk, da.data());
    detail_tiny::gemm_nt(n, kd, d, dv.data(), p.wv, da.data());
    std::copy(dh1.begin(), dh1.end(), dx.begin());
    rmsnorm_backward(n, cache.x.data(), p.attn_norm, cache.rstd1.data(), da.data(), dx.data(), gp.attn_norm);
  }

  /// Final norm, tied logits and cross-entropy on a block of rows, forward and backward at once.
  /// labels[i] < 0: row i has no label (the last token of a document). Returns the sum of the rows'
  /// losses; dh = scale x d(sum)/dh (scale: 1 / labelled tokens of the whole batch for a mean loss);
  /// grads(embedding, final_norm) += scale x their gradients.
  T head(std::span<const T> h, std::span<const int> labels, T scale, std::span<T> dh, std::span<T> grads) const {
    constexpr const char* where = "TinyTransformer::head";
    const std::int64_t n = static_cast<std::int64_t>(labels.size());
    check_rows(where, "h", h.size(), labels.size());
    check_rows(where, "dh", dh.size(), labels.size());
    check_grads(where, grads);
    const int d = cfg_.dim, vocab = cfg_.vocab;
    const T* emb = params_.data();
    const T* w = params_.data() + blocks_.back().offset;
    T* gemb = grads.data();
    T* gw = grads.data() + blocks_.back().offset;
    std::vector<T> f(static_cast<std::size_t>(d)), rstd(1), logits(static_cast<std::size_t>(vocab)),
        df(static_cast<std::size_t>(d));
    T loss{0};
    for (std::int64_t i = 0; i < n; ++i) {
      T* dhi = dh.data() + i * d;
      std::fill_n(dhi, d, T{0});
      const int label = labels[static_cast<std::size_t>(i)];
      if (label < 0) continue;
      detail::require(label < vocab, where, "labels[" + std::to_string(i) + "]", label,
                      "must be < vocab = " + std::to_string(vocab));
      const T* hi = h.data() + i * d;
      rmsnorm(1, hi, w, f.data(), rstd.data());
      T mx = -std::numeric_limits<T>::infinity();
      for (int c = 0; c < vocab; ++c) {
        T s{0};
        for (int j = 0; j < d; ++j) s += f[static_cast<std::size_t>(j)] * emb[static_cast<std::size_t>(c) * d + j];
        logits[static_cast<std::size_t>(c)] = s;
        mx = std::max(mx, s);
      }
      T sum{0};
      for (T& z : logits) sum += std::exp(z - mx);
      loss += std::log(sum) + mx - logits[static_cast<std::size_t>(label)];
      std::fill(df.begin(), df.end(), T{0});
      for (int c = 0; c < vocab; ++c) {
        const T p = std::exp(logits[static_cast<std::size_t>(c)] - mx) / sum;
        const T dz = scale * (p - (c == label ? T{1} : T{0}));
        T* ge = gemb + static_cast<std::size_t>(c) * d;
        const T* e = emb + static_cast<std::size_t>(c) * d;
        for (int j = 0; j < d; ++j) {
          ge[j] += dz * f[static_cast<std::size_t>(j)];
          df[static_cast<std::size_t>(j)] += dz * e[j];
        }
      }
      rmsnorm_backward(1, hi, w, rstd.data(), df.data(), dhi, gw);
    }
    return loss;
  }

 private:
  struct LayerParams {
    T *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w_gate, *w_up, *w_down;
  };

  void add(std::string name, std::size_t size) {
    blocks_.push_back({std::move(name), size_, size});
    size_ += size;
  }
  [[nodiscard]] double fan_out(const std::string& name) const {
    const double qd = static_cast<double>(cfg_.heads_q) * cfg_.head_dim;
    const double kd = static_cast<double>(cfg_.heads_kv) * cfg_.head_dim;
    const auto ends = [&](const char* s) { return name.size() >= std::string(s).size() && name.ends_with(s); };
    if (ends(".wq")) return qd;
    if (ends(".wk") || ends(".wv")) return kd;
    if (ends(".w_gate") || ends(".w_up")) return cfg_.ffn;
    return cfg_.dim;  // wo, w_down
  }
  [[nodiscard]] LayerParams layer_params(int l, T* base) const {
    const std::size_t b = 1 + 9 * static_cast<std::size_t>(l);
    const auto at = [&](std::size_t i) { return base + blocks_[b + i].offset; };
    return {at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8)};
  }
  [[nodiscard]] LayerParams layer_params(int l) const { return layer_params(l, const_cast<T*>(params_.data())); }

  template <class U, class V>
  [[nodiscard]] ThdView<U> thd(V& storage, std::int64_t n, int heads) const {
    return ThdView<U>::dense(const_cast<U*>(storage.data()), n, heads, cfg_.head_dim);
  }

  static T sigmoid(T x) { return T{1} / (T{1} + std::exp(-x)); }
  static T silu(T x) { return x * sigmoid(x); }

  // y = x * rstd * w per row; rstd = 1 / sqrt(mean(x^2) + eps).
  void rmsnorm(std::int64_t n, const T* x, const T* w, T* y, T* rstd) const {
    const int d = cfg_.dim;
    for (std::int64_t i = 0; i < n; ++i) {
      T ss{0};
      for (int j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
      const T r = T{1} / std::sqrt(ss / static_cast<T>(d) + static_cast<T>(cfg_.norm_eps));
      rstd[i] = r;
      for (int j = 0; j < d; ++j) y[i * d + j] = x[i * d + j] * r * w[j];
    }
  }
  // dx += rstd (dy w) - x rstd^3 sum_j (dy_j w_j x_j) / d;  dw += sum_rows dy x rstd.
  void rmsnorm_backward(std::int64_t n, const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw) const {
    const int d = cfg_.dim;
    for (std::int64_t i = 0; i < n; ++i) {
      const T r = rstd[i];
      T dot{0};
      for (int j = 0; j < d; ++j) {
        dot += dy[i * d + j] * w[j] * x[i * d + j];
        dw[j] += dy[i * d + j] * x[i * d + j] * r;
      }
      const T c = r * r * r * dot / static_cast<T>(d);
      for (int j = 0; j < d; ++j) dx[i * d + j] += r * dy[i * d + j] * w[j] - c * x[i * d + j];
    }
  }
  // Rotates pairs (2i, 2i+1) of every head by +-pos * base^(-2i / head_dim).
  void rope(std::span<const std::int64_t> positions, T* x, int heads, int sign) const {
    const int hd = cfg_.head_dim;
    for (std::size_t t = 0; t < positions.size(); ++t)
      for (int i = 0; i < hd / 2; ++i) {
        const double theta =
            static_cast<double>(positions[t]) * std::pow(cfg_.rope_base, -2.0 * i / static_cast<double>(hd));
        const T c = static_cast<T>(std::cos(theta)), s = static_cast<T>(sign * std::sin(theta));
        for (int h = 0; h < heads; ++h) {
          T* p = x + (t * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)) * static_cast<std::size_t>(hd);
          const T a = p[2 * i], b = p[2 * i + 1];
          p[2 * i] = a * c - b * s;
          p[2 * i + 1] = a * s + b * c;
        }
      }
  }

  void check_layer(const char* where, int layer) const {
    detail::require(layer >= 0 && layer < cfg_.layers, where, "layer", layer,
                    "must be in [0, layers) = [0, " + std::to_string(cfg_.layers) + ")");
  }
  void check_rows(const char* where, const char* what, std::size_t size, std::size_t rows) const {
    detail::require(size == rows * static_cast<std::size_t>(cfg_.dim), where, std::string(what) + ".size()", size,
                    "must be rows x dim = " + std::to_string(rows) + " x " + std::to_string(cfg_.dim));
  }
  void check_grads(const char* where, std::span<const T> grads) const {
    detail::require(grads.size() == size_, where, "grads.size()", grads.size(),
                    "must be num_params() = " + std::to_string(size_));
  }
  void check_token(const char* where, int token, std::size_t i) const {
    detail::require(token >= 0 && token < cfg_.vocab, where, "tokens[" + std::to_string(i) + "]", token,
                    "must be in [0, vocab) = [0, " + std::to_string(cfg_.vocab) + ")");
  }

  TinyConfig cfg_;
  std::vector<Block> blocks_;
  std::size_t size_ = 0;
  std::vector<T> params_;
};

}  // namespace seqpar::testing
