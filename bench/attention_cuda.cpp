// SPDX-License-Identifier: Apache-2.0
// CudaFlash and (built with seqpar::cudnn) CudnnSdpa forward/backward throughput on one GPU: bf16, 16 query and 16 KV
// heads, head dim 64 and 128, 16K tokens as 1 x 16K, 4 x 4K and 32 x 512 causal sequences and as one packed sequence of
// lognormal documents (document-causal). FLOPs = 4 * d * Hq * (visible pairs) forward, 2.5x that
// backward, the FlashAttention convention, so that the figures compare with torch's SDPA backends
// timed on the same shapes by bench/device/torch_peers.py (which reads --mixes-out).
// Each kernel is called with its prepared Params (prepare once, then the calls: the executor's path).
// Timing: CUDA events on the kernel's stream around `inner` back-to-back calls (inner chosen so that a
// sample lasts a few milliseconds: launch gaps stay out of short cases), after warm-up; the figure is
// the median over the samples, per call. dq/dk/dv accumulate, so they are zeroed before each backward
// sample, outside the events. The device-to-device copy bandwidth of a 1 GiB buffer is measured in
// the same run as the memory ceiling. Each forward is spot-checked against an fp64 reference on a few
// rows, and every output is scanned for non-finite values: a fast wrong kernel does not pass unseen.
// --compare (built with seqpar::cudnn): instead, CudnnSdpa against CudaFlash on identical inputs at the bench
// sizes, forward and backward (O, LSE, dQ, dK, dV), MHA and GQA 4:1, d 64 and 128, a window of 4096 and
// MLA's 192/128, within TransformerEngine's bf16 tolerance 2.5e-2 (issue 38; compiled only so far).
//   attention_cuda [--smoke] [--compare] [--json FILE] [--mixes-out FILE] [--head-dim D] [--reps N]
// Without a CUDA device it says so and exits 77 (CTest: skipped), after writing --mixes-out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"
#if SEQPAR_ENABLE_CUDNN
#include "seqpar/gpu/cudnn_sdpa.hpp"
#endif
#include "seqpar/gpu/slices.hpp"
#include "support/device_fill.hpp"
#include "support/json.hpp"

namespace seqpar::bench {
namespace {

constexpr const char* kWhere = "attention_cuda";

// ---- the token mixes ----------------------------------------------------------------------------
// splitmix64 and Box-Muller written out rather than std::lognormal_distribution, whose algorithm is
// the standard library's own: bench/device/torch_peers.py regenerates exactly these lengths when it
// is given no --mixes file. sigma * z and median * exp(.) are single roundings (no add after a
// multiply that a compiler could fuse), so C++ and Python on one libm agree bit for bit.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }  // in (0, 1)
};

std::vector<std::int64_t> lognormal_docs(std::int64_t tokens, double median, double sigma, std::uint64_t seed) {
  SplitMix64 rng{seed};
  std::vector<std::int64_t> docs;
  for (std::int64_t left = tokens; left > 0;) {
    const double u1 = rng.uniform(), u2 = rng.uniform();
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    const double x = median * std::exp(sigma * z);
    const std::int64_t len = std::clamp<std::int64_t>(static_cast<std::int64_t>(x), 1, left);
    docs.push_back(len);
    left -= len;
  }
  return docs;
}

struct Mix {
  std::string name;
  std::vector<std::vector<std::int64_t>> sequences;  // document lengths per sequence
};

struct LognormalSpec {
  double median, sigma;
  std::uint64_t seed;
};

std::vector<Mix> make_mixes(std::int64_t tokens, const LognormalSpec& ln) {
  std::vector<Mix> mixes;
  for (std::int64_t seqs : {std::int64_t{1}, std::int64_t{4}, std::int64_t{32}}) {
    if (tokens % seqs != 0 || tokens / seqs < 1) continue;
    Mix m{std::to_string(seqs) + "x" + std::to_string(tokens / seqs), {}};
    m.sequences.assign(static_cast<std::size_t>(seqs), {tokens / seqs});
    mixes.push_back(std::move(m));
  }
  mixes.push_back({"lognormal", {lognormal_docs(tokens, ln.median, ln.sigma, ln.seed)}});
  return mixes;
}

bool write_mixes(const std::string& path, std::int64_t tokens, const LognormalSpec& ln, const std::vector<Mix>& mixes) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  std::fprintf(f,
               "{\"tokens\": %lld, \"lognormal\": {\"median\": %.17g, \"sigma\": %.17g, \"seed\": %llu, "
               "\"generator\": \"splitmix64 + Box-Muller, see bench/attention_cuda.cpp\"},\n \"mixes\": [\n",
               static_cast<long long>(tokens), ln.median, ln.sigma, static_cast<unsigned long long>(ln.seed));
  for (std::size_t i = 0; i < mixes.size(); ++i) {
    std::fprintf(f, "  {\"name\": \"%s\", \"sequences\": [", mixes[i].name.c_str());
    for (std::size_t s = 0; s < mixes[i].sequences.size(); ++s) {
      std::fprintf(f, "%s[", s ? ", " : "");
      const auto& docs = mixes[i].sequences[s];
      for (std::size_t d = 0; d < docs.size(); ++d)
        std::fprintf(f, "%s%lld", d ? ", " : "", static_cast<long long>(docs[d]));
      std::fprintf(f, "]");
    }
    std::fprintf(f, "]}%s\n", i + 1 < mixes.size() ? "," : "");
  }
  std::fprintf(f, " ]\n}\n");
  return std::fclose(f) == 0;
}

// ---- device helpers (support/device_fill.cu) ----------------------------------------------------
template <class T>
float to_float(T x) {
  return gpu::detail::to_float(x);
}

template <class T>
void fill_normal(cudaStream_t s, const gpu::DeviceArray<T>& a, std::uint64_t seed) {
  bench::fill_normal(s, a.data(), 0, static_cast<std::int64_t>(a.size()), seed);
}

template <class T>
unsigned long long count_nonfinite(cudaStream_t s, const gpu::DeviceArray<T>& a,
                                   const gpu::DeviceArray<unsigned long long>& counter) {
  return bench::count_nonfinite(s, a.data(), static_cast<std::int64_t>(a.size()), counter.data());
}

// ---- timing -------------------------------------------------------------------------------------
class Events {
 public:
  Events() {
    SEQPAR_CUDA_CHECK(cudaEventCreate(&start_), kWhere);
    SEQPAR_CUDA_CHECK(cudaEventCreate(&stop_), kWhere);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  /// Milliseconds the stream spent on `body`.
  template <class Body>
  float time(cudaStream_t s, Body&& body) {
    SEQPAR_CUDA_CHECK(cudaEventRecord(start_, s), kWhere);
    body();
    SEQPAR_CUDA_CHECK(cudaEventRecord(stop_, s), kWhere);
    SEQPAR_CUDA_CHECK(cudaEventSynchronize(stop_), kWhere);
    float ms = 0;
    SEQPAR_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_), kWhere);
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

struct Timing {
  double ms = 0;  ///< median per call
  double min_ms = 0;
  int inner = 1;  ///< calls per sample
  int samples = 0;
};

struct TimingPlan {
  int warmup = 3;
  int samples = 15;
  double sample_ms = 4.0;  ///< a sample's target length: back-to-back calls hide the launch gaps
  int max_inner = 100;
};

/// `before` runs outside the events before each sample (resets), `call` is what is timed.
template <class Before, class Call>
Timing time_calls(cudaStream_t s, const TimingPlan& plan, Before&& before, Call&& call) {
  Events ev;
  for (int i = 0; i < plan.warmup; ++i) {
    before();
    call();
  }
  before();
  const double one = ev.time(s, call);
  Timing t;
  t.inner = std::clamp(static_cast<int>(std::ceil(plan.sample_ms / std::max(one, 1e-3))), 1, plan.max_inner);
  std::vector<double> per_call;
  for (int r = 0; r < plan.samples; ++r) {
    before();
    const double ms = ev.time(s, [&] {
      for (int i = 0; i < t.inner; ++i) call();
    });
    per_call.push_back(ms / t.inner);
  }
  std::sort(per_call.begin(), per_call.end());
  t.samples = plan.samples;
  t.ms = per_call[per_call.size() / 2];
  t.min_ms = per_call.front();
  return t;
}

// ---- the fp64 spot check ------------------------------------------------------------------------
struct Spot {
  double o_err = 0, lse_err = 0;  ///< max abs error / max abs reference value (o); max abs error (lse)
  int rows = 0;
};

/// A few (token, head) rows of the forward against an fp64 reference computed from the same bf16
/// inputs: the last token of the longest document, a first token, and rows spread over the batch.
template <class T>
Spot spot_check(const DocumentBatch& batch, const AttentionShape& shape, const gpu::DeviceArray<T>& q,
                const gpu::DeviceArray<T>& k, const gpu::DeviceArray<T>& v, const gpu::DeviceArray<T>& o,
                const gpu::DeviceArray<float>& lse) {
  SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), kWhere);  // to_host copies on the legacy stream, not the kernel's
  const std::vector<T> hq = q.to_host(), hk = k.to_host(), hv = v.to_host(), ho = o.to_host();
  const std::vector<float> hl = lse.to_host();
  const std::int64_t n = batch.total_tokens();
  const int d = shape.head_dim, H = shape.heads_q, Hk = shape.heads_kv;
  std::vector<std::int64_t> tokens{0, n - 1, n / 3, (2 * n) / 3 + 1};
  const auto docs = batch.documents();
  const auto longest =
      std::max_element(docs.begin(), docs.end(), [](auto& a, auto& b) { return a.tokens.size() < b.tokens.size(); });
  tokens.push_back(longest->tokens.end - 1);
  Spot spot;
  double max_ref = 0, max_diff = 0;
  for (std::int64_t t : tokens) {
    t = std::clamp<std::int64_t>(t, 0, n - 1);
    std::int64_t begin = 0;
    for (const Document& doc : docs)
      if (doc.tokens.begin <= t && t < doc.tokens.end) begin = doc.tokens.begin;
    for (int h : {0, H - 1}) {
      const int kv_head = h / shape.group_size();
      const auto at = [&](const std::vector<T>& x, std::int64_t tok, int head, int heads, int c) {
        return static_cast<double>(to_float(x[static_cast<std::size_t>((tok * heads + head) * d + c)]));
      };
      std::vector<double> s;
      double m = -INFINITY;
      for (std::int64_t j = begin; j <= t; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += at(hq, t, h, H, c) * at(hk, j, kv_head, Hk, c);
        s.push_back(dot * shape.scale());
        m = std::max(m, s.back());
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - m));
      for (int c = 0; c < d; ++c) {
        double ref = 0;
        for (std::size_t j = 0; j < s.size(); ++j)
          ref += s[j] * at(hv, begin + static_cast<std::int64_t>(j), kv_head, Hk, c);
        ref /= sum;
        max_ref = std::max(max_ref, std::abs(ref));
        max_diff = std::max(max_diff, std::abs(ref - at(ho, t, h, H, c)));
      }
      const double lse_ref = m + std::log(sum);
      spot.lse_err = std::max(spot.lse_err, std::abs(lse_ref - hl[static_cast<std::size_t>(h * n + t)]));
      ++spot.rows;
    }
  }
  spot.o_err = max_ref > 0 ? max_diff / max_ref : max_diff;
  if (!std::isfinite(spot.o_err)) spot.o_err = INFINITY;
  return spot;
}

// ---- one mix, one head dim ----------------------------------------------------------------------
struct Options {
  bool smoke = false;
  std::string json, mixes_out;
  int head_dim = 0;  // 0: 64 and 128
  int reps = 0;      // 0: the plan's default
  bool compare = false;
};

constexpr int kHeads = 16;
constexpr double kCheckTolerance = 2e-2;  // O: bf16 output rounding is ~4e-3; a broken kernel is O(1)
constexpr double kLseTolerance = 1e-2;    // LSE: fp32, natural log of the scaled scores (as CpuFlash)

// One kernel on one mix: forward and backward timed through the kernel's prepared Params (what the
// executor calls: prepare once per program, then the calls), with an fp64 spot check of O and LSE.
template <class Kernel>
void run_case(Kernel& flash, const char* kernel_name, const Mix& mix, int d, int heads, const TimingPlan& plan,
              std::vector<JsonRecord>& records) {
  using T = typename Kernel::value_type;
  const gpu::CudaExec& exec = flash.exec();
  const cudaStream_t s = exec.stream();
  const DocumentBatch batch(mix.sequences);
  const std::int64_t n = batch.total_tokens();
  const std::vector<AttnSlice> slices = batch.document_causal_slices();
  const std::int64_t area = total_area(slices);
  const AttentionShape shape{heads, heads, d, 0.0};
  const std::size_t elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(heads) * static_cast<std::size_t>(d);

  const gpu::DeviceSlices dslices(slices, n, n);
  const auto fparams = flash.prepare(exec, shape, dslices.host(), n, n, attention::Pass::kForward);
  const auto bparams = flash.prepare(exec, shape, dslices.host(), n, n, attention::Pass::kBackward);
  gpu::DeviceArray<T> q(elems), k(elems), v(elems), o(elems), dout(elems), dq(elems), dk(elems), dv(elems);
  gpu::DeviceArray<float> lse(static_cast<std::size_t>(heads) * static_cast<std::size_t>(n));
  gpu::DeviceBytes workspace(flash.workspace_bytes(shape, n, n));
  const gpu::DeviceArray<unsigned long long> counter(1);
  std::uint64_t seed = 1;
  for (const auto* a : {&q, &k, &v, &dout}) fill_normal(s, *a, seed++);

  const auto view = [&](const gpu::DeviceArray<T>& a) { return ThdView<T>::dense(a.data(), n, heads, d); };
  const auto cview = [&](const gpu::DeviceArray<T>& a) { return ThdView<const T>::dense(a.data(), n, heads, d); };
  const LseView<float> lse_view = LseView<float>::dense(lse.data(), heads, n);
  const auto forward = [&] {
    flash.forward(exec, fparams, shape, cview(q), cview(k), cview(v), dslices.device(), view(o), lse_view,
                  workspace.span());
  };
  const auto backward = [&] {
    flash.backward(exec, bparams, shape, cview(q), cview(k), cview(v), cview(o), LseView<const float>(lse_view),
                   cview(dout), dslices.device(), view(dq), view(dk), view(dv), workspace.span());
  };
  const auto zero_grads = [&] {
    for (const auto* a : {&dq, &dk, &dv})
      SEQPAR_CUDA_CHECK(cudaMemsetAsync(a->data(), 0, a->size() * sizeof(T), s), kWhere);
  };

  const double fwd_flops = 4.0 * d * heads * static_cast<double>(area);
  std::size_t docs = 0;
  for (const auto& seq : mix.sequences) docs += seq.size();
  const auto record = [&](const char* pass) {
    JsonRecord r;
    r.add("kind", "attention").add("kernel", kernel_name).add("dtype", "bf16").add("pass", pass);
    r.add("mix", mix.name).add("sequences", mix.sequences.size()).add("documents", docs).add("tokens", n);
    r.add("head_dim", d).add("heads_q", heads).add("heads_kv", heads).add("mask", "document-causal");
    r.add("visible_pairs", area);
    return r;
  };

  Spot spot;
  try {
    const Timing tf = time_calls(
        s, plan, [] {}, forward);
    spot = spot_check(batch, shape, q, k, v, o, lse);
    const unsigned long long bad = count_nonfinite(s, o, counter) + count_nonfinite(s, lse, counter);
    const bool ok = spot.o_err <= kCheckTolerance && spot.lse_err <= kLseTolerance && bad == 0;
    JsonRecord r = record("fwd");
    r.add("flops", fwd_flops).add("ms", tf.ms).add("min_ms", tf.min_ms).add("tflops", fwd_flops / tf.ms * 1e-9);
    r.add("inner", tf.inner).add("samples", tf.samples).add("nonfinite", bad);
    r.add("check_rows", spot.rows).add("check_o_rel_err", spot.o_err).add("check_lse_abs_err", spot.lse_err);
    r.add("check_ok", ok);
    records.push_back(r);
    std::printf("%-9s %-4s %-10s %5zu %4d %7lld %9.3f %9.1f %9llu %9.1e %s\n", kernel_name, "fwd", mix.name.c_str(),
                docs, d, static_cast<long long>(n), tf.ms, fwd_flops / tf.ms * 1e-9, bad, spot.o_err,
                ok ? "ok" : "WRONG");
  } catch (const std::exception& e) {
    records.push_back(record("fwd").add("error", e.what()));
    std::printf("%-9s %-4s %-10s %5zu %4d %7lld  error: %s\n", kernel_name, "fwd", mix.name.c_str(), docs, d,
                static_cast<long long>(n), e.what());
  }
  std::fflush(stdout);

  try {
    const Timing tb = time_calls(s, plan, zero_grads, backward);
    unsigned long long bad = 0;
    for (const auto* a : {&dq, &dk, &dv}) bad += count_nonfinite(s, *a, counter);
    const double flops = 2.5 * fwd_flops;
    JsonRecord r = record("bwd");
    r.add("flops", flops).add("ms", tb.ms).add("min_ms", tb.min_ms).add("tflops", flops / tb.ms * 1e-9);
    r.add("inner", tb.inner).add("samples", tb.samples).add("nonfinite", bad).add("check_ok", bad == 0);
    records.push_back(r);
    std::printf("%-9s %-4s %-10s %5zu %4d %7lld %9.3f %9.1f %9llu %9s %s\n", kernel_name, "bwd", mix.name.c_str(), docs,
                d, static_cast<long long>(n), tb.ms, flops / tb.ms * 1e-9, bad, "", bad == 0 ? "ok" : "WRONG");
  } catch (const std::exception& e) {
    records.push_back(record("bwd").add("error", e.what()));
    std::printf("%-9s %-4s %-10s %5zu %4d %7lld  error: %s\n", kernel_name, "bwd", mix.name.c_str(), docs, d,
                static_cast<long long>(n), e.what());
  }
  std::fflush(stdout);
}

/// Device-to-device copy of `bytes`: the memory ceiling, counting bytes read plus bytes written.
JsonRecord copy_bandwidth(cudaStream_t s, std::size_t bytes, const TimingPlan& plan) {
  const gpu::DeviceBytes src(bytes), dst(bytes);
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(src.data(), 0x5a, bytes, s), kWhere);
  TimingPlan p = plan;
  p.max_inner = 1;  // a 1 GiB copy lasts ~0.5 ms: no launch gap to hide
  const Timing t = time_calls(
      s, p, [] {},
      [&] { SEQPAR_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s), kWhere); });
  const double gbps = 2.0 * static_cast<double>(bytes) / t.ms * 1e-6;
  std::printf("device copy: %.3f MiB D2D in %.3f ms = %.0f GB/s (read + write)\n\n",
              static_cast<double>(bytes) / 1048576.0, t.ms, gbps);
  JsonRecord r;
  r.add("kind", "copy").add("bytes", bytes).add("ms", t.ms).add("min_ms", t.min_ms).add("gbps_read_plus_write", gbps);
  r.add("samples", t.samples);
  return r;
}

// ---- CudnnSdpa against CudaFlash on identical inputs (--compare) -------------------------------------
#if SEQPAR_ENABLE_CUDNN
struct Outputs {
  std::vector<float> o, lse, dq, dk, dv;
  double fwd_ms = 0, bwd_ms = 0;
  std::string error;
};

template <class T>
std::vector<float> host_floats(const gpu::DeviceArray<T>& a) {
  SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), kWhere);
  std::vector<float> out;
  out.reserve(a.size());
  for (const T& x : a.to_host()) out.push_back(to_float(x));
  return out;
}

/// One kernel's forward and backward (prepared Params, as the executor calls it) on inputs made from the
/// fixed seeds, timed over a few samples; its outputs on the host.
template <class Kernel>
Outputs run_outputs(Kernel& kernel, const AttentionShape& shape, const std::vector<AttnSlice>& slices, std::int64_t n,
                    const TimingPlan& plan) {
  using T = typename Kernel::value_type;
  const gpu::CudaExec& exec = kernel.exec();
  const cudaStream_t s = exec.stream();
  const int hq = shape.heads_q, hk = shape.heads_kv, d = shape.qk_dim(), d_v = shape.v_dim();
  const auto elems = [&](int heads, int width) {
    return static_cast<std::size_t>(n) * static_cast<std::size_t>(heads) * static_cast<std::size_t>(width);
  };
  gpu::DeviceArray<T> q(elems(hq, d)), k(elems(hk, d)), v(elems(hk, d_v)), dout(elems(hq, d_v)), o(elems(hq, d_v)),
      dq(elems(hq, d)), dk(elems(hk, d)), dv(elems(hk, d_v));
  gpu::DeviceArray<float> lse(static_cast<std::size_t>(hq) * static_cast<std::size_t>(n));
  std::uint64_t seed = 101;  // the same inputs for every kernel
  for (const auto* a : {&q, &k, &v, &dout}) fill_normal(s, *a, seed++);
  const gpu::DeviceSlices dslices(slices, n, n);
  gpu::DeviceBytes workspace(kernel.workspace_bytes(shape, n, n));
  const auto view = [&](const gpu::DeviceArray<T>& a, int heads, int width) {
    return ThdView<T>::dense(a.data(), n, heads, width);
  };
  const LseView<float> l = LseView<float>::dense(lse.data(), hq, n);
  Outputs out;
  try {
    const auto fparams = kernel.prepare(exec, shape, dslices.host(), n, n, attention::Pass::kForward);
    const auto bparams = kernel.prepare(exec, shape, dslices.host(), n, n, attention::Pass::kBackward);
    const auto forward = [&] {
      kernel.forward(exec, fparams, shape, view(q, hq, d), view(k, hk, d), view(v, hk, d_v), dslices.device(),
                     view(o, hq, d_v), l, workspace.span());
    };
    const auto backward = [&] {
      kernel.backward(exec, bparams, shape, view(q, hq, d), view(k, hk, d), view(v, hk, d_v), view(o, hq, d_v),
                      LseView<const float>(l), view(dout, hq, d_v), dslices.device(), view(dq, hq, d), view(dk, hk, d),
                      view(dv, hk, d_v), workspace.span());
    };
    const auto zero = [&] {
      for (const auto* a : {&dq, &dk, &dv})
        SEQPAR_CUDA_CHECK(cudaMemsetAsync(a->data(), 0, a->size() * sizeof(T), s), kWhere);
    };
    out.fwd_ms = time_calls(
                     s, plan, [] {}, forward)
                     .ms;
    out.bwd_ms = time_calls(s, plan, zero, backward).ms;
    zero();  // the outputs compared: one backward
    backward();
    out.o = host_floats(o);
    out.lse = host_floats(lse);
    out.dq = host_floats(dq);
    out.dk = host_floats(dk);
    out.dv = host_floats(dv);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

/// max |a - b| / max |b| (b the oracle), infinite where either holds a non-finite value that the other
/// does not (LSE's -inf rows of no slice match).
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      if (a[i] == b[i]) continue;
      return INFINITY;
    }
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  return a.size() != b.size() ? INFINITY : (ref > 0 ? diff / ref : diff);
}

constexpr double kCompareTolerance = 2.5e-2;  // TransformerEngine's bf16 tolerance; both kernels round to bf16

/// CudnnSdpa against CudaFlash (the oracle that ran on an H200 against fp64) on the bench sizes: the
/// lognormal mix, GQA 4:1, a sliding window of 4096 on 1 x 16K, and MLA's 192/128 (review of 2026-12-06,
/// "does not yet cover" 4): O, LSE, dQ, dK, dV, and each kernel's time.
void compare_kernels(attention::CudaFlash<__nv_bfloat16>& flash, attention::CudnnSdpa<__nv_bfloat16>& sdpa,
                     const std::vector<Mix>& mixes, bool smoke, const TimingPlan& plan,
                     std::vector<JsonRecord>& records) {
  struct Case {
    const char* mix;
    int heads_q, heads_kv, d, d_v;
    std::int64_t window;  // 0: document-causal
  };
  const int h = smoke ? 4 : 16;
  const std::vector<Case> cases{{"lognormal", h, h, 128, 128, 0},
                                {"lognormal", h, h / 4, 128, 128, 0},
                                {"lognormal", h, h, 64, 64, 0},
                                {smoke ? "1x256" : "1x16384", h, h / 4, 128, 128, smoke ? 64 : 4096},
                                {"lognormal", h, h / 4, 192, 128, 0}};
  std::printf("\n%-10s %-9s %-7s %-6s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "mix", "heads", "d", "window", "o", "lse",
              "dq", "dk", "dv", "flash fwd", "cudnn fwd", "flash bwd", "cudnn bwd");
  const auto one = [&](const Case& c) {
    const auto it = std::find_if(mixes.begin(), mixes.end(), [&](const Mix& m) { return m.name == c.mix; });
    if (it == mixes.end()) return;
    const DocumentBatch batch(it->sequences);
    const std::int64_t n = batch.total_tokens();
    std::vector<AttnSlice> slices = batch.document_causal_slices();
    if (c.window > 0)
      for (AttnSlice& sl : slices) sl.mask = Mask::sliding_window(c.window, sl.mask.causal_offset);
    AttentionShape shape{c.heads_q, c.heads_kv, c.d, 0.0};
    shape.head_dim_v = c.d_v;
    JsonRecord r;
    r.add("kind", "compare").add("oracle", "CudaFlash").add("kernel", "CudnnSdpa").add("dtype", "bf16");
    r.add("mix", c.mix).add("tokens", n).add("heads_q", c.heads_q).add("heads_kv", c.heads_kv).add("head_dim", c.d);
    r.add("head_dim_v", c.d_v).add("window", c.window);
    const std::string label = std::to_string(c.heads_q) + ":" + std::to_string(c.heads_kv);
    const std::string dims = std::to_string(c.d) + "/" + std::to_string(c.d_v);
    for (const auto& [who, status] :
         {std::pair{"CudaFlash", flash.can_implement(shape)}, std::pair{"CudnnSdpa", sdpa.can_implement(shape)}})
      if (!status) {
        records.push_back(r.add("refused", std::string(who) + ": " + status.reason));
        std::printf("%-10s %-9s %-7s %-6lld  %s refuses: %s\n", c.mix, label.c_str(), dims.c_str(),
                    static_cast<long long>(c.window), who, status.reason.c_str());
        return;
      }
    {
      const Outputs a = run_outputs(flash, shape, slices, n, plan);
      const Outputs b = run_outputs(sdpa, shape, slices, n, plan);
      if (!a.error.empty() || !b.error.empty()) {
        records.push_back(r.add("error", a.error.empty() ? "CudnnSdpa: " + b.error : "CudaFlash: " + a.error));
        std::printf("%-10s %-9s %-7s %-6lld  error: %s\n", c.mix, label.c_str(), dims.c_str(),
                    static_cast<long long>(c.window), (a.error.empty() ? b.error : a.error).c_str());
        return;
      }
      const double eo = relative_error(b.o, a.o), el = relative_error(b.lse, a.lse), eq = relative_error(b.dq, a.dq),
                   ek = relative_error(b.dk, a.dk), ev = relative_error(b.dv, a.dv);
      const bool ok = std::max({eo, el, eq, ek, ev}) <= kCompareTolerance;
      r.add("o_rel_err", eo).add("lse_rel_err", el).add("dq_rel_err", eq).add("dk_rel_err", ek).add("dv_rel_err", ev);
      r.add("flash_fwd_ms", a.fwd_ms).add("cudnn_fwd_ms", b.fwd_ms).add("flash_bwd_ms", a.bwd_ms);
      r.add("cudnn_bwd_ms", b.bwd_ms).add("tolerance", kCompareTolerance).add("check_ok", ok);
      records.push_back(r);
      std::printf("%-10s %-9s %-7s %-6lld %9.1e %9.1e %9.1e %9.1e %9.1e %9.3f %9.3f %9.3f %9.3f %s\n", c.mix,
                  label.c_str(), dims.c_str(), static_cast<long long>(c.window), eo, el, eq, ek, ev, a.fwd_ms, b.fwd_ms,
                  a.bwd_ms, b.bwd_ms, ok ? "ok" : "DIFFER");
    }
  };
  for (const Case& c : cases) {
    one(c);
    std::fflush(stdout);
  }
}
#endif

int run(const Options& opt, const std::vector<Mix>& mixes) {
  attention::CudaFlash<__nv_bfloat16> flash;
  const cudaStream_t s = flash.exec().stream();
  cudaDeviceProp prop{};
  SEQPAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, flash.exec().device()), kWhere);
  int driver = 0, runtime = 0;
  SEQPAR_CUDA_CHECK(cudaDriverGetVersion(&driver), kWhere);
  SEQPAR_CUDA_CHECK(cudaRuntimeGetVersion(&runtime), kWhere);
  std::printf("device %d: %s, sm_%d%d, %d SMs, %.0f MiB L2, %.1f GiB; driver %d, runtime %d\n", flash.exec().device(),
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0,
              static_cast<double>(prop.totalGlobalMem) / (1u << 30), driver, runtime);

  std::vector<JsonRecord> records;
  JsonRecord dev;
  dev.add("kind", "device").add("name", prop.name).add("sm", prop.major * 10 + prop.minor);
  dev.add("multiprocessors", prop.multiProcessorCount).add("l2_bytes", prop.l2CacheSize);
  dev.add("memory_bytes", prop.totalGlobalMem).add("driver", driver).add("runtime", runtime).add("smoke", opt.smoke);
  records.push_back(dev);

  TimingPlan plan;
  if (opt.smoke) plan = {0, 1, 0.0, 1};
  if (opt.reps > 0) plan.samples = opt.reps;
  records.push_back(copy_bandwidth(s, opt.smoke ? (std::size_t{16} << 20) : (std::size_t{1} << 30), plan));

  std::printf("%-9s %-4s %-10s %5s %4s %7s %9s %9s %9s %9s\n", "kernel", "pass", "mix", "docs", "d", "tokens", "ms",
              "TFLOP/s", "nonfinite", "o err");
#if SEQPAR_ENABLE_CUDNN
  attention::CudnnSdpa<__nv_bfloat16> sdpa(flash.exec());
#endif
  const int heads = opt.smoke ? 2 : kHeads;
  if (opt.compare) {
#if SEQPAR_ENABLE_CUDNN
    TimingPlan few = plan;
    few.samples = std::min(plan.samples, 3);
    few.warmup = std::min(plan.warmup, 1);
    compare_kernels(flash, sdpa, mixes, opt.smoke, few, records);
#else
    std::printf("--compare: built without seqpar::cudnn, no CudnnSdpa to compare\n");
    return 77;
#endif
  }
  for (int d : {64, 128}) {
    if (opt.compare) break;  // --compare: the kernels against each other only
    if (opt.head_dim != 0 && d != opt.head_dim) continue;
    for (const Mix& mix : mixes) {
      run_case(flash, "CudaFlash", mix, d, heads, plan, records);
#if SEQPAR_ENABLE_CUDNN
      run_case(sdpa, "CudnnSdpa", mix, d, heads, plan, records);
#endif
    }
  }

  bool all_ok = true;
  for (const JsonRecord& r : records) {
    const std::string str = r.str();
    if (str.find("\"check_ok\": false") != std::string::npos || str.find("\"error\":") != std::string::npos)
      all_ok = false;
  }
  if (!opt.json.empty() && !bench::write_json(opt.json, records)) return 1;
  if (!all_ok) std::printf("\nsome cases failed their check or raised an error (see above)\n");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) {
  using namespace seqpar::bench;
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      opt.smoke = true;
    else if (a == "--json" && i + 1 < argc)
      opt.json = argv[++i];
    else if (a == "--mixes-out" && i + 1 < argc)
      opt.mixes_out = argv[++i];
    else if (a == "--head-dim" && i + 1 < argc)
      opt.head_dim = std::atoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      opt.reps = std::atoi(argv[++i]);
    else if (a == "--compare")
      opt.compare = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--smoke] [--compare] [--json FILE] [--mixes-out FILE] [--head-dim 64|128] [--reps N]\n",
                   argv[0]);
      return 2;
    }
  }
  // Smoke: tiny, and still every kind of mix (a lognormal mix of short documents included).
  const std::int64_t tokens = opt.smoke ? 256 : 16384;
  const LognormalSpec ln{opt.smoke ? 16.0 : 256.0, 1.0, 20240607};
  const std::vector<Mix> mixes = make_mixes(tokens, ln);
  std::printf("attention_cuda: %lld tokens; lognormal mix: %zu documents (median %.0f, sigma %.1f, seed %llu)\n",
              static_cast<long long>(tokens), mixes.back().sequences[0].size(), ln.median, ln.sigma,
              static_cast<unsigned long long>(ln.seed));
  if (!opt.mixes_out.empty() && !write_mixes(opt.mixes_out, tokens, ln, mixes)) return 1;

  if (seqpar::gpu::device_count() == 0) {
    std::printf("attention_cuda: no CUDA device (or driver) on this machine: skipped\n");
    return 77;
  }
  try {
    return run(opt, mixes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_cuda: %s\n", e.what());
    return 1;
  }
}
