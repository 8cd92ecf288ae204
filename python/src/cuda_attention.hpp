// SPDX-License-Identifier: Apache-2.0
// The torch op's CUDA path, in extensions built with SEQPAR_TORCH_CUDA=1 (python/setup.py): seqpar's
// DistributedAttention on CUDA tensors with attention::CudnnSdpa (where the build has cuDNN) or TorchFlash
// (torch's FlashAttention ops) for float16 / bfloat16, or attention::CudaFlash (float32, and every shape the
// vendor kernels refuse), over backend::c10d::DeviceTransport
// (the process group's NCCL backend), ordered after and before torch's current stream. Compiled in CI
// (compile only); it has never run on a GPU.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <seqpar/core/attention_mask.hpp>
#include <seqpar/core/attention_shape.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace seqpar_torch {

class CudaAttention {
 public:
  using Lengths = std::vector<std::vector<std::int64_t>>;

  /// Not collective: the transport and engines are made at the first call, on q's device.
  /// kernel, for float16 / bfloat16: "auto" (CudnnSdpa where the extension has cuDNN and it takes the call,
  /// else TorchFlash, torch's FlashAttention ops, where they take the shape, else CudaFlash), "cudnn" or
  /// "flash" (that kernel, else CudaFlash with one warning per reason), "seqpar" (CudaFlash always); float32
  /// runs CudaFlash. ops.cpp checks the name.
  CudaAttention(std::string strategy, const seqpar::AttentionShape& shape,
                c10::intrusive_ptr<::c10d::ProcessGroup> group, std::chrono::milliseconds timeout, int ranks_per_node,
                seqpar::MaskMix masks, double capacity_factor, std::string kernel = "auto");
  CudaAttention(const CudaAttention&) = delete;
  CudaAttention& operator=(const CudaAttention&) = delete;
  ~CudaAttention();

  /// o (tokens, heads_q, head_dim_v) in q's dtype and lse (heads_q, tokens) in float32, on q's device;
  /// fp32, fp16, bf16 (CudaFlash<float / __half / __nv_bfloat16>), the head sizes CudaFlash is built for
  /// (64/64, 128/128, MLA's 192/128; others are refused by name). Optional sinks: heads_q float32 logits on
  /// q's device (the engine's sink epilogue; their values are checked on a host copy).
  std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Lengths& lengths,
                                  const std::optional<at::Tensor>& sinks, seqpar::AttentionMask mask, double scale);
  /// The layer every engine of this object (one per dtype, kernel and scale) names in its calls' agreement
  /// (runtime/layer_order.hpp): ops.cpp's set_layer, so two layers called in different orders on two ranks
  /// are refused on CUDA tensors too.
  void set_layer(std::uint64_t layer) noexcept;
  /// Whether the last forward or backward reached its engine's call: from there the engine's agreement
  /// reports this rank's refusals to its peers; a refusal before it (dtype, strides, head sizes, sinks, the
  /// device, the group's backend) is for refuse().
  [[nodiscard]] bool in_engine() const noexcept;
  /// This rank refuses the CUDA call its peers are making (`why`: the exception it raises), as its outcome of
  /// the call's agreement over the layer's NCCL transport (made here, on the current CUDA device, if the
  /// refused call is the layer's first): the peers' engines raise seqpar::Error (kPeerFailed) naming this
  /// rank and `why` at once instead of waiting for it until the timeout. Never throws: a transport that
  /// cannot be made or reached leaves the peers to their timeout, and `why` is what this rank raises.
  void refuse(const std::string& why) noexcept;
  /// The kernel of the last call: "cudnn" (CudnnSdpa), "flash" (TorchFlash) or "seqpar" (CudaFlash); "" before
  /// the first.
  [[nodiscard]] const std::string& kernel_ran() const noexcept;
  /// scale: the softmax scale (0: 1 / sqrt(head_dim)), one engine per scale.
  /// dq, dk, dv and the sinks' gradient summed over the ranks (an empty tensor without sinks).
  std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                                   const at::Tensor& lse, const at::Tensor& dout, const Lengths& lengths,
                                   const std::optional<at::Tensor>& sinks, seqpar::AttentionMask mask, double scale);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace seqpar_torch
