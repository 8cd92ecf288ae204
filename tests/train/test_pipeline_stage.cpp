// SPDX-License-Identifier: Apache-2.0
// train::run_pipelined_step with a model of the test's own (issue 28 item 6: DPP for any model). The
// model is not TinyTransformer: an additive sinusoidal position code on the embedding, attention
// without norms or RoPE, a tanh MLP with a bias, an untied readout and a squared-error loss against the
// one-hot next token. Its stage (`MixerStage`, a train::PipelineStage written here) runs on 1-4
// pipeline stages x 1-3 attention ranks over DynamicChunk plans with split, hybrid and batched chunks
// and checkpointing; the loss and every parameter block's gradient (summed over ranks) must equal a
// single-process fp64 step of the same model over the whole batch (attention::Reference) within 1e-12
// of the reference's largest value (observed: at most 5e-15), and each rank's activation bytes after
// every forward the memory model's for its rows. A stage that breaks the protocol (rows not one to
// one, widths that do not chain, a wrong layer count) is refused with std::invalid_argument on its
// rank before any stage method runs.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/reference.hpp>
#include <seqpar/backend/inproc/world.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/pipelined_step.hpp>
#include <seqpar_testing/pipelined_step.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace seqpar;
using Kernel = attention::CpuFlash<double>;

namespace {

// Row-major helpers: C[n x m] += A[n x k] B[k x m]; C[n x k] += D[n x m] B[k x m]^T; G[k x m] += A^T D.
void mm(std::size_t n, std::size_t k, std::size_t m, const double* a, const double* b, double* c) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t x = 0; x < k; ++x)
      for (std::size_t j = 0; j < m; ++j) c[i * m + j] += a[i * k + x] * b[x * m + j];
}
void mm_nt(std::size_t n, std::size_t m, std::size_t k, const double* d, const double* b, double* c) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t x = 0; x < k; ++x)
      for (std::size_t j = 0; j < m; ++j) c[i * k + x] += d[i * m + j] * b[x * m + j];
}
void mm_tn(std::size_t n, std::size_t k, std::size_t m, const double* a, const double* d, double* g) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t x = 0; x < k; ++x)
      for (std::size_t j = 0; j < m; ++j) g[x * m + j] += a[i * k + x] * d[i * m + j];
}

// The test's model: x0 = E[token] + 0.1 sin(0.37 (j + 1) position); per layer
// h = x + attention(x Wq, x Wk, x Wv) Wo, out = h + tanh(h W1 + b1) W2; loss = sum over labelled rows
// of 0.5 |out R - onehot(label)|^2. Parameters in one flat vector.
struct Mixer {
  int vocab = 13, dim = 6, layers = 4, heads_q = 2, heads_kv = 1, head_dim = 4, hidden = 10;
  struct Layer {
    std::size_t wq, wk, wv, wo, w1, b1, w2;
  };
  struct Block {
    std::string name;
    std::size_t offset, size;
  };
  std::vector<Layer> layer;
  std::vector<Block> blocks;
  std::size_t embedding = 0, readout = 0;
  std::vector<double> params;
  /// Layer l's attention mask: masks[l % masks.size()] (empty: every layer causal).
  std::vector<AttentionMask> masks;
  AttentionMask mask_of(int l) const {
    return masks.empty() ? AttentionMask{} : masks[static_cast<std::size_t>(l) % masks.size()];
  }

  std::size_t qd() const { return static_cast<std::size_t>(heads_q * head_dim); }
  std::size_t kd() const { return static_cast<std::size_t>(heads_kv * head_dim); }
  std::size_t d() const { return static_cast<std::size_t>(dim); }
  std::size_t f() const { return static_cast<std::size_t>(hidden); }
  AttentionShape shape() const { return {heads_q, heads_kv, head_dim}; }

  std::size_t add(const std::string& name, std::size_t n) {
    blocks.push_back({name, params.size(), n});
    params.resize(params.size() + n);
    return blocks.back().offset;
  }
  void init(std::uint64_t seed) {
    embedding = add("embedding", static_cast<std::size_t>(vocab) * d());
    for (int l = 0; l < layers; ++l) {
      const std::string p = "layer" + std::to_string(l) + ".";
      Layer w{};
      w.wq = add(p + "wq", d() * qd());
      w.wk = add(p + "wk", d() * kd());
      w.wv = add(p + "wv", d() * kd());
      w.wo = add(p + "wo", qd() * d());
      w.w1 = add(p + "w1", d() * f());
      w.b1 = add(p + "b1", f());
      w.w2 = add(p + "w2", f() * d());
      layer.push_back(w);
    }
    readout = add("readout", d() * static_cast<std::size_t>(vocab));
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (double& p : params) p = 0.3 * normal(rng);
  }
  const double* w(std::size_t offset) const { return params.data() + offset; }

  void embed(std::span<const int> tokens, std::span<const std::int64_t> pos, std::span<double> x) const {
    for (std::size_t i = 0; i < tokens.size(); ++i)
      for (std::size_t j = 0; j < d(); ++j)
        x[i * d() + j] = w(embedding)[static_cast<std::size_t>(tokens[i]) * d() + j] +
                         0.1 * std::sin(0.37 * static_cast<double>(j + 1) * static_cast<double>(pos[i]));
  }
  void embed_backward(std::span<const int> tokens, std::span<const double> dx, std::span<double> g) const {
    for (std::size_t i = 0; i < tokens.size(); ++i)
      for (std::size_t j = 0; j < d(); ++j)
        g[embedding + static_cast<std::size_t>(tokens[i]) * d() + j] += dx[i * d() + j];
  }

  struct Cache {
    std::vector<double> x, q, k, v, o, h, a;
    LseTensor<double> lse;
    std::size_t bytes() const {
      return (x.size() + q.size() + k.size() + v.size() + o.size() + h.size() + a.size() + lse.storage.size()) *
             sizeof(double);
    }
  };
  double activation_values_per_row() const {
    return static_cast<double>(2 * d() + 2 * qd() + 2 * kd() + f() + static_cast<std::size_t>(heads_q));
  }
  ThdView<double> thd(std::vector<double>& s, std::int64_t n, int heads) const {
    return ThdView<double>::dense(s.data(), n, heads, head_dim);
  }
  ThdView<const double> thd(const std::vector<double>& s, std::int64_t n, int heads) const {
    return ThdView<const double>::dense(s.data(), n, heads, head_dim);
  }

  // Keeps the activations in `c` (c.x may already hold x: recomputation) and writes the layer's output.
  template <class Attend>
  void layer_forward(int l, std::span<const double> x, Attend&& attend, Cache& c, std::span<double> out) const {
    const Layer& p = layer[static_cast<std::size_t>(l)];
    const std::size_t n = x.size() / d();
    const auto rows = static_cast<std::int64_t>(n);
    if (c.x.data() != x.data()) c.x.assign(x.begin(), x.end());
    c.q.assign(n * qd(), 0.0), c.k.assign(n * kd(), 0.0), c.v.assign(n * kd(), 0.0), c.o.assign(n * qd(), 0.0);
    mm(n, d(), qd(), c.x.data(), w(p.wq), c.q.data());
    mm(n, d(), kd(), c.x.data(), w(p.wk), c.k.data());
    mm(n, d(), kd(), c.x.data(), w(p.wv), c.v.data());
    c.lse = LseTensor<double>(heads_q, rows);
    attend(thd(std::as_const(c.q), rows, heads_q), thd(std::as_const(c.k), rows, heads_kv),
           thd(std::as_const(c.v), rows, heads_kv), thd(c.o, rows, heads_q), c.lse.view());
    c.h = c.x;
    mm(n, qd(), d(), c.o.data(), w(p.wo), c.h.data());
    c.a.assign(n * f(), 0.0);
    for (std::size_t i = 0; i < n; ++i) std::copy_n(w(p.b1), f(), c.a.data() + i * f());
    mm(n, d(), f(), c.h.data(), w(p.w1), c.a.data());
    for (double& z : c.a) z = std::tanh(z);
    std::copy(c.h.begin(), c.h.end(), out.begin());
    mm(n, f(), d(), c.a.data(), w(p.w2), out.data());
  }
  template <class AttendBackward>
  void layer_backward(int l, const Cache& c, std::span<const double> dout, AttendBackward&& attend_backward,
                      std::span<double> dx, std::span<double> g) const {
    const Layer& p = layer[static_cast<std::size_t>(l)];
    const std::size_t n = dout.size() / d();
    const auto rows = static_cast<std::int64_t>(n);
    std::vector<double> dh(dout.begin(), dout.end()), dz(n * f(), 0.0);
    mm_tn(n, f(), d(), c.a.data(), dout.data(), g.data() + p.w2);
    mm_nt(n, d(), f(), dout.data(), w(p.w2), dz.data());
    for (std::size_t i = 0; i < dz.size(); ++i) dz[i] *= 1.0 - c.a[i] * c.a[i];
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < f(); ++j) g[p.b1 + j] += dz[i * f() + j];
    mm_tn(n, d(), f(), c.h.data(), dz.data(), g.data() + p.w1);
    mm_nt(n, f(), d(), dz.data(), w(p.w1), dh.data());
    std::vector<double> dov(n * qd(), 0.0), dq(n * qd(), 0.0), dk(n * kd(), 0.0), dv(n * kd(), 0.0);
    mm_tn(n, qd(), d(), c.o.data(), dh.data(), g.data() + p.wo);
    mm_nt(n, d(), qd(), dh.data(), w(p.wo), dov.data());
    attend_backward(thd(c.q, rows, heads_q), thd(c.k, rows, heads_kv), thd(c.v, rows, heads_kv),
                    thd(c.o, rows, heads_q), c.lse.view(), thd(std::as_const(dov), rows, heads_q),
                    thd(dq, rows, heads_q), thd(dk, rows, heads_kv), thd(dv, rows, heads_kv));
    mm_tn(n, d(), qd(), c.x.data(), dq.data(), g.data() + p.wq);
    mm_tn(n, d(), kd(), c.x.data(), dk.data(), g.data() + p.wk);
    mm_tn(n, d(), kd(), c.x.data(), dv.data(), g.data() + p.wv);
    std::copy(dh.begin(), dh.end(), dx.begin());
    mm_nt(n, qd(), d(), dq.data(), w(p.wq), dx.data());
    mm_nt(n, kd(), d(), dk.data(), w(p.wk), dx.data());
    mm_nt(n, kd(), d(), dv.data(), w(p.wv), dx.data());
  }
  // Sum of the labelled rows' losses; dout = scale x its gradient; g(readout) += scale x its gradient.
  double loss(std::span<const double> out, std::span<const int> labels, double scale, std::span<double> dout,
              std::span<double> g) const {
    const auto v = static_cast<std::size_t>(vocab);
    std::vector<double> r(v);
    double sum = 0;
    std::fill(dout.begin(), dout.end(), 0.0);
    for (std::size_t i = 0; i < labels.size(); ++i) {
      if (labels[i] < 0) continue;
      std::fill(r.begin(), r.end(), 0.0);
      mm(1, d(), v, out.data() + i * d(), w(readout), r.data());
      for (std::size_t c = 0; c < v; ++c) {
        r[c] -= c == static_cast<std::size_t>(labels[i]) ? 1.0 : 0.0;
        sum += 0.5 * r[c] * r[c];
        r[c] *= scale;
      }
      mm_tn(1, d(), v, out.data() + i * d(), r.data(), g.data() + readout);
      mm_nt(1, v, d(), r.data(), w(readout), dout.data() + i * d());
    }
    return sum;
  }

  // The whole batch on one process, attention::Reference over each layer's document-causal slices (one
  // full-mask slice per row over the keys of its window for a window layer: no code shared with the
  // sliding-window masks the plans use).
  double single_process_step(const train::TokenBatch& batch, std::vector<double>& g) const {
    const train::TokenMeta meta = train::whole_batch_meta(batch.documents);
    const std::vector<int> labels = batch.labels();
    std::vector<std::vector<AttnSlice>> layer_slices;
    for (int l = 0; l < layers; ++l) {
      const AttentionMask m = mask_of(l);
      auto& out = layer_slices.emplace_back();
      for (const Document& doc : batch.documents.documents()) {
        if (m.window == 0) {
          out.push_back({doc.tokens, doc.tokens, Mask::causal()});
          continue;
        }
        for (std::int64_t i = doc.tokens.begin; i < doc.tokens.end; ++i)
          out.push_back({{i, i + 1}, {std::max(doc.tokens.begin, i + 1 - m.window), i + 1}, Mask::full()});
      }
    }
    const attention::Reference<double> ref;
    const std::size_t n = batch.tokens.size();
    std::vector<Cache> caches(static_cast<std::size_t>(layers));
    std::vector<double> x(n * d()), next(n * d()), dx(n * d()), dnext(n * d());
    g.assign(params.size(), 0.0);
    embed(batch.tokens, meta.position, x);
    for (int l = 0; l < layers; ++l) {
      layer_forward(
          l, x,
          [&](auto q, auto k, auto v, auto o, auto lse) {
            ref.forward(shape(), q, k, v, layer_slices[static_cast<std::size_t>(l)], o, lse);
          },
          caches[static_cast<std::size_t>(l)], next);
      std::swap(x, next);
    }
    const double count = static_cast<double>(batch.label_tokens());
    const double loss_value = loss(x, labels, 1.0 / count, dx, g) / count;
    for (int l = layers - 1; l >= 0; --l) {
      layer_backward(
          l, caches[static_cast<std::size_t>(l)], dx,
          [&](auto q, auto k, auto v, auto o, auto lse, auto d_o, auto dq, auto dk, auto dv) {
            ref.backward(shape(), q, k, v, o, lse, d_o, layer_slices[static_cast<std::size_t>(l)], dq, dk, dv);
          },
          dnext, g);
      std::swap(dx, dnext);
    }
    embed_backward(batch.tokens, dx, g);
    return loss_value;
  }
};

// Stage s of `stages` of a Mixer on this rank: what train::run_pipelined_step asks of a model.
class MixerStage {
 public:
  using stage_category = train::pipeline_stage_tag;
  using value_type = double;
  using accum_type = double;
  struct ChunkState {
    std::vector<Mixer::Cache> caches;
    std::vector<double> grad;
  };

  MixerStage(const Mixer& model, int stage, int stages)
      : m_(&model), stage_(stage), stages_(stages), grads_(model.params.size(), 0.0) {}

  int layers() const { return m_->layers / stages_; }
  AttentionShape attention_shape() const { return m_->shape(); }
  AttentionMask attention_mask(int layer) const { return m_->mask_of(first() + layer); }
  train::ActivationShape input_shape(std::int64_t n) const { return {n, m_->dim}; }
  train::ActivationShape output_shape(std::int64_t n) const { return {n, m_->dim}; }
  train::LayerBytes layer_bytes() const {
    return {m_->activation_values_per_row() * sizeof(double), static_cast<double>(m_->d() * sizeof(double))};
  }
  std::size_t held_bytes(const ChunkState& s) const {
    std::size_t b = 0;
    for (const auto& c : s.caches) b += c.bytes();
    return b;
  }

  void forward(const train::ChunkRows& rows, std::span<const double> in, int checkpointed,
               const train::StageAttention<double>& attention, ChunkState& s, std::span<double> out) {
    ++forwards;
    const std::size_t n = static_cast<std::size_t>(rows.rows());
    std::vector<double> x(n * m_->d()), next(n * m_->d());
    if (stage_ == 0)
      m_->embed(rows.tokens, rows.positions(), x);
    else
      std::copy(in.begin(), in.end(), x.begin());
    s.caches.assign(static_cast<std::size_t>(layers()), {});
    for (int l = 0; l < layers(); ++l) {
      auto& c = s.caches[static_cast<std::size_t>(l)];
      m_->layer_forward(
          first() + l, x, [&](auto q, auto k, auto v, auto o, auto lse) { attention.forward(l, q, k, v, o, lse); }, c,
          next);
      if (l < checkpointed) {  // keeps its input only
        Mixer::Cache kept;
        kept.x = std::move(c.x);
        c = std::move(kept);
      }
      std::swap(x, next);
    }
    std::copy(x.begin(), x.end(), out.begin());
  }
  void recompute(const train::ChunkRows&, int layer, const train::StageAttention<double>& attention, ChunkState& s) {
    auto& c = s.caches[static_cast<std::size_t>(layer)];
    std::vector<double> redo(c.x.size());
    m_->layer_forward(
        first() + layer, c.x,
        [&](auto q, auto k, auto v, auto o, auto lse) { attention.forward(layer, q, k, v, o, lse); }, c, redo);
  }
  void backward(const train::ChunkRows& rows, int layer, std::span<const double> dout,
                const train::StageAttention<double>& attention, ChunkState& s, std::span<double> din) {
    if (layer == layers() - 1) s.grad.assign(dout.begin(), dout.end());
    std::vector<double> dx(s.grad.size());
    m_->layer_backward(
        first() + layer, s.caches[static_cast<std::size_t>(layer)], s.grad,
        [&](auto q, auto k, auto v, auto o, auto lse, auto d_o, auto dq, auto dk, auto dv) {
          attention.backward(layer, q, k, v, o, lse, d_o, dq, dk, dv);
        },
        dx, grads_);
    s.caches[static_cast<std::size_t>(layer)] = {};
    s.grad = std::move(dx);
    if (layer != 0) return;
    if (stage_ == 0)
      m_->embed_backward(rows.tokens, s.grad, grads_);
    else
      std::copy(s.grad.begin(), s.grad.end(), din.begin());
  }
  double loss(const train::ChunkRows& rows, std::span<const double> out, double scale, std::span<double> dout) {
    return m_->loss(out, rows.labels, scale, dout, grads_);
  }

  const std::vector<double>& grads() const { return grads_; }
  int forwards = 0;  // calls of forward (the protocol tests: none before a refusal)

 private:
  int first() const { return stage_ * layers(); }
  const Mixer* m_;
  int stage_, stages_;
  std::vector<double> grads_;
};

static_assert(train::PipelineStage<MixerStage>);

// Stages that break the protocol on one stage (`bad`) of the pipeline.
struct ExtraRowStage : MixerStage {  // sends one row more than it was given
  using MixerStage::MixerStage;
  int bad = -1, stage = -1;
  train::ActivationShape output_shape(std::int64_t n) const {
    return {stage == bad ? n + 1 : n, MixerStage::output_shape(n).width};
  }
};
struct WideInputStage : MixerStage {  // expects a wider input than the previous stage sends
  using MixerStage::MixerStage;
  int bad = -1, stage = -1;
  train::ActivationShape input_shape(std::int64_t n) const {
    return {n, MixerStage::input_shape(n).width + (stage == bad ? 1 : 0)};
  }
};
struct ExtraLayerStage : MixerStage {  // says it has a layer more than the memory model's stages hold
  using MixerStage::MixerStage;
  int bad = -1, stage = -1;
  int layers() const { return MixerStage::layers() + (stage == bad ? 1 : 0); }
};
static_assert(train::PipelineStage<ExtraRowStage> && train::PipelineStage<WideInputStage> &&
              train::PipelineStage<ExtraLayerStage>);

train::TokenBatch make_batch(std::mt19937_64& rng, int vocab, std::int64_t long_len) {
  std::vector<std::vector<std::int64_t>> seqs{{long_len}, {long_len / 2 + 5}, {}};
  for (auto& s : seqs)
    for (int i = 0; i < 6; ++i) s.push_back(2 + static_cast<std::int64_t>(rng() % 19));
  for (auto& s : seqs) std::shuffle(s.begin(), s.end(), rng);
  train::TokenBatch b{DocumentBatch(seqs), {}};
  for (std::int64_t i = 0; i < b.documents.total_tokens(); ++i)
    b.tokens.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(vocab)));
  return b;
}

struct Case {
  int stages, attention;
  std::int64_t capacity;    // DynamicChunk's token capacity
  std::int64_t window = 0;  // the model's sliding window (0: none)
  bool alternate = false;   // window on odd layers only (gpt-oss's pattern), full attention on the others
};

std::set<ChunkKind> kinds_seen;

// Returns the attention carry's bytes summed over the ranks (PipelinedStepResult::carry_bytes).
template <class S>
std::size_t check_stage(const std::string& name, Case cs, typename S::Arguments args, std::uint64_t seed) {
  CAPTURE(name);
  CAPTURE(cs.stages);
  CAPTURE(cs.attention);
  CAPTURE(cs.capacity);
  CAPTURE(cs.window);
  std::mt19937_64 rng(seed);
  Mixer model;
  model.layers = 2 * cs.stages;
  model.init(seed);
  train::TokenBatch batch = make_batch(rng, model.vocab, 80 + static_cast<std::int64_t>(rng() % 30));
  if (cs.window > 0)  // the stage's layers and the reference both take it; the chunks are the batch's
    model.masks = cs.alternate ? std::vector<AttentionMask>{{}, AttentionMask{cs.window}}
                               : std::vector<AttentionMask>{AttentionMask{cs.window}};
  schedule::DynamicChunk chunker;
  chunker.args.token_capacity = cs.capacity;
  chunker.args.cost = {.per_token = 6.0 * model.dim, .per_pair = 1.0, .masks = {}};
  std::vector<MaskMix::Part> mix;  // the chunks' cost model weighs the model's masks, one part per layer kind
  for (const AttentionMask& m : model.masks) mix.push_back({m, 1});
  chunker.args.cost.masks = MaskMix(mix);
  const schedule::ChunkPlan plan = chunker.plan(batch.documents);
  for (const auto& ch : plan.chunks) kinds_seen.insert(ch.kind);
  const auto make_kernel = [] { return Kernel({.threads = 1}); };
  const double share = testing::busiest_share(
      plan, testing::busiest_rank_tokens<S>(model.shape(), plan, cs.attention, args, make_kernel));
  const MixerStage probe(model, 0, cs.stages);
  schedule::PipelineModel pm{.stages = cs.stages,
                             .layers_per_stage = 2,
                             .static_bytes = 0,
                             .memory_cap = 1e30,
                             .activation_bytes_per_token = probe.layer_bytes().activations_per_row * share,
                             .kept_bytes_per_token = probe.layer_bytes().kept_per_row * share,
                             .seconds_per_cost = 1e-9};
  double roomy = 0;
  for (const auto& p : schedule::group_pipelines(plan, pm).pipelines)
    for (double b : p.checkpointing.peak_bytes) roomy = std::max(roomy, b);
  pm.memory_cap = 0.6 * roomy;  // the schedule checkpoints some layers
  const schedule::PipelineSchedule sched = schedule::group_pipelines(plan, pm);

  std::vector<double> want_grads;
  const double want_loss = model.single_process_step(batch, want_grads);

  std::vector<double> grads(model.params.size(), 0.0);
  double loss_sum = 0;
  long long recomputed = 0;
  std::size_t carry_bytes = 0;
  std::vector<std::string> memory;
  std::mutex mu;
  backend::inproc::World(cs.stages * cs.attention).run([&](backend::inproc::Transport& t) {
    MixerStage stage(model, train::pipeline_layout(t.size(), t.rank(), cs.stages).stage, cs.stages);
    const auto r = train::run_pipelined_step<S>(t, stage, batch, plan, sched, pm, args, make_kernel);
    const std::lock_guard lock(mu);
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i] += stage.grads()[i];
    loss_sum += r.loss_sum;
    recomputed += r.layers_recomputed;
    carry_bytes += r.carry_bytes;
    const auto measured = static_cast<double>(r.peak_activation_bytes);
    if (measured != r.predicted_peak_bytes || measured > pm.memory_cap)
      memory.push_back("rank " + std::to_string(t.rank()) + ": measured " + std::to_string(measured) + ", model " +
                       std::to_string(r.predicted_peak_bytes) + ", cap " + std::to_string(pm.memory_cap));
  });
  CHECK(recomputed > 0);
  CHECK(memory.empty());
  for (const auto& m : memory) MESSAGE(m);
  const double loss = loss_sum / static_cast<double>(batch.label_tokens());
  CHECK(std::abs(loss - want_loss) <= 1e-12 * std::abs(want_loss));
  for (const Mixer::Block& blk : model.blocks) {
    double scale = 0, err = 0;
    for (std::size_t i = blk.offset; i < blk.offset + blk.size; ++i) {
      scale = std::max(scale, std::abs(want_grads[i]));
      err = std::max(err, std::abs(grads[i] - want_grads[i]));
    }
    CAPTURE(blk.name);
    CHECK(scale > 0);
    CHECK(err <= 1e-12 * scale);
  }
  return carry_bytes;
}

// Runs `Stage` (bad on stage `bad`) on 2 stages x 2 ranks; returns what each rank threw.
// foreign_plan: the chunk plan is another batch's of the same token count (each sequence's documents in
// reverse order), without the fingerprint that names its batch (a plan made by hand or by an older version).
template <class Stage>
std::vector<std::string> refusals(int bad, std::vector<int>& forwards, bool foreign_plan = false) {
  std::mt19937_64 rng(5);
  Mixer model;
  model.init(5);
  const train::TokenBatch batch = make_batch(rng, model.vocab, 60);
  schedule::DynamicChunk chunker;
  chunker.args.token_capacity = 32;
  std::vector<std::vector<std::int64_t>> reversed(static_cast<std::size_t>(batch.documents.num_sequences()));
  for (int b = 0; b < batch.documents.num_sequences(); ++b)
    for (const Document& d : batch.documents.documents_of(b))
      reversed[static_cast<std::size_t>(b)].insert(reversed[static_cast<std::size_t>(b)].begin(), d.tokens.size());
  const DocumentBatch other(reversed);
  REQUIRE(other.total_tokens() == batch.documents.total_tokens());
  schedule::ChunkPlan plan = chunker.plan(foreign_plan ? other : batch.documents);
  if (foreign_plan) plan.batch_fingerprint = 0;
  const schedule::PipelineModel pm{.stages = 2,
                                   .layers_per_stage = 2,
                                   .static_bytes = 0,
                                   .memory_cap = 1e30,
                                   .activation_bytes_per_token = 1,
                                   .kept_bytes_per_token = 1,
                                   .seconds_per_cost = 1e-9};
  const schedule::PipelineSchedule sched = schedule::group_pipelines(plan, pm);
  std::vector<std::string> what(4);
  forwards.assign(4, 0);
  backend::inproc::World(4).run([&](backend::inproc::Transport& t) {
    Stage stage(model, t.rank() / 2, 2);
    stage.stage = t.rank() / 2;
    stage.bad = bad;
    const auto i = static_cast<std::size_t>(t.rank());
    try {
      (void)train::run_pipelined_step<Strategy<partition::Zigzag, comm::Ring>>(t, stage, batch, plan, sched, pm, {},
                                                                               [] { return Kernel({.threads = 1}); });
      what[i] = "ran";
    } catch (const std::invalid_argument& e) {
      what[i] = std::string("invalid_argument: ") + e.what();
    } catch (const Error& e) {
      what[i] = std::string(e.errc() == Errc::kPeerFailed ? "peer failed: " : "error: ") + e.what();
    }
    forwards[i] = stage.forwards;
  });
  return what;
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("test model: its hand-written gradient equals central differences (so the runner's reference is right)") {
    std::mt19937_64 rng(3);
    Mixer model;
    model.layers = 2;
    model.init(3);
    const train::TokenBatch batch = make_batch(rng, model.vocab, 12);
    std::vector<double> g, unused;
    (void)model.single_process_step(batch, g);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> dir(model.params.size());
    for (double& x : dir) x = normal(rng);
    const double eps = 1e-5;
    const std::vector<double> base = model.params;
    const auto at = [&](double t) {
      for (std::size_t i = 0; i < base.size(); ++i) model.params[i] = base[i] + t * dir[i];
      return model.single_process_step(batch, unused);
    };
    const double numeric = (at(eps) - at(-eps)) / (2 * eps);
    double analytic = 0;
    for (std::size_t i = 0; i < g.size(); ++i) analytic += g[i] * dir[i];
    CAPTURE(numeric);
    CAPTURE(analytic);
    CHECK(std::abs(numeric - analytic) <= 1e-6 * std::abs(analytic));
  }

  TEST_CASE("pipelined step of a model of one's own: loss and every gradient equal the single-process fp64 step") {
    using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    HybridRing::Arguments aware;
    aware.comm.sharding_aware = true;
    kinds_seen.clear();
    std::uint64_t seed = 300;
    for (Case c : {Case{1, 1, 40}, Case{2, 1, 40}, Case{3, 2, 32}, Case{4, 1, 24}, Case{2, 3, 48}})
      check_stage<HybridRing>("Hybrid x Ring(sharding-aware)", c, aware, ++seed);
    for (Case c : {Case{2, 2, 40}, Case{3, 1, 64}}) check_stage<ZigzagRing>("Zigzag x Ring", c, {}, ++seed);
    check_stage<Ulysses>("Uniform x AllToAll", Case{2, 1, 32}, {}, ++seed);
    // The plans had every kind of chunk: a split document's slices, documents packed whole, and both.
    CHECK(kinds_seen.count(ChunkKind::kSplit) == 1);
    CHECK(kinds_seen.count(ChunkKind::kBatched) == 1);
    CHECK(kinds_seen.count(ChunkKind::kHybrid) == 1);
  }

  TEST_CASE(
      "pipelined step over a windowed batch: loss and gradients equal the windowed fp64 step; the carry shrinks") {
    // The window reaches the chunks through the plan (DynamicChunk of the windowed documents) and the
    // reference through the batch's document_causal_slices. w = 2 still trains Wq and Wk (w = 1 would
    // leave each query one key: no gradient through the softmax, and the runner checks every block's).
    using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    HybridRing::Arguments aware;
    aware.comm.sharding_aware = true;
    const std::size_t hybrid_full =
        check_stage<HybridRing>("Hybrid x Ring(sharding-aware)", Case{3, 2, 32}, aware, 303);
    const std::size_t zigzag_full = check_stage<ZigzagRing>("Zigzag x Ring", Case{3, 1, 24}, {}, 72);
    REQUIRE(hybrid_full > 0);
    REQUIRE(zigzag_full > 0);
    for (const std::int64_t w : {2, 5, 30, 1000}) {
      const std::size_t hybrid =
          check_stage<HybridRing>("Hybrid x Ring(sharding-aware)", Case{3, 2, 32, w}, aware, 303);
      const std::size_t zigzag = check_stage<ZigzagRing>("Zigzag x Ring", Case{3, 1, 24, w}, {}, 72);
      CAPTURE(w);
      CHECK(hybrid <= hybrid_full);
      CHECK(zigzag <= zigzag_full);
      if (w <= 5) {  // shorter than a chunk: the carry holds at most w - 1 rows per split piece
        CHECK(hybrid < hybrid_full);
        CHECK(zigzag < zigzag_full);
      }
    }
  }

  TEST_CASE("pipelined step of a model alternating window and full layers: one set of rows, every gradient exact") {
    // gpt-oss's pattern through DPP: odd layers windowed, even layers full, every layer of a stage on the
    // same rows of each chunk (the placement is the chunk batch's, whatever the mask), each layer's carry
    // following its own mask; against the single-process fp64 step with each layer's own mask.
    using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
    using PerDocGather = Strategy<partition::PerDoc, comm::AllGather>;
    HybridRing::Arguments aware;
    aware.comm.sharding_aware = true;
    aware.masks = {{AttentionMask::causal(), 1}, {AttentionMask{5}, 1}};
    PerDocGather::Arguments gather;
    gather.masks = aware.masks;
    for (const std::int64_t w : {2, 5, 30}) {
      CAPTURE(w);
      (void)check_stage<HybridRing>("Hybrid x Ring(sharding-aware), alternating", Case{2, 2, 32, w, true}, aware, 404);
      (void)check_stage<PerDocGather>("PerDoc x AllGather, alternating", Case{3, 2, 24, w, true}, gather, 405);
    }
  }

  TEST_CASE("pipelined step: a stage that breaks the protocol is refused before any stage method runs") {
    std::vector<int> forwards;
    {  // stage 1 says it sends one row more than it holds
      const auto what = refusals<ExtraRowStage>(1, forwards);
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        CAPTURE(what[static_cast<std::size_t>(r)]);
        CHECK(forwards[static_cast<std::size_t>(r)] == 0);
        if (r / 2 == 1) {
          CHECK(what[static_cast<std::size_t>(r)].starts_with(
              "invalid_argument: train::run_pipelined_step: stage.output_shape("));
          CHECK(what[static_cast<std::size_t>(r)].find("one to one") != std::string::npos);
        } else {
          CHECK(what[static_cast<std::size_t>(r)].starts_with("peer failed: "));
          CHECK(what[static_cast<std::size_t>(r)].find("refused its stage") != std::string::npos);
        }
      }
    }
    {  // stage 1 expects a wider input than stage 0 sends: every rank sees it in the agreed table
      const auto what = refusals<WideInputStage>(1, forwards);
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        CAPTURE(what[static_cast<std::size_t>(r)]);
        CHECK(forwards[static_cast<std::size_t>(r)] == 0);
        CHECK(what[static_cast<std::size_t>(r)].starts_with(
            "invalid_argument: train::run_pipelined_step: stage.input_shape(rows).width of rank 2 = 7"));
      }
    }
    {  // stage 0 has a layer too many
      const auto what = refusals<ExtraLayerStage>(0, forwards);
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        CAPTURE(what[static_cast<std::size_t>(r)]);
        CHECK(forwards[static_cast<std::size_t>(r)] == 0);
        CHECK(what[static_cast<std::size_t>(r)].starts_with(
            r / 2 == 0 ? "invalid_argument: train::run_pipelined_step: stage.layers() = 3: must be "
                         "memory_model.layers_per_stage = 2"
                       : "peer failed: train::run_pipelined_step: rank 0 refused its stage"));
      }
    }
    {  // another batch's chunks (same token count, no fingerprint on the plan): ChunkedAttention::begin(batch,
       // ...) finds a chunk's piece crossing this batch's documents, on every rank, before any stage method
      const auto what = refusals<ExtraRowStage>(-1, forwards, true);
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        CAPTURE(what[static_cast<std::size_t>(r)]);
        CHECK(forwards[static_cast<std::size_t>(r)] == 0);
        CHECK(what[static_cast<std::size_t>(r)].starts_with("invalid_argument: ChunkedAttention::begin: chunks["));
        CHECK(what[static_cast<std::size_t>(r)].find("(the chunks of another batch, of fingerprint other than this "
                                                     "batch's ") != std::string::npos);
      }
    }
    {  // the well-formed stage runs (the harness itself is not what refuses)
      const auto what = refusals<ExtraRowStage>(-1, forwards);
      for (int r = 0; r < 4; ++r) CHECK(what[static_cast<std::size_t>(r)] == "ran");
      CHECK(forwards[0] > 0);
    }
  }
}
