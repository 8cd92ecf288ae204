// SPDX-License-Identifier: Apache-2.0
// attention::CudnnSdpa (cuDNN's fused attention behind the kernel protocol) on the shared kernel
// conformance cases (tests/support/kernel_cases.hpp) against the fp64 reference, bf16 and fp16, in
// device memory; non-finite isolation between documents; refusals. The cases whose slice tables
// CudnnSdpa refuses by design (a sliding window cut by its slice's last key: sdpa_items.hpp) are
// skipped by name, and that refusal is checked on its own. Runs only with a CUDA device and cuDNN
// (the main exits 77 without a device). Tolerance: TransformerEngine's 2.5e-2 for 16-bit types.
// Written on a machine without a GPU (2026-12-04): compiled there, to be run by bench/device/run.sh.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

#include "cuda/device_harness.hpp"
#include "seqpar/gpu/cudnn_sdpa.hpp"
#include "seqpar/gpu/detail/sdpa_items.hpp"
#include "support/kernel_cases.hpp"

namespace seqpar::test {
namespace {

namespace kc = kernel_cases;

constexpr kc::Tolerance kTolerance{2.5e-2, 2.5e-2};

template <class T, int kHeadDim, double kScale = 0.0>
struct SdpaHarness : DeviceHarness<attention::CudnnSdpa<T>, kHeadDim, kScale> {
  static bool supports(const kc::Case& c) {
    try {
      (void)gpu::detail::sdpa_items(c.slices, "CudnnSdpa");
      return true;
    } catch (const std::invalid_argument&) {
      return false;
    }
  }
};

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
  }
}

}  // namespace seqpar::test
