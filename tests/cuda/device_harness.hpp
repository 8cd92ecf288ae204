// SPDX-License-Identifier: Apache-2.0
// The shared kernel cases' harness (tests/support/kernel_cases.hpp) on device memory, for the CUDA
// kernels (CudaFlash, CudnnSdpa): tensors, LSE, slices and workspaces in device memory, written and
// read with synchronous copies.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/slices.hpp"
#include "support/kernel_cases.hpp"

namespace seqpar::test {

/// A kernel's harness on device memory, written and read with synchronous copies; every case runs at
/// head_dim kHeadDim, softmax_scale kScale (0: 1/sqrt(head_dim)) and, where kHeadDimV is not 0, the
/// value head size head_dim_v kHeadDimV (0: the case's own, which is head_dim in kernel_cases::cases()).
template <class Kernel, int kHeadDim, double kScale = 0.0, int kHeadDimV = 0>
struct DeviceHarness {
  using kernel_type = Kernel;
  using value_type = typename Kernel::value_type;
  using accum_type = float;
  /// CudaFlash and CudnnSdpa check extents, layouts and the workspace size, but not that outputs share no
  /// memory with other views (kernels/seqpar/gpu/flash.cuh, check_inputs): the aliasing refusals are left out.
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
    if constexpr (kHeadDimV != 0) shape.head_dim_v = kHeadDimV;
    return shape;
  }
  static void finish(const kernel_type& k) { k.exec().synchronize(); }
};

}  // namespace seqpar::test
