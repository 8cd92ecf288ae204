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
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/device_harness.hpp"
#include "seqpar/gpu/cudnn_sdpa.hpp"
#include "seqpar/gpu/detail/sdpa_items.hpp"
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

/// Runs the conformance cases (and the first long ones) and returns how many were checked.
template <class H>
std::size_t run_all(bool long_cases) {
  typename H::kernel_type sdpa;
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

}  // namespace

TEST_SUITE("cudnn") {
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
    attention::CudnnSdpa<__nv_bfloat16> sdpa;
    if (!runs_mla(sdpa)) return;
    kc::check_nonfinite_isolation<MlaHarness>(sdpa, kc::Isolation::kDocument, 2);
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
  TEST_CASE("CudnnSdpa keeps a NaN or infinity inside the document that holds it") {
    attention::CudnnSdpa<__nv_bfloat16> sdpa;
    kc::check_nonfinite_isolation<SdpaHarness<__nv_bfloat16, 128>>(sdpa, kc::Isolation::kDocument, 2);
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
  }
}

}  // namespace seqpar::test
