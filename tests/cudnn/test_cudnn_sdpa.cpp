// SPDX-License-Identifier: Apache-2.0
// attention::CudnnSdpa (cuDNN's fused attention behind the kernel protocol) on the shared kernel
// conformance cases (tests/support/kernel_cases.hpp) against the fp64 reference, bf16 and fp16, in
// device memory; non-finite isolation between documents; refusals. The cases whose slice tables
// CudnnSdpa refuses by design (a sliding window cut by its slice's last key: sdpa_items.hpp) are
// skipped by name, and that refusal is checked on its own. Runs only with a CUDA device and cuDNN
// (the main exits 77 without a device). Tolerance: TransformerEngine's 2.5e-2 for 16-bit types.
// Written on a machine without a GPU (2026-12-04): compiled there, to be run by bench/device/run.sh.
// MLA's head sizes 192/128 (q/k, v; issue 29 item 3, 2026-12-05): the conformance cases (causal
// documents, GQA, windows, forward and backward) in bf16 on devices of compute capability 9.0 and newer;
// on older ones the test checks the refusal by name and says it skipped them. Compiled for sm_80 and
// sm_90a on a machine without a GPU, never run: the next device run is their first.
// Issue 38 (2026-12-07; compiled only, never run): the kernels run with cuDNN's deterministic backward
// where it exists (A2); non-finite isolation at CudnnSdpa's contract, documents sharing a tile (A1); a
// NaN-poisoned tail past the views (A4); bitwise determinism; layouts (A3's offsets, one-row documents,
// waves, head slices, a window that is causal); the graph cache over ten document mixes (C1).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/device_harness.hpp"
#include "seqpar/gpu/cudnn_sdpa.hpp"
#include "seqpar/gpu/detail/sdpa_items.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/slices.hpp"
#include "support/kernel_cases.hpp"

namespace seqpar::test {
namespace {

namespace kc = kernel_cases;

constexpr kc::Tolerance kTolerance{2.5e-2, 2.5e-2};

template <class T, int kHeadDim, double kScale = 0.0, int kHeadDimV = 0>
struct SdpaHarness : DeviceHarness<attention::CudnnSdpa<T>, kHeadDim, kScale, kHeadDimV> {
  static bool supports(const kc::Case& c) {
    try {
      (void)gpu::detail::sdpa_items(c.slices, "CudnnSdpa");
      return true;
    } catch (const std::invalid_argument&) {
      return false;
    }
  }
};

/// At MLA's head sizes: q, k, dq, dk of 192 values per head, v, o, dout, dv of 128.
using MlaHarness = SdpaHarness<__nv_bfloat16, 192, 0.0, 128>;

/// Whether the device runs 192/128 through cuDNN (compute capability 9.0 and newer); when not, checks that
/// the shape and a call are refused naming shape.head_dim_v, and says that the cases were skipped.
bool runs_mla(const attention::CudnnSdpa<__nv_bfloat16>& sdpa) {
  const AttentionShape mla{4, 2, 192, 0.0, 128};
  const int cc = sdpa.exec().compute_capability();
  if (cc >= 90) {
    CHECK(sdpa.can_implement(mla));
    return true;
  }
  const Status s = sdpa.can_implement(mla);
  CHECK_FALSE(s);
  CHECK(s.reason.find("shape.head_dim_v") != std::string::npos);
  CHECK(s.reason.find("compute capability 9.0") != std::string::npos);
  CHECK_THROWS_WITH_AS((void)sdpa.prepare(sdpa.exec(), mla, {}, 10, 10, attention::Pass::kForward),
                       doctest::Contains("shape.head_dim_v = 128"), std::invalid_argument);
  MESSAGE("compute capability " << cc / 10 << "." << cc % 10
                                << ": CudnnSdpa refuses 192/128 here (cuDNN runs it from 9.0 on); cases skipped");
  return false;
}

/// A CudnnSdpa with cuDNN's deterministic backward where cuDNN has one for ragged batches (Hopper;
/// Blackwell from 9.18; not sm_8x / sm_12x: cudnn_sdpa_version_status), as the tests run it (A2).
template <class T>
attention::CudnnSdpa<T> make_sdpa(attention::CudnnSdpaArguments args = {}) {
  gpu::CudaExec exec;
  attention::CudnnSdpaFeatures det;
  det.deterministic = true;
  args.deterministic = bool(attention::cudnn_sdpa_version_status(
      attention::CudnnSdpa<T>::versions(), exec.compute_capability(), AttentionShape{4, 2, 64}, det, "test"));
  return attention::CudnnSdpa<T>(exec, args);
}

/// Runs the conformance cases (and the first long ones) and returns how many were checked.
template <class H>
std::size_t run_all(bool long_cases) {
  auto sdpa = make_sdpa<typename H::value_type>();
  std::size_t checked = kc::run_cases<H>(sdpa, kTolerance);
  if (long_cases) checked += kc::run_long_cases<H>(sdpa, kTolerance);
  return checked;
}

/// The cases the harness supports (it skips only slices CudnnSdpa refuses by design): all must be checked.
template <class H>
std::size_t supported_cases(bool long_cases) {
  std::size_t n = 0;
  for (const kc::Case& c : kc::cases()) n += H::supports(c) ? 1 : 0;
  const std::vector<kc::Case> longs = kc::long_cases();
  for (std::size_t i = 0; long_cases && i < std::min<std::size_t>(4, longs.size()); ++i)
    n += H::supports(longs[i]) ? 1 : 0;
  return n;
}

/// Lognormal document lengths (median `median`, sigma 1) filling `tokens`.
std::vector<std::int64_t> lognormal_mix(std::int64_t tokens, double median, std::mt19937& rng) {
  std::lognormal_distribution<double> length(std::log(median), 1.0);
  std::vector<std::int64_t> docs;
  for (std::int64_t left = tokens; left > 0;) {
    const std::int64_t len = std::clamp<std::int64_t>(static_cast<std::int64_t>(length(rng)), 1, left);
    docs.push_back(len);
    left -= len;
  }
  return docs;
}

/// Outputs of one forward and backward on raw device buffers, as floats.
struct RawOutputs {
  std::vector<float> o, lse, dq, dk, dv;
};

template <class T>
std::vector<float> to_floats(const gpu::DeviceArray<T>& a) {
  std::vector<float> out;
  for (const T& x : a.to_host()) out.push_back(gpu::detail::to_float(x));
  return out;
}

/// Forward and backward of `slices` over n-token dense views whose buffers hold `tail` rows more, set to
/// `tail_value` (A4: cuDNN's tiles may read past the views' last row); inputs normal(0, 1) from `seed`.
template <class T>
RawOutputs run_raw(attention::CudnnSdpa<T>& sdpa, const AttentionShape& shape, std::int64_t n,
                   const std::vector<AttnSlice>& slices, std::int64_t tail, float tail_value, std::uint32_t seed) {
  const int hq = shape.heads_q, hk = shape.heads_kv, d = shape.qk_dim(), d_v = shape.v_dim();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const auto input = [&](int heads, int width) {
    std::vector<T> host(static_cast<std::size_t>((n + tail) * heads * width));
    for (std::size_t i = 0; i < host.size(); ++i)
      host[i] = gpu::detail::from_float<T>(i < static_cast<std::size_t>(n * heads * width) ? normal(rng) : tail_value);
    return gpu::DeviceArray<T>(host);
  };
  const auto zeros = [&](int heads, int width) {
    return gpu::DeviceArray<T>(
        std::vector<T>(static_cast<std::size_t>(n * heads * width), gpu::detail::from_float<T>(0.0f)));
  };
  const auto q = input(hq, d), k = input(hk, d), v = input(hk, d_v), dout = input(hq, d_v);
  const auto o = zeros(hq, d_v), dq = zeros(hq, d), dk = zeros(hk, d), dv = zeros(hk, d_v);
  gpu::DeviceArray<float> lse(static_cast<std::size_t>(n * hq));
  const auto view = [&](const gpu::DeviceArray<T>& a, int heads, int width) {
    return ThdView<T>{a.data(), n, heads, width, std::int64_t{heads} * width, width};
  };
  const gpu::DeviceSlices dev_slices(slices, n, n);
  gpu::DeviceBytes ws(sdpa.workspace_bytes(shape, n, n));
  const LseView<float> l = LseView<float>::dense(lse.data(), hq, n);
  sdpa.forward(shape, view(q, hq, d), view(k, hk, d), view(v, hk, d_v), dev_slices.device(), view(o, hq, d_v), l,
               ws.span());
  sdpa.backward(shape, view(q, hq, d), view(k, hk, d), view(v, hk, d_v), view(o, hq, d_v), LseView<const float>(l),
                view(dout, hq, d_v), dev_slices.device(), view(dq, hq, d), view(dk, hk, d), view(dv, hk, d_v),
                ws.span());
  return {to_floats(o), lse.to_host(), to_floats(dq), to_floats(dk), to_floats(dv)};
}

/// Every value finite (LSE: rows of no item are -inf, none here) and bit-identical to `want`'s.
void check_same_bits(const RawOutputs& got, const RawOutputs& want) {
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b, const char* name) {
    REQUIRE(a.size() == b.size());
    std::size_t bad = 0, first = a.size();
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!std::isfinite(a[i]) || std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
        ++bad;
        first = std::min(first, i);
      }
    INFO(name << ": " << bad << " values differ or are not finite, the first at " << first);
    CHECK(bad == 0);
  };
  same(got.o, want.o, "o");
  same(got.lse, want.lse, "lse");
  same(got.dq, want.dq, "dq");
  same(got.dk, want.dk, "dk");
  same(got.dv, want.dv, "dv");
}

}  // namespace

TEST_SUITE("cudnn") {
  TEST_CASE("CudnnSdpa: buffers with NaN past the views leave every output finite and unchanged (A4)") {
    // Documents of lengths not multiples of a tile, the last one a single row; the buffers hold 256 rows
    // more, NaN, then 0: a tile read past the views' last row shows as NaN or changed bits.
    auto sdpa = make_sdpa<__nv_bfloat16>();
    if (!sdpa.arguments().deterministic) MESSAGE("no deterministic cuDNN backward here: bits compared anyway");
    const AttentionShape shape{4, 2, 128};
    const auto slices = kc::documents({300, 77, 150, 1}, Mask::causal());
    const RawOutputs zero_tail = run_raw(sdpa, shape, 528, slices, 256, 0.0f, 5);
    const RawOutputs nan_tail = run_raw(sdpa, shape, 528, slices, 256, std::numeric_limits<float>::quiet_NaN(), 5);
    check_same_bits(nan_tail, zero_tail);
  }
  TEST_CASE("CudnnSdpa: the deterministic backward repeats bit for bit, documents over several key tiles (A2)") {
    auto sdpa = make_sdpa<__nv_bfloat16>();
    if (!sdpa.arguments().deterministic) {
      MESSAGE("compute capability " << sdpa.exec().compute_capability()
                                    << ": cuDNN has no deterministic backward for ragged batches here; skipped");
      CHECK_FALSE(attention::CudnnSdpa<__nv_bfloat16>(sdpa.exec(), {.deterministic = true}).can_implement({4, 2, 64}));
      return;
    }
    const AttentionShape shape{8, 2, 128};
    const auto slices = kc::documents({1000, 300, 1, 700}, Mask::causal());
    const RawOutputs a = run_raw(sdpa, shape, 2001, slices, 0, 0.0f, 9);
    const RawOutputs b = run_raw(sdpa, shape, 2001, slices, 0, 0.0f, 9);
    check_same_bits(b, a);
  }
  TEST_CASE("CudnnSdpa layouts: a short slice at the end of a long buffer, one-row documents, waves, head slices") {
    using H = SdpaHarness<__nv_bfloat16, 64>;
    auto sdpa = make_sdpa<__nv_bfloat16>();
    const AttentionShape shape{4, 2, 64};
    std::vector<kc::Case> layout{
        // A3: ragged offsets far beyond b x S_max (one 10-row item at row 4086).
        {"short slice at the end of a long buffer", shape, 4096, 4096, {{{4086, 4096}, {4086, 4096}, Mask::causal()}}},
        {"one-row documents among long ones", shape, 881, 881,
         kc::documents({300, 1, 1, 500, 1, 77, 1}, Mask::causal())},
        // Query-disjoint slices sharing keys: the backward splits them into key-disjoint waves.
        {"slices sharing keys (backward waves)",
         shape,
         300,
         200,
         {{{0, 100}, {0, 200}, Mask::full()},
          {{100, 200}, {0, 200}, Mask::causal(100)},
          {{200, 300}, {50, 150}, Mask::full()}}},
        {"windows, one larger than every item (the causal mask)",
         shape,
         600,
         600,
         {{{0, 300}, {0, 300}, Mask::sliding_window(64)}, {{300, 600}, {300, 600}, Mask::sliding_window(1 << 30)}}},
    };
    // Ulysses's head slices: views 3 heads wider than the shape (graphs built at the call, once).
    kc::Case strided = layout[1];
    strided.name = "one-row documents, head-slice views";
    strided.strided = true;
    layout.push_back(strided);
    for (const kc::Case& c : layout) {
      CAPTURE(c.name);
      CHECK(kc::check_case<H>(c, sdpa, kTolerance));
    }
  }
  TEST_CASE("CudnnSdpa graph cache: graphs built in prepare, once per bucketed key, over changing document mixes") {
    // Ten steps of lognormal document mixes over 4096 tokens (C1): prepare builds every graph a call needs,
    // the call builds none, and no key is built twice (bucketed items, S_q and S_kv).
    auto sdpa = make_sdpa<__nv_bfloat16>();
    const AttentionShape shape{8, 2, 128};
    constexpr std::int64_t n = 4096;
    const auto buffer = [&](int heads) {
      gpu::DeviceArray<__nv_bfloat16> a(static_cast<std::size_t>(n * heads * 128));
      SEQPAR_CUDA_CHECK(cudaMemset(a.data(), 0, a.span().size_bytes()), "test");
      return a;
    };
    const auto q = buffer(8), k = buffer(2), v = buffer(2), o = buffer(8);
    gpu::DeviceArray<float> lse(static_cast<std::size_t>(n * 8));
    const auto view = [&](const gpu::DeviceArray<__nv_bfloat16>& a, int heads) {
      return ThdView<__nv_bfloat16>{a.data(), n, heads, 128, std::int64_t{heads} * 128, 128};
    };
    gpu::DeviceBytes ws(sdpa.workspace_bytes(shape, n, n));
    std::set<std::tuple<int, std::int64_t, std::int64_t, std::int64_t, std::int64_t>> keys;
    std::mt19937 rng(38);
    for (int step = 0; step < 10; ++step) {
      const auto slices = kc::documents(lognormal_mix(n, 300.0, rng), Mask::causal());
      for (const auto& run : gpu::detail::sdpa_runs(gpu::detail::sdpa_items(slices, "test"), n, false))
        keys.insert({static_cast<int>(run.mask), run.window,
                     gpu::detail::sdpa_bucket(static_cast<std::int64_t>(run.items.size())),
                     gpu::detail::sdpa_bucket(run.max_q), gpu::detail::sdpa_bucket(run.max_k)});
      const auto params = sdpa.prepare(sdpa.exec(), shape, slices, n, n, attention::Pass::kForward);
      const auto built = sdpa.cache_stats().graphs_built;
      const gpu::DeviceSlices dev(slices, n, n);
      sdpa.forward(sdpa.exec(), params, shape, view(q, 8), view(k, 2), view(v, 2), dev.device(), view(o, 8),
                   LseView<float>::dense(lse.data(), 8, n), ws.span());
      sdpa.exec().synchronize();
      CHECK(sdpa.cache_stats().graphs_built == built);  // the call builds nothing
    }
    const attention::CudnnSdpaCacheStats stats = sdpa.cache_stats();
    MESSAGE("10 steps of lognormal mixes: " << stats.graphs_built << " graphs built for " << keys.size()
                                            << " bucketed keys, " << stats.build_seconds
                                            << " s building, cuDNN workspace " << stats.cudnn_workspace << " bytes, "
                                            << stats.fallbacks << " fallbacks");
    CHECK(stats.graphs_built == keys.size());
    CHECK(stats.fallbacks == 0);
  }
  TEST_CASE("CudnnSdpa<__nv_bfloat16>: the kernel conformance cases at d128 and d64, at 2.5e-2") {
    using H128 = SdpaHarness<__nv_bfloat16, 128>;
    using H64 = SdpaHarness<__nv_bfloat16, 64>;
    CHECK(supported_cases<H64>(false) * 2 > kc::cases().size());  // most cases run through cuDNN
    CHECK(run_all<H128>(true) == supported_cases<H128>(true));
    CHECK(run_all<H64>(false) == supported_cases<H64>(false));
  }
  TEST_CASE("CudnnSdpa<__half>: the kernel conformance cases at d64, softmax_scale 0.05, at 2.5e-2") {
    using H = SdpaHarness<__half, 64, 0.05>;
    CHECK(run_all<H>(false) == supported_cases<H>(false));
  }
  TEST_CASE("CudnnSdpa<__nv_bfloat16> at MLA's 192/128 (sm_90+): the kernel conformance cases, at 2.5e-2") {
    attention::CudnnSdpa<__nv_bfloat16> sdpa;
    if (!runs_mla(sdpa)) return;
    // Every case adapted to q/k 192, v 128: causal documents (across key tiles, of length 1), GQA and MQA,
    // sliding windows, offsets, rows in no slice, strided head slices; forward and backward vs fp64.
    CHECK(run_all<MlaHarness>(true) == supported_cases<MlaHarness>(true));
    // The shared 192/128 case as written (causal, GQA 4:2), not adapted.
    const kc::Case mla = kc::head_size_cases().front();
    REQUIRE(mla.shape.head_dim == 192);
    REQUIRE(mla.shape.head_dim_v == 128);
    CHECK(kc::check_case<MlaHarness>(mla, sdpa, kTolerance));
  }
  TEST_CASE("CudnnSdpa at MLA's 192/128 (sm_90+): non-finite isolation and refusals of bad input") {
    auto sdpa = make_sdpa<__nv_bfloat16>();
    if (!runs_mla(sdpa)) return;
    kc::check_nonfinite_isolation<MlaHarness>(sdpa, kc::Isolation::kDocumentOrTile, 6, 256);
    kc::check_refusals<MlaHarness>(sdpa);
  }
  TEST_CASE("CudnnSdpa: a graph cuDNN will not build is a std::invalid_argument with cuDNN's reason") {
    // cuDNN's backward takes d <= 128 before compute capability 9.0; CudnnSdpa accepts d256 (the forward
    // runs it), so the backward's refusal comes from cuDNN's own checks when its graph is built.
    attention::CudnnSdpa<__nv_bfloat16> sdpa;
    if (sdpa.exec().compute_capability() >= 90) {
      MESSAGE("compute capability 9.0 or newer: cuDNN builds the d256 backward here, nothing to refuse");
      return;
    }
    using H256 = SdpaHarness<__nv_bfloat16, 256>;
    const kc::Case c{"causal 101 d256", {2, 2, 256}, 101, 101, {{{0, 101}, {0, 101}, Mask::causal()}}};
    CHECK_THROWS_WITH_AS(kc::check_case<H256>(c, sdpa, kTolerance),
                         doctest::Contains("graph (bottom-right causal mask)"), std::invalid_argument);
  }
  TEST_CASE("CudnnSdpa keeps a NaN or infinity inside its document and the documents sharing its tiles (A1)") {
    // CudnnSdpa's contract (a) (cudnn_sdpa.hpp): cuDNN's tiles of up to 256 rows from an item's first row
    // may carry a neighbour's non-finite value into the item; every other document stays bit-identical
    // (the first document against plants at rows 300, 340 and 370; the last two against plants at 100
    // and 130), and the planted document's outputs are non-finite where they must be.
    auto sdpa = make_sdpa<__nv_bfloat16>();
    kc::check_nonfinite_isolation<SdpaHarness<__nv_bfloat16, 128>>(sdpa, kc::Isolation::kDocumentOrTile, 6, 256);
  }
  TEST_CASE("CudnnSdpa refuses bad input, and a sliding window cut by its slice's last key by name") {
    attention::CudnnSdpa<__nv_bfloat16> sdpa;
    kc::check_refusals<SdpaHarness<__nv_bfloat16, 64>>(sdpa);
    const std::vector<AttnSlice> cut{{{0, 10}, {0, 5}, Mask::sliding_window(3)}};
    const AttentionShape shape{2, 1, 64, 0.0};
    CHECK_THROWS_AS((void)sdpa.prepare(sdpa.exec(), shape, cut, 10, 5, attention::Pass::kForward),
                    std::invalid_argument);
    CHECK_FALSE(sdpa.can_implement({2, 1, 60, 0.0}));   // not a multiple of 8
    CHECK_FALSE(sdpa.can_implement({2, 1, 264, 0.0}));  // above 256
    CHECK(sdpa.can_implement({4, 2, 128, 0.0}));
    CHECK(sdpa.can_implement({4, 2, 128, 0.0, 128}));  // head_dim_v = head_dim
    // Unequal head sizes other than 192/128 are refused by name on any device, in can_implement and the call;
    // 192/128 from compute capability 9.0 on (cuDNN's support matrix).
    for (const AttentionShape& split : {AttentionShape{2, 1, 128, 0.0, 64}, AttentionShape{2, 1, 64, 0.0, 128},
                                        AttentionShape{2, 1, 192, 0.0, 64}, AttentionShape{2, 1, 576, 0.0, 512}}) {
      CAPTURE(split.head_dim);
      CAPTURE(split.head_dim_v);
      const Status s = sdpa.can_implement(split);
      CHECK_FALSE(s);
      CHECK(s.reason.find(split.head_dim > 256 ? "shape.head_dim" : "shape.head_dim_v") != std::string::npos);
      CHECK_THROWS_AS((void)sdpa.prepare(sdpa.exec(), split, {}, 10, 10, attention::Pass::kForward),
                      std::invalid_argument);
    }
    CHECK(bool(sdpa.can_implement({4, 2, 192, 0.0, 128})) == (sdpa.exec().compute_capability() >= 90));
    // cuDNN's deterministic backward where it has none (sm_8x, sm_12x) is refused by name (B2).
    const int major = sdpa.exec().compute_capability() / 10;
    const Status det =
        attention::CudnnSdpa<__nv_bfloat16>(sdpa.exec(), {.deterministic = true}).can_implement({4, 2, 64});
    CHECK(bool(det) == !(major == 8 || major == 12));
    if (!det) CHECK(det.reason.find("arguments.deterministic") != std::string::npos);
    const attention::CudnnVersions versions = attention::CudnnSdpa<__nv_bfloat16>::versions();
    MESSAGE("cuDNN " << versions.cudnn << ", cudnn-frontend " << versions.frontend << ", compute capability "
                     << sdpa.exec().compute_capability());
    CHECK(versions.cudnn >= 90000);
  }
}

}  // namespace seqpar::test
