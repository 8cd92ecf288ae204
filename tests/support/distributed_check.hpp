// SPDX-License-Identifier: Apache-2.0
// The one distributed test driver: runs an attention engine (any strategy, any kernel) on a world of
// ranks, each holding its shard in the kernel's memory (a Storage: host vectors here, device memory in
// tests/cuda/device_storage.hpp), unchunked or chunk by chunk through runtime::ChunkedAttention, and
// compares forward and backward with the fp64 reference over the whole, unsharded batch; byte counts
// are checked against what the programs declare.
#pragma once

#include <seqpar/core/chunk.hpp>
#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/pipeline.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace seqpar::test {

/// Random document lengths: lognormal around `median`, clipped to [1, remaining], summing to `tokens`.
inline std::vector<std::int64_t> lognormal_docs(std::int64_t tokens, double median, double sigma, std::mt19937& rng) {
  std::lognormal_distribution<double> dist(std::log(median), sigma);
  std::vector<std::int64_t> docs;
  std::int64_t left = tokens;
  while (left > 0) {
    const auto len = std::clamp<std::int64_t>(static_cast<std::int64_t>(dist(rng)), 1, left);
    docs.push_back(len);
    left -= len;
  }
  return docs;
}

/// B sequences of `tokens` each, with lognormal documents.
inline DocumentBatch random_batch(int sequences, std::int64_t tokens, double median, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) seqs.push_back(lognormal_docs(tokens, median, 1.0, rng));
  return DocumentBatch(seqs);
}

/// A batch and the mask of the calls a check makes (causal unless given): `windowed(batch, w)` is the
/// batch under a sliding window of w keys (0: causal). Converts from a DocumentBatch.
struct MaskedBatch {
  DocumentBatch batch;
  AttentionMask mask;
  MaskedBatch(DocumentBatch b, AttentionMask m = {}) : batch(std::move(b)), mask(m) {}  // NOLINT: implicit on purpose
};
inline MaskedBatch windowed(const DocumentBatch& batch, std::int64_t window) {
  return {batch, AttentionMask{window}};
}

struct Errors {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0;        ///< max abs error / max abs reference value
  double dsinks = 0;                                    ///< with attention sinks: of their gradient (every rank's)
  bool bytes_match = true;                              ///< every rank, every call: declared bytes == counted bytes
  std::uint64_t bytes_forward = 0, bytes_backward = 0;  ///< summed over ranks (and chunks)
  [[nodiscard]] double max() const { return std::max({o, lse, dq, dk, dv, dsinks}); }
};

/// Makes a rank's DistributedAttention (any strategy) on its transport.
template <class Kernel>
using AttentionFactory = std::function<std::unique_ptr<runtime::AttentionEngine<Kernel>>(backend::inproc::Transport&)>;

/// Where the ranks' local shards live, for a kernel whose views are in host memory: an in-process world,
/// std::vector buffers, element conversion by static_cast. (tests/cuda/device_storage.hpp is the one for
/// CudaFlash: a device world sharing one GPU, device buffers.) A Storage gives:
///   run(world, body): body(backend::inproc::Transport&) on every rank;
///   Buffer<U>, upload(host values, exec), poisoned<U>(n, exec) (NaN everywhere: what a call leaves
///   unwritten shows), data(buffer), download(buffer) (after everything issued on the device);
///   from_double<U>(x), to_double(u): the element conversions.
struct HostStorage {
  template <class U>
  using Buffer = std::vector<U>;

  template <class Body>
  static void run(int world, Body&& body) {
    backend::inproc::World(world).run(std::forward<Body>(body));
  }
  template <class U, class Exec>
  static Buffer<U> upload(const std::vector<U>& host, const Exec&) {
    return host;
  }
  template <class U, class Exec>
  static Buffer<U> poisoned(std::size_t n, const Exec&) {
    return Buffer<U>(n, U(std::numeric_limits<float>::quiet_NaN()));
  }
  template <class U>
  static U* data(Buffer<U>& b) {
    return b.data();
  }
  template <class U>
  static std::vector<U> download(const Buffer<U>& b) {
    return b;
  }
  template <class U>
  static U from_double(double x) {
    return static_cast<U>(x);
  }
  template <class U>
  static double to_double(U x) {
    return static_cast<double>(x);
  }
};

/// max |got - want| / max |want| (over finite reference values); a NaN, or an infinity where the
/// reference has another value, is an infinite error.
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double scale = 0, e = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isfinite(want[i])) scale = std::max(scale, std::abs(want[i]));
    if (std::isnan(got[i]) || std::isinf(want[i]) || std::isinf(got[i])) {
      if (!(want[i] == got[i])) e = INFINITY;
    } else {
      e = std::max(e, std::abs(got[i] - want[i]));
    }
  }
  return scale > 0 ? e / scale : e;
}

namespace detail {

/// What the reference attends: the batch's document-causal slices; with a window, one full-mask slice
/// per query row over exactly the keys of its window instead, so that the oracle shares no code with the
/// sliding-window masks and slice clipping the plans are built from.
inline std::vector<AttnSlice> reference_slices(const DocumentBatch& batch, AttentionMask mask) {
  if (mask.window == 0) return batch.document_causal_slices();
  std::vector<AttnSlice> out;
  out.reserve(static_cast<std::size_t>(batch.total_tokens()));
  for (const Document& d : batch.documents())
    for (std::int64_t i = d.tokens.begin; i < d.tokens.end; ++i)
      out.push_back({{i, i + 1}, {std::max(d.tokens.begin, i + 1 - mask.window), i + 1}, Mask::full()});
  return out;
}

/// Attention with sinks in fp64, written out row by row from the definition (a softmax over the
/// row's keys and one more term e^{s_h} with no value; its backward from the explicit probabilities),
/// sharing nothing with attention/sinks.hpp's rescaling of merged rows: the oracle of the sink tests.
/// The keys of row i: its document's tokens up to i, the last `window` of them with a window.
inline void sink_reference(const DocumentBatch& batch, AttentionMask mask, const AttentionShape& shape,
                           const ThdTensor<double>& q, const ThdTensor<double>& k, const ThdTensor<double>& v,
                           const ThdTensor<double>& dout, const std::vector<double>& sinks, ThdTensor<double>& o,
                           LseTensor<double>& lse, ThdTensor<double>& dq, ThdTensor<double>& dk, ThdTensor<double>& dv,
                           std::vector<double>& dsinks) {
  const int d = shape.qk_dim(), d_v = shape.v_dim(), group = shape.heads_q / shape.heads_kv;
  const double scale = shape.scale();
  std::fill(dq.storage.begin(), dq.storage.end(), 0.0);
  std::fill(dk.storage.begin(), dk.storage.end(), 0.0);
  std::fill(dv.storage.begin(), dv.storage.end(), 0.0);
  dsinks.assign(sinks.size(), 0.0);
  std::vector<double> p, dp;
  for (const Document& doc : batch.documents())
    for (std::int64_t i = doc.tokens.begin; i < doc.tokens.end; ++i) {
      const std::int64_t lo = mask.window == 0 ? doc.tokens.begin : std::max(doc.tokens.begin, i + 1 - mask.window);
      const auto n = static_cast<std::size_t>(i + 1 - lo);
      for (int h = 0; h < shape.heads_q; ++h) {
        const int g = h / group;
        const double sink = sinks[static_cast<std::size_t>(h)];
        p.assign(n, 0.0);
        double m = sink;
        for (std::size_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int x = 0; x < d; ++x) dot += q.view()(i, h, x) * k.view()(lo + static_cast<std::int64_t>(j), g, x);
          p[j] = scale * dot;
          m = std::max(m, p[j]);
        }
        double z = m == -INFINITY ? 0.0 : std::exp(sink - m);
        for (double& x : p) z += (x = std::exp(x - m));
        for (double& x : p) x /= z;
        const double p_sink = m == -INFINITY ? 0.0 : std::exp(sink - m) / z;
        lse.view()(h, i) = m + std::log(z);
        for (int x = 0; x < d_v; ++x) {
          double acc = 0;
          for (std::size_t j = 0; j < n; ++j) acc += p[j] * v.view()(lo + static_cast<std::int64_t>(j), g, x);
          o.view()(i, h, x) = acc;
        }
        // dP_j = dO . v_j; dS_j = P_j (dP_j - sum_l P_l dP_l); the sink's dP is 0 (no value).
        dp.assign(n, 0.0);
        double mean = 0;
        for (std::size_t j = 0; j < n; ++j) {
          for (int x = 0; x < d_v; ++x)
            dp[j] += dout.view()(i, h, x) * v.view()(lo + static_cast<std::int64_t>(j), g, x);
          mean += p[j] * dp[j];
        }
        dsinks[static_cast<std::size_t>(h)] -= p_sink * mean;
        for (std::size_t j = 0; j < n; ++j) {
          const std::int64_t t = lo + static_cast<std::int64_t>(j);
          const double ds = p[j] * (dp[j] - mean) * scale;
          for (int x = 0; x < d; ++x) {
            dq.view()(i, h, x) += ds * k.view()(t, g, x);
            dk.view()(t, g, x) += ds * q.view()(i, h, x);
          }
          for (int x = 0; x < d_v; ++x) dv.view()(t, g, x) += p[j] * dout.view()(i, h, x);
        }
      }
    }
}

/// The whole batch: inputs drawn from N(0, 1) and rounded to T (what the ranks hold), the fp64 reference's
/// outputs on them, and the outputs gathered from the ranks. With `sinks` (one logit per query head,
/// rounded to the accumulation type by the caller), the reference is sink_reference's. q, k, dq, dk have
/// shape.qk_dim() values per head; v, dout, o, dv shape.v_dim().
struct WholeBatch {
  ThdTensor<double> q, k, v, dout, o_ref, dq_ref, dk_ref, dv_ref, o, dq, dk, dv;
  LseTensor<double> lse_ref, lse;
  std::vector<double> sinks, dsinks_ref;
  std::vector<std::vector<double>> dsinks;  // every rank's

  template <class Storage, class T>
  WholeBatch(const DocumentBatch& batch, AttentionMask mask, const AttentionShape& shape, std::uint32_t seed,
             std::type_identity<Storage>, std::type_identity<T>, std::vector<double> sink_logits = {})
      : sinks(std::move(sink_logits)) {
    const std::int64_t n = batch.total_tokens();
    const int d = shape.qk_dim(), d_v = shape.v_dim(), hq = shape.heads_q, hkv = shape.heads_kv;
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (auto [t, heads, width] :
         {std::tuple{&q, hq, d}, std::tuple{&k, hkv, d}, std::tuple{&v, hkv, d_v}, std::tuple{&dout, hq, d_v}}) {
      *t = ThdTensor<double>(n, heads, width);
      for (double& x : t->storage) x = Storage::to_double(Storage::template from_double<T>(normal(rng)));
    }
    for (auto [t, heads, width] : {std::tuple{&o_ref, hq, d_v}, std::tuple{&dq_ref, hq, d}, std::tuple{&dk_ref, hkv, d},
                                   std::tuple{&dv_ref, hkv, d_v}, std::tuple{&o, hq, d_v}, std::tuple{&dq, hq, d},
                                   std::tuple{&dk, hkv, d}, std::tuple{&dv, hkv, d_v}})
      *t = ThdTensor<double>(n, heads, width);
    lse_ref = LseTensor<double>(hq, n);
    lse = LseTensor<double>(hq, n);
    if (!sinks.empty()) {
      sink_reference(batch, mask, shape, q, k, v, dout, sinks, o_ref, lse_ref, dq_ref, dk_ref, dv_ref, dsinks_ref);
      return;
    }
    const attention::Reference<double> ref;
    const auto slices = reference_slices(batch, mask);
    ref.forward(shape, q.view(), k.view(), v.view(), slices, o_ref.view(), lse_ref.view());
    ref.backward(shape, q.view(), k.view(), v.view(), o_ref.view(), lse_ref.view(), dout.view(), slices, dq_ref.view(),
                 dk_ref.view(), dv_ref.view());
  }

  void errors(Errors& err) const {
    err.o = relative_error(o.storage, o_ref.storage);
    err.lse = relative_error(lse.storage, lse_ref.storage);
    err.dq = relative_error(dq.storage, dq_ref.storage);
    err.dk = relative_error(dk.storage, dk_ref.storage);
    err.dv = relative_error(dv.storage, dv_ref.storage);
    for (const std::vector<double>& got : dsinks) err.dsinks = std::max(err.dsinks, relative_error(got, dsinks_ref));
    if (!sinks.empty() && dsinks.empty()) err.dsinks = INFINITY;
  }
};

/// One rank's shard of the batch (the global rows `owned`, in order) in the storage's memory: inputs
/// uploaded, outputs poisoned; views over them, and the outputs written back at their global rows.
template <class Kernel, class Storage>
struct Shard {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;
  std::int64_t rows = 0;
  int d = 0, d_v = 0, hq = 0, hkv = 0;  // d: q, k, dq, dk; d_v: v, o, dout, dv
  typename Storage::template Buffer<T> q, k, v, dout, o, dq, dk, dv;
  typename Storage::template Buffer<A> lse;

  template <class Exec>
  Shard(const WholeBatch& g, const std::vector<Range>& owned, std::int64_t local, const Exec& exec)
      : rows(local), d(g.q.head_dim), d_v(g.v.head_dim), hq(g.q.heads), hkv(g.k.heads) {
    const auto gather = [&](const ThdTensor<double>& t) {
      std::vector<T> l;
      l.reserve(static_cast<std::size_t>(rows * t.heads * t.head_dim));
      for (const Range& r : owned)
        for (std::int64_t tok = r.begin; tok < r.end; ++tok)
          for (int h = 0; h < t.heads; ++h)
            for (int x = 0; x < t.head_dim; ++x) l.push_back(Storage::template from_double<T>(t.view()(tok, h, x)));
      return Storage::upload(l, exec);
    };
    q = gather(g.q), k = gather(g.k), v = gather(g.v), dout = gather(g.dout);
    const auto poisoned = [&](int heads, int width) {
      return Storage::template poisoned<T>(static_cast<std::size_t>(rows * heads * width), exec);
    };
    o = poisoned(hq, d_v), dq = poisoned(hq, d), dk = poisoned(hkv, d), dv = poisoned(hkv, d_v);
    lse = Storage::template poisoned<A>(static_cast<std::size_t>(rows * hq), exec);
  }
  /// A dense view of one of this shard's buffers (v, o, dout, dv at d_v values per head, the others at d).
  ThdView<T> view(typename Storage::template Buffer<T>& b, int heads) {
    const bool v_width = &b == &v || &b == &o || &b == &dout || &b == &dv;
    return ThdView<T>::dense(Storage::data(b), rows, heads, v_width ? d_v : d);
  }
  LseView<A> lse_view() { return LseView<A>::dense(Storage::data(lse), hq, rows); }

  /// Writes O, LSE, dQ, dK, dV at their global rows of `g` (the caller holds the lock).
  void scatter(const std::vector<Range>& owned, WholeBatch& g) const {
    const auto put = [&](const typename Storage::template Buffer<T>& b, ThdTensor<double>& t) {
      const std::vector<T> h = Storage::download(b);
      std::size_t at = 0;
      for (const Range& r : owned)
        for (std::int64_t tok = r.begin; tok < r.end; ++tok)
          for (int hd = 0; hd < t.heads; ++hd)
            for (int x = 0; x < t.head_dim; ++x) t.view()(tok, hd, x) = Storage::to_double(h[at++]);
    };
    put(o, g.o), put(dq, g.dq), put(dk, g.dk), put(dv, g.dv);
    const std::vector<A> l = Storage::download(lse);
    std::int64_t row = 0;
    for (const Range& r : owned)
      for (std::int64_t tok = r.begin; tok < r.end; ++tok, ++row)
        for (int h = 0; h < hq; ++h)
          g.lse.view()(h, tok) = static_cast<double>(l[static_cast<std::size_t>(h * rows + row)]);
  }
};

/// Sink logits rounded to the accumulation type A (what the ranks hold), as doubles for the oracle.
template <class A>
std::vector<double> rounded_sinks(const std::vector<double>& sinks) {
  std::vector<double> out;
  for (double s : sinks) out.push_back(static_cast<double>(static_cast<A>(s)));
  return out;
}

/// One rank's sink logits and gradient in the storage's memory (`on`: the call has sinks).
template <class A, class Storage>
struct SinkBuffers {
  bool on = false;
  std::size_t n = 0;
  typename Storage::template Buffer<A> s, ds;
  template <class Exec>
  SinkBuffers(const std::vector<double>& sinks, const Exec& exec) : on(!sinks.empty()), n(sinks.size()) {
    std::vector<A> host;
    for (double x : sinks) host.push_back(static_cast<A>(x));
    s = Storage::upload(host, exec);
    ds = Storage::template poisoned<A>(sinks.size(), exec);
  }
  std::span<const A> logits() { return {Storage::data(s), n}; }
  std::span<A> grad() { return {Storage::data(ds), n}; }
  [[nodiscard]] std::vector<double> gradient() const {
    std::vector<double> out;
    for (A x : Storage::download(ds)) out.push_back(static_cast<double>(x));
    return out;
  }
};

}  // namespace detail

/// Runs the attention `make` builds on `world` ranks (Storage's world) and returns the errors of its O, LSE,
/// dQ, dK, dV against the fp64 reference over the whole, unsharded batch (document-causal), and whether
/// every rank's bytes, forward and backward, equal what its program declares (in total and per peer).
/// Strategy-independent (instantiated once per kernel, which keeps the tests quick to build).
template <class Kernel, class Storage = HostStorage>
Errors distributed_check(const MaskedBatch& masked, const AttentionShape& shape, int world,
                         const AttentionFactory<Kernel>& make, std::uint32_t seed,
                         const std::vector<double>& sinks = {}) {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;
  const DocumentBatch& batch = masked.batch;
  const AttentionMask mask = masked.mask;
  detail::WholeBatch g(batch, mask, shape, seed, std::type_identity<Storage>{}, std::type_identity<T>{},
                       detail::rounded_sinks<A>(sinks));
  Errors err;
  std::mutex mu;
  Storage::run(world, [&](backend::inproc::Transport& transport) {
    const std::unique_ptr<runtime::AttentionEngine<Kernel>> owner = make(transport);
    runtime::AttentionEngine<Kernel>& attn = *owner;
    const auto& exec = attn.exec();
    const std::vector<Range>& owned = attn.owned_ranges(batch);
    detail::Shard<Kernel, Storage> s(g, owned, attn.local_tokens(batch), exec);
    exec.synchronize();
    const int hq = shape.heads_q, hkv = shape.heads_kv;
    detail::SinkBuffers<A, Storage> sk(g.sinks, exec);
    if (sk.on)
      attn.forward(batch, mask, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq), s.lse_view(),
                   sk.logits());
    else
      attn.forward(batch, mask, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq), s.lse_view());
    exec.synchronize();
    const auto& prog = attn.program(batch, mask);
    // Declared bytes (total and per destination) must equal what the transport counted.
    const auto per_peer_total = [&](const comm::Program& p) {
      std::uint64_t sum = 0;
      for (std::uint64_t b : p.bytes_to(world, sizeof(T), sizeof(A))) sum += b;
      return sum;
    };
    const bool fwd_ok = attn.last_bytes_sent() == prog.forward.bytes_sent(sizeof(T), sizeof(A)) &&
                        per_peer_total(prog.forward) == attn.last_bytes_sent();
    const std::uint64_t fwd_bytes = attn.last_bytes_sent();
    if (sk.on)
      attn.backward(batch, mask, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq),
                    LseView<const A>(s.lse_view()), s.view(s.dout, hq), s.view(s.dq, hq), s.view(s.dk, hkv),
                    s.view(s.dv, hkv), sk.logits(), sk.grad());
    else
      attn.backward(batch, mask, s.view(s.q, hq), s.view(s.k, hkv), s.view(s.v, hkv), s.view(s.o, hq),
                    LseView<const A>(s.lse_view()), s.view(s.dout, hq), s.view(s.dq, hq), s.view(s.dk, hkv),
                    s.view(s.dv, hkv));
    exec.synchronize();
    const bool bwd_ok = attn.last_bytes_sent() == prog.backward.bytes_sent(sizeof(T), sizeof(A)) &&
                        per_peer_total(prog.backward) == attn.last_bytes_sent();
    const std::lock_guard lock(mu);
    err.bytes_match = err.bytes_match && fwd_ok && bwd_ok;
    err.bytes_forward += fwd_bytes;
    err.bytes_backward += attn.last_bytes_sent();
    s.scatter(owned, g);
    if (sk.on) g.dsinks.push_back(sk.gradient());
  });
  g.errors(err);
  return err;
}

/// The chunked entry point: runtime::ChunkedAttention over the engine `make` builds runs `chunks` in the
/// order `ops` gives (each chunk's forward, and its backward after its forward), and the gathered outputs
/// are compared with the reference on the whole batch; bytes_match: each call's last_bytes_sent() equals
/// what its prefix program (program(c, 0) forward, program(c, 2) backward) declares; bytes_forward and
/// bytes_backward sum those over calls and ranks.
template <class Kernel, class Storage = HostStorage>
Errors distributed_check(const MaskedBatch& masked, const std::vector<Chunk>& chunks,
                         const std::vector<schedule::StageOp>& ops, const AttentionShape& shape, int world,
                         const AttentionFactory<Kernel>& make, std::uint32_t seed,
                         const std::vector<double>& sinks = {}) {
  using T = typename Kernel::value_type;
  using A = typename Kernel::accum_type;
  detail::WholeBatch g(masked.batch, masked.mask, shape, seed, std::type_identity<Storage>{}, std::type_identity<T>{},
                       detail::rounded_sinks<A>(sinks));
  Errors err;
  std::mutex mu;
  Storage::run(world, [&](backend::inproc::Transport& transport) {
    const std::unique_ptr<runtime::AttentionEngine<Kernel>> owner = make(transport);
    const auto& exec = owner->exec();
    runtime::ChunkedAttention<Kernel> chunked(*owner);
    chunked.begin(chunks, masked.mask);
    const int nc = chunked.num_chunks();
    const int hq = shape.heads_q, hkv = shape.heads_kv;
    std::vector<std::unique_ptr<detail::Shard<Kernel, Storage>>> loc(static_cast<std::size_t>(nc));
    bool bytes_ok = static_cast<int>(ops.size()) == 2 * nc;
    std::uint64_t fwd_bytes = 0, bwd_bytes = 0;
    detail::SinkBuffers<A, Storage> sk(g.sinks, exec);
    std::vector<double> dsinks(g.sinks.size(), 0.0);  // summed over the chunks' backwards
    for (const schedule::StageOp& op : ops) {
      const int c = op.chunk;
      auto& s = loc[static_cast<std::size_t>(c)];
      if (!op.backward) {
        s = std::make_unique<detail::Shard<Kernel, Storage>>(g, chunked.owned_global(c), chunked.local_tokens(c), exec);
        exec.synchronize();
        if (sk.on)
          chunked.forward(c, s->view(s->q, hq), s->view(s->k, hkv), s->view(s->v, hkv), s->view(s->o, hq),
                          s->lse_view(), sk.logits());
        else
          chunked.forward(c, s->view(s->q, hq), s->view(s->k, hkv), s->view(s->v, hkv), s->view(s->o, hq),
                          s->lse_view());
      } else if (sk.on) {
        chunked.backward(c, s->view(s->q, hq), s->view(s->k, hkv), s->view(s->v, hkv), s->view(s->o, hq),
                         LseView<const A>(s->lse_view()), s->view(s->dout, hq), s->view(s->dq, hq), s->view(s->dk, hkv),
                         s->view(s->dv, hkv), sk.logits(), sk.grad());
        const std::vector<double> part = sk.gradient();
        for (std::size_t h = 0; h < dsinks.size(); ++h) dsinks[h] += part[h];
      } else {
        chunked.backward(c, s->view(s->q, hq), s->view(s->k, hkv), s->view(s->v, hkv), s->view(s->o, hq),
                         LseView<const A>(s->lse_view()), s->view(s->dout, hq), s->view(s->dq, hq), s->view(s->dk, hkv),
                         s->view(s->dv, hkv));
      }
      const int pass = op.backward ? 2 : 0;
      bytes_ok = bytes_ok && chunked.last_bytes_sent() == chunked.program(c, pass).bytes_sent(sizeof(T), sizeof(A));
      (op.backward ? bwd_bytes : fwd_bytes) += chunked.last_bytes_sent();
    }
    exec.synchronize();
    const std::lock_guard lock(mu);
    err.bytes_match = err.bytes_match && bytes_ok;
    err.bytes_forward += fwd_bytes;
    err.bytes_backward += bwd_bytes;
    for (int c = 0; c < nc; ++c)
      if (loc[static_cast<std::size_t>(c)]) loc[static_cast<std::size_t>(c)]->scatter(chunked.owned_global(c), g);
    if (sk.on) g.dsinks.push_back(dsinks);
  });
  g.errors(err);
  return err;
}

/// Every chunk's forward in order, then every backward in reverse.
inline std::vector<schedule::StageOp> forward_then_backward(std::size_t chunks) {
  std::vector<schedule::StageOp> ops;
  for (std::size_t c = 0; c < chunks; ++c) ops.push_back({false, static_cast<int>(c)});
  for (std::size_t c = chunks; c-- > 0;) ops.push_back({true, static_cast<int>(c)});
  return ops;
}

/// The unchunked check on host memory (the name the strategy, plan and train tests use).
template <class Kernel>
Errors check_attention(const MaskedBatch& batch, const AttentionShape& shape, int world,
                       const AttentionFactory<Kernel>& make, std::uint32_t seed,
                       const std::vector<double>& sinks = {}) {
  return distributed_check<Kernel, HostStorage>(batch, shape, world, make, seed, sinks);
}

/// Runs StrategyT with Kernel on `world` ranks (Storage's world) and returns the errors against the reference.
/// Arguments without a mask mix get the batch's mask as their mix (placement balanced for it).
template <class StrategyT, class Kernel, class Storage = HostStorage>
Errors check_strategy(const MaskedBatch& batch, const AttentionShape& shape, int world,
                      typename StrategyT::Arguments args = {}, Kernel kernel = {}, std::uint32_t seed = 7,
                      const std::vector<double>& sinks = {}) {
  if (!args.masks.declared()) args.masks = MaskMix::only(batch.mask);
  return distributed_check<Kernel, Storage>(
      batch, shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<StrategyT, Kernel>>(t, shape, args, kernel);
      },
      seed, sinks);
}

}  // namespace seqpar::test
