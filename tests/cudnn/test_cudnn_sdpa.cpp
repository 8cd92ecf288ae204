// SPDX-License-Identifier: Apache-2.0
// attention::CudnnSdpa (cuDNN's fused attention behind the kernel protocol) on the shared kernel
// conformance cases (tests/support/kernel_cases.hpp) against the fp64 reference, bf16 and fp16, in
// device memory; non-finite isolation between documents; refusals. The cases whose slice tables
// CudnnSdpa refuses by design (a sliding window cut by its slice's last key: sdpa_items.hpp) are
// skipped by name, and that refusal is checked on its own. Runs only with a CUDA device and cuDNN
// (the main exits 77 without a device). Tolerance: TransformerEngine's 2.5e-2 for 16-bit types.
// Written on a machine without a GPU (2026-12-04): compiled there, to be run by bench/device/run.sh.
#include <doctest/doctest.h>

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

template <class H>
void run_all(bool long_cases) {
  typename H::kernel_type sdpa;
  kc::run_cases<H>(sdpa, kTolerance);
  if (long_cases) kc::run_long_cases<H>(sdpa, kTolerance);
}

}  // namespace

TEST_SUITE("cudnn") {
  TEST_CASE("CudnnSdpa<__nv_bfloat16>: the kernel conformance cases at d128 and d64, at 2.5e-2") {
    run_all<SdpaHarness<__nv_bfloat16, 128>>(true);
    run_all<SdpaHarness<__nv_bfloat16, 64>>(false);
  }
  TEST_CASE("CudnnSdpa<__half>: the kernel conformance cases at d64, softmax_scale 0.05, at 2.5e-2") {
    run_all<SdpaHarness<__half, 64, 0.05>>(false);
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
