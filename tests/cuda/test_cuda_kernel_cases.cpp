// SPDX-License-Identifier: Apache-2.0
// CudaFlash on the shared kernel conformance cases (tests/support/kernel_cases.hpp): every mask, GQA/MQA,
// odd lengths, empty rows, rows in no slice, long and packed batches, against the fp64 reference; non-finite
// isolation between documents; refusals of bad input. Tensors, slices and workspaces in device memory
// (the harness below). Head dims: the kernels are built for 64 and 128, so each case runs at one of them
// (fp32 and bf16 at both, fp16 at 64 with softmax_scale 0.05). Tolerances relative to the largest reference
// value: fp32 1e-4, fp16/bf16 TransformerEngine's 2.5e-2. Runs only with a CUDA device (the main exits 77
// otherwise). Host code: CudaFlash comes compiled from seqpar::cuda_instances. Written on a machine without a
// GPU: compiled there, first run on a GPU still to come (the isolation case in particular: CudaFlash's tiles
// load only their slice's rows, so documents should stay apart; within a document it is not asked).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/flash.hpp"
#include "seqpar/gpu/slices.hpp"
#include "support/kernel_cases.hpp"

namespace seqpar::test {
namespace {

namespace kc = kernel_cases;

template <class T>
constexpr kc::Tolerance kTolerance =
    std::is_same_v<T, float> ? kc::Tolerance{1e-4, 1e-4} : kc::Tolerance{2.5e-2, 2.5e-2};

/// CudaFlash<T>'s harness: device memory written and read with synchronous copies; every case runs at
/// head_dim kHeadDim and softmax_scale kScale (0: 1/sqrt(head_dim)).
template <class T, int kHeadDim, double kScale = 0.0>
struct Harness {
  using kernel_type = attention::CudaFlash<T>;
  using value_type = T;
  using accum_type = float;
  /// CudaFlash checks extents, layouts and the workspace size, but not that outputs share no memory with
  /// other views (kernels/seqpar/gpu/flash.cuh, check_inputs): the aliasing refusals are left out.
  static constexpr bool kRefusesAliasing = false;

  template <class U>
  class Thd {
   public:
    Thd(std::int64_t tokens, int heads, int d, int pad)
        : dev_(static_cast<std::size_t>(tokens * (heads + pad) * d)),
          tokens_(tokens),
          heads_(heads),
          d_(d),
          pad_(pad) {}
    [[nodiscard]] ThdView<U> view() const {
      return {dev_.data() + (pad_ == 0 ? 0 : d_), tokens_, heads_, d_, std::int64_t{heads_ + pad_} * d_, d_};
    }
    void write(const ThdTensor<double>& src) {
      std::vector<U> host = dev_.to_host();
      for (std::int64_t t = 0; t < tokens_; ++t)
        for (int h = 0; h < heads_; ++h)
          for (int x = 0; x < d_; ++x)
            host[at(t, h, x)] = gpu::detail::from_float<U>(static_cast<float>(src.view()(t, h, x)));
      if (!host.empty()) {
        SEQPAR_CUDA_CHECK(cudaMemcpy(dev_.data(), host.data(), host.size() * sizeof(U), cudaMemcpyHostToDevice),
                          "test upload");
        SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "test upload");
      }
    }
    [[nodiscard]] ThdTensor<double> read() const {
      const std::vector<U> host = dev_.to_host();
      ThdTensor<double> out(tokens_, heads_, d_);
      for (std::int64_t t = 0; t < tokens_; ++t)
        for (int h = 0; h < heads_; ++h)
          for (int x = 0; x < d_; ++x)
            out.view()(t, h, x) = static_cast<double>(gpu::detail::to_float(host[at(t, h, x)]));
      return out;
    }

   private:
    [[nodiscard]] std::size_t at(std::int64_t t, int h, int x) const {
      return static_cast<std::size_t>((t * (heads_ + pad_) + h + (pad_ == 0 ? 0 : 1)) * d_ + x);
    }
    gpu::DeviceArray<U> dev_;
    std::int64_t tokens_;
    int heads_, d_, pad_;
  };

  class Lse {
   public:
    Lse(int heads, std::int64_t tokens)
        : dev_(static_cast<std::size_t>(heads * tokens)), heads_(heads), tokens_(tokens) {}
    [[nodiscard]] LseView<float> view() const { return LseView<float>::dense(dev_.data(), heads_, tokens_); }
    void write(const LseTensor<double>& src) {
      std::vector<float> host(src.storage.begin(), src.storage.end());
      if (!host.empty()) {
        SEQPAR_CUDA_CHECK(cudaMemcpy(dev_.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
                          "test upload");
        SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "test upload");
      }
    }
    [[nodiscard]] LseTensor<double> read() const {
      const std::vector<float> host = dev_.to_host();
      LseTensor<double> out(heads_, tokens_);
      for (std::size_t i = 0; i < host.size(); ++i) out.storage[i] = host[i];
      return out;
    }

   private:
    gpu::DeviceArray<float> dev_;
    int heads_;
    std::int64_t tokens_;
  };

  /// Checked, stripped of slices without query rows and uploaded (gpu::DeviceSlices).
  class Slices {
   public:
    Slices(std::span<const AttnSlice> s, std::int64_t q_rows, std::int64_t k_rows) : s_(s, q_rows, k_rows) {}
    [[nodiscard]] std::span<const AttnSlice> span() const { return s_.device(); }

   private:
    gpu::DeviceSlices s_;
  };

  class Bytes {
   public:
    explicit Bytes(std::size_t n) : b_(n) {}
    [[nodiscard]] std::span<std::byte> span() const { return b_.span(); }

   private:
    gpu::DeviceBytes b_;
  };

  static AttentionShape adapt(AttentionShape shape) {
    shape.head_dim = kHeadDim;
    shape.softmax_scale = kScale;
    return shape;
  }
  static void finish(const kernel_type& k) { k.exec().synchronize(); }
};

template <class H>
void run_all(bool long_cases) {
  using T = typename H::value_type;
  attention::CudaFlash<T> flash;
  kc::run_cases<H>(flash, kTolerance<T>);
  if (long_cases) kc::run_long_cases<H>(flash, kTolerance<T>);
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("CudaFlash<float>: the kernel conformance cases at d64 and d128, fp32 at 1e-4") {
    run_all<Harness<float, 64>>(true);
    run_all<Harness<float, 128>>(false);
  }
  TEST_CASE("CudaFlash<__nv_bfloat16>: the kernel conformance cases at d128 and d64, at 2.5e-2") {
    run_all<Harness<__nv_bfloat16, 128>>(true);
    run_all<Harness<__nv_bfloat16, 64>>(false);
  }
  TEST_CASE("CudaFlash<__half>: the kernel conformance cases at d64, softmax_scale 0.05, at 2.5e-2") {
    run_all<Harness<__half, 64, 0.05>>(false);
  }
  TEST_CASE("CudaFlash keeps a NaN or infinity inside the document that holds it") {
    attention::CudaFlash<float> flash;
    kc::check_nonfinite_isolation<Harness<float, 64>>(flash, kc::Isolation::kDocument, 4);
    attention::CudaFlash<__nv_bfloat16> flash_bf16;
    kc::check_nonfinite_isolation<Harness<__nv_bfloat16, 128>>(flash_bf16, kc::Isolation::kDocument, 2);
  }
  TEST_CASE("CudaFlash refuses bad input") {
    attention::CudaFlash<float> flash;
    kc::check_refusals<Harness<float, 64>>(flash);
  }
}

}  // namespace seqpar::test
