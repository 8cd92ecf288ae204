// SPDX-License-Identifier: Apache-2.0
// seqpar_torch::TorchFlash<T>: an attention kernel on seqpar's kernel protocol (attention/kernel.hpp) whose
// calls are torch's own FlashAttention ops, aten::_flash_attention_forward / _flash_attention_backward
// (FlashAttention 2 vendored in torch; FlashAttention 4 when the user activates it with
// torch.nn.attention.activate_flash_attention_impl("FA4")). In the torch extension's CUDA path only
// (SEQPAR_TORCH_CUDA=1): it needs no install beyond torch. Issue 38.
//
// A kernel call's slice table becomes varlen calls on the host (attention/detail/varlen_calls.hpp: items
// bottom-right aligned, masks as FA's (left, right) window, backward waves with disjoint keys), once per
// program in `prepare` (the executor's lowering), where the cumulative sequence lengths and, for calls
// whose rows are not one contiguous run of the buffer, the gather indices are uploaded. Each call then
// runs on the exec's compute stream (a c10 stream guard over the CudaExec's cudaStream_t): queries and
// keys as views of the caller's buffers where contiguous, else gathered (index_select); O and LSE copied
// (or index_copy'd) into the caller's views, rows in no call O = 0, LSE = -inf; dQ added per row (a row
// is in one call at most), dK / dV added into fp32 accumulators across calls and waves, then into the
// caller's gradients (+=, the protocol's accumulation). The backward gets the merged O and LSE the
// protocol passes (every row's final ones), as ring attention passes them to FA's backward.
//
// fp16 and bf16 (FA's types), head_dim == head_dim_v, a multiple of 8 up to 256, compute capability 8.0
// or newer: can_implement refuses the rest by name, and the torch op then runs CudaFlash for that layer
// (python/src/cuda_attention.cpp). Scratch comes from ATen's caching allocator on the compute stream
// (torch's ops allocate their outputs): workspace_bytes is 0.
//
// Status: COMPILED ONLY (python/compile_cuda.sh). It has never run on a GPU; the mapping it executes is
// tested on the CPU against an fp64 stand-in of the varlen call (tests/attention/test_varlen_calls.cpp,
// tests/strategy/test_varlen_strategies.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <seqpar/attention/detail/varlen_calls.hpp>
#include <seqpar/attention/kernel.hpp>
#include <seqpar/core/attn_slice.hpp>
#include <seqpar/core/status.hpp>
#include <seqpar/core/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/exec.hpp"

namespace seqpar_torch {

namespace tf_detail {
namespace sp = seqpar;

template <class T>
constexpr at::ScalarType scalar_type() {
  if constexpr (std::is_same_v<T, __half>)
    return at::kHalf;
  else
    return at::kBFloat16;
}

// A non-owning tensor over a THD view (strides in elements, head_dim contiguous).
template <class U>
at::Tensor tensor_of(const sp::ThdView<U>& v, at::ScalarType dtype, const c10::Device& device) {
  return at::from_blob(const_cast<std::remove_const_t<U>*>(v.data), {v.tokens, v.heads, v.head_dim},
                       {v.token_stride, v.head_stride, 1}, at::TensorOptions().dtype(dtype).device(device));
}
template <class U>
at::Tensor tensor_of(const sp::LseView<U>& v, const c10::Device& device) {
  return at::from_blob(const_cast<std::remove_const_t<U>*>(v.data), {v.heads, v.tokens}, {v.head_stride, 1},
                       at::TensorOptions().dtype(at::kFloat).device(device));
}
}  // namespace tf_detail

/// TorchFlash's per-program parameters of one kernel call (`TorchFlash::prepare`): its varlen calls with
/// their device-side offsets and gather indices.
struct TorchFlashParams {
  struct Call {
    seqpar::attention::detail::VarlenCall plan;  ///< host: items, mask, segments, max lengths
    at::Tensor cu_q, cu_k;                       ///< int32 (items + 1), on the device
    at::Tensor q_index, k_index;                 ///< int64 packed row -> buffer row; undefined where contiguous
  };
  std::vector<Call> calls;
  std::int64_t num_slices = 0;  ///< slices of the call (what forward/backward are passed)
  seqpar::attention::Pass pass = seqpar::attention::Pass::kForward;
};

template <class T>
class TorchFlash {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "TorchFlash<T>: FlashAttention runs float16 and bfloat16 (CudaFlash<float> is the fp32 kernel)");

 public:
  using kernel_category = seqpar::attention::kernel_tag;
  using value_type = T;
  using accum_type = float;
  using exec_type = seqpar::gpu::CudaExec;
  using Params = TorchFlashParams;

  /// Streams of its own on the calling thread's current device, or the given context's.
  explicit TorchFlash(seqpar::gpu::CudaExec exec = seqpar::gpu::CudaExec()) : exec_(std::move(exec)) {}

  [[nodiscard]] const seqpar::gpu::CudaExec& exec() const noexcept { return exec_; }

  [[nodiscard]] seqpar::Status can_implement(const seqpar::AttentionShape& shape) const {
    return can_implement(exec_, shape);
  }
  /// What torch's FlashAttention-2 takes (flash_api.cpp's checks, sdp_utils' check_flash_attention_hardware_support):
  /// head_dim == head_dim_v, a multiple of 8, at most 256; compute capability >= 8.0; the softmax scale a
  /// float keeps (softmax_scale_status<float>). Each refusal names the argument and what FA needs.
  [[nodiscard]] seqpar::Status can_implement(const seqpar::gpu::CudaExec& exec,
                                             const seqpar::AttentionShape& shape) const {
    return shape_status(exec.compute_capability(), shape);
  }
  /// The same for a device of compute capability `cc` (10 x major + minor), without a context.
  [[nodiscard]] static seqpar::Status shape_status(int cc, const seqpar::AttentionShape& shape) {
    constexpr const char* where = "TorchFlash";
    if (seqpar::Status s = seqpar::attention::softmax_scale_status<float>(shape, where); !s) return s;
    if (shape.v_dim() != shape.qk_dim())
      return seqpar::detail::refuse_invalid(where, "head_dim_v", shape.v_dim(),
                                            "must equal head_dim = " + std::to_string(shape.qk_dim()) +
                                                " (torch's FlashAttention takes one head size for q, k and v)");
    if (shape.qk_dim() % 8 != 0 || shape.qk_dim() > 256)
      return seqpar::detail::refuse_invalid(where, "head_dim", shape.qk_dim(),
                                            "must be a multiple of 8 up to 256 (torch's FlashAttention)");
    if (cc < 80)
      return seqpar::detail::refuse_invalid(where, "compute capability", cc,
                                            "must be 80 or newer (torch's FlashAttention needs sm_80+)");
    return seqpar::Status::success();
  }

  [[nodiscard]] std::size_t workspace_bytes(const seqpar::AttentionShape&, std::int64_t, std::int64_t) const noexcept {
    return 0;  // ATen's caching allocator, on the compute stream
  }

  /// The call's varlen calls, planned on the host from `host_slices` (checked against q_rows and k_rows),
  /// their offsets and gather indices uploaded on the exec's compute stream (this waits for the copies).
  [[nodiscard]] Params prepare(const seqpar::gpu::CudaExec& exec, const seqpar::AttentionShape& shape,
                               std::span<const seqpar::AttnSlice> host_slices, std::int64_t q_rows, std::int64_t k_rows,
                               seqpar::attention::Pass pass) const {
    const char* const where =
        pass == seqpar::attention::Pass::kForward ? "TorchFlash::forward" : "TorchFlash::backward";
    seqpar::detail::throw_if_refused(can_implement(exec, shape));
    seqpar::validate_slices(host_slices, q_rows, k_rows, where);
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(exec.stream(), exec.device()));
    const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(exec.device()));
    const auto upload_ints = [&](const std::vector<std::int32_t>& v) {
      return at::tensor(at::ArrayRef<std::int32_t>(v), at::TensorOptions().dtype(at::kInt)).to(device);
    };
    const auto upload_rows = [&](const std::vector<seqpar::attention::detail::RowSegment>& segs) {
      std::vector<std::int64_t> rows;
      for (const auto& s : segs)
        for (std::int64_t r = s.begin; r < s.begin + s.rows; ++r) rows.push_back(r);
      return at::tensor(at::ArrayRef<std::int64_t>(rows), at::TensorOptions().dtype(at::kLong)).to(device);
    };
    Params p;
    p.num_slices = static_cast<std::int64_t>(host_slices.size());
    p.pass = pass;
    for (auto& call : seqpar::attention::detail::varlen_calls(host_slices, pass, where)) {
      Params::Call c;
      c.cu_q = upload_ints(call.cu_seqlens_q);
      c.cu_k = upload_ints(call.cu_seqlens_k);
      if (!call.q_contiguous()) c.q_index = upload_rows(call.q_rows);
      if (!call.k_contiguous()) c.k_index = upload_rows(call.k_rows);
      c.plan = std::move(call);
      p.calls.push_back(std::move(c));
    }
    return p;
  }

  void forward(const seqpar::gpu::CudaExec& exec, const Params& params, const seqpar::AttentionShape& shape,
               seqpar::ThdView<const T> q, seqpar::ThdView<const T> k, seqpar::ThdView<const T> v,
               std::span<const seqpar::AttnSlice> slices, seqpar::ThdView<T> o, seqpar::LseView<float> lse,
               std::span<std::byte>) const {
    check_params(params, slices, seqpar::attention::Pass::kForward, "TorchFlash::forward");
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(exec.stream(), exec.device()));
    const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(exec.device()));
    constexpr at::ScalarType dtype = tf_detail::scalar_type<T>();
    const at::Tensor Q = tf_detail::tensor_of(q, dtype, device), K = tf_detail::tensor_of(k, dtype, device),
                     V = tf_detail::tensor_of(v, dtype, device);
    at::Tensor O = tf_detail::tensor_of(o, dtype, device);  // (q rows, heads_q, d)
    at::Tensor L = tf_detail::tensor_of(lse, device);       // (heads_q, q rows)
    O.zero_();  // rows of no call: O = 0, LSE = -inf (the protocol's empty rows)
    L.fill_(-std::numeric_limits<float>::infinity());
    for (const Params::Call& c : params.calls) {
      const auto [out, lse_c, rng, unused, debug] = at::_flash_attention_forward(
          rows(Q, c.plan.q_rows, c.q_index), rows(K, c.plan.k_rows, c.k_index), rows(V, c.plan.k_rows, c.k_index),
          c.cu_q, c.cu_k, c.plan.max_q, c.plan.max_k, /*dropout_p=*/0.0, c.plan.mask.is_causal(),
          /*return_debug_mask=*/false, shape.scale(), left(c), right(c));
      (void)rng, (void)unused, (void)debug;
      if (c.plan.q_contiguous()) {
        O.narrow(0, c.plan.q_rows[0].begin, c.plan.total_q()).copy_(out);
        L.narrow(1, c.plan.q_rows[0].begin, c.plan.total_q()).copy_(lse_c);  // FA's varlen LSE: (heads_q, total_q)
      } else {
        O.index_copy_(0, c.q_index, out);
        L.index_copy_(1, c.q_index, lse_c);
      }
    }
  }

  void backward(const seqpar::gpu::CudaExec& exec, const Params& params, const seqpar::AttentionShape& shape,
                seqpar::ThdView<const T> q, seqpar::ThdView<const T> k, seqpar::ThdView<const T> v,
                seqpar::ThdView<const T> o, seqpar::LseView<const float> lse, seqpar::ThdView<const T> dout,
                std::span<const seqpar::AttnSlice> slices, seqpar::ThdView<T> dq, seqpar::ThdView<T> dk,
                seqpar::ThdView<T> dv, std::span<std::byte>) const {
    check_params(params, slices, seqpar::attention::Pass::kBackward, "TorchFlash::backward");
    if (params.calls.empty()) return;
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(exec.stream(), exec.device()));
    const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(exec.device()));
    constexpr at::ScalarType dtype = tf_detail::scalar_type<T>();
    const at::Tensor Q = tf_detail::tensor_of(q, dtype, device), K = tf_detail::tensor_of(k, dtype, device),
                     V = tf_detail::tensor_of(v, dtype, device), O = tf_detail::tensor_of(o, dtype, device),
                     dO = tf_detail::tensor_of(dout, dtype, device), L = tf_detail::tensor_of(lse, device);
    at::Tensor dQ = tf_detail::tensor_of(dq, dtype, device), dK = tf_detail::tensor_of(dk, dtype, device),
               dV = tf_detail::tensor_of(dv, dtype, device);
    // dK / dV of every call and wave summed in fp32, rounded once into the caller's gradients.
    at::Tensor dk_acc =
        at::zeros({k.tokens, k.heads, k.head_dim}, at::TensorOptions().dtype(at::kFloat).device(device));
    at::Tensor dv_acc =
        at::zeros({v.tokens, v.heads, v.head_dim}, at::TensorOptions().dtype(at::kFloat).device(device));
    // With dropout_p = 0 FA's backward reads no RNG state; these stand for the forward's outputs.
    const at::Tensor rng_state = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
    const at::Tensor unused = at::empty({0}, at::TensorOptions().dtype(at::kLong).device(device));
    for (const Params::Call& c : params.calls) {
      const at::Tensor lse_c =
          (c.plan.q_contiguous() ? L.narrow(1, c.plan.q_rows[0].begin, c.plan.total_q()) : L.index_select(1, c.q_index))
              .contiguous();
      const auto [dq_c, dk_c, dv_c] = at::_flash_attention_backward(
          rows(dO, c.plan.q_rows, c.q_index).contiguous(), rows(Q, c.plan.q_rows, c.q_index),
          rows(K, c.plan.k_rows, c.k_index), rows(V, c.plan.k_rows, c.k_index),
          rows(O, c.plan.q_rows, c.q_index).contiguous(), lse_c, c.cu_q, c.cu_k, c.plan.max_q, c.plan.max_k,
          /*dropout_p=*/0.0, c.plan.mask.is_causal(), rng_state, unused, shape.scale(), left(c), right(c));
      // A query row lies in one call at most, a key row at most once per call (waves): plain adds.
      if (c.plan.q_contiguous())
        dQ.narrow(0, c.plan.q_rows[0].begin, c.plan.total_q()).add_(dq_c);
      else
        dQ.index_add_(0, c.q_index, dq_c);
      if (c.plan.k_contiguous()) {
        dk_acc.narrow(0, c.plan.k_rows[0].begin, c.plan.total_k()).add_(dk_c);
        dv_acc.narrow(0, c.plan.k_rows[0].begin, c.plan.total_k()).add_(dv_c);
      } else {
        dk_acc.index_add_(0, c.k_index, dk_c.to(at::kFloat));
        dv_acc.index_add_(0, c.k_index, dv_c.to(at::kFloat));
      }
    }
    dK.add_(dk_acc);
    dV.add_(dv_acc);
  }

  /// Without Params (a direct call): the device slices are copied to the host (a wait on the stream),
  /// then planned and run as above.
  void forward(const seqpar::gpu::CudaExec& exec, const seqpar::AttentionShape& shape, seqpar::ThdView<const T> q,
               seqpar::ThdView<const T> k, seqpar::ThdView<const T> v, std::span<const seqpar::AttnSlice> slices,
               seqpar::ThdView<T> o, seqpar::LseView<float> lse, std::span<std::byte> workspace) const {
    const Params p =
        prepare(exec, shape, download(exec, slices), q.tokens, k.tokens, seqpar::attention::Pass::kForward);
    forward(exec, p, shape, q, k, v, slices, o, lse, workspace);
  }
  void backward(const seqpar::gpu::CudaExec& exec, const seqpar::AttentionShape& shape, seqpar::ThdView<const T> q,
                seqpar::ThdView<const T> k, seqpar::ThdView<const T> v, seqpar::ThdView<const T> o,
                seqpar::LseView<const float> lse, seqpar::ThdView<const T> dout,
                std::span<const seqpar::AttnSlice> slices, seqpar::ThdView<T> dq, seqpar::ThdView<T> dk,
                seqpar::ThdView<T> dv, std::span<std::byte> workspace) const {
    const Params p =
        prepare(exec, shape, download(exec, slices), q.tokens, k.tokens, seqpar::attention::Pass::kBackward);
    backward(exec, p, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
  }

 private:
  // The call's packed rows of X: a view where they are one run of the buffer, else a gather.
  static at::Tensor rows(const at::Tensor& x, const std::vector<seqpar::attention::detail::RowSegment>& segs,
                         const at::Tensor& index) {
    if (segs.size() == 1) return x.narrow(0, segs[0].begin, segs[0].rows);
    return x.index_select(0, index);
  }
  static std::optional<std::int64_t> left(const Params::Call& c) {
    if (c.plan.mask.is_causal() || c.plan.mask.left < 0) return std::nullopt;
    return c.plan.mask.left;
  }
  static std::optional<std::int64_t> right(const Params::Call& c) {
    if (c.plan.mask.is_causal() || c.plan.mask.right < 0) return std::nullopt;
    return c.plan.mask.right;
  }
  static void check_params(const Params& p, std::span<const seqpar::AttnSlice> slices, seqpar::attention::Pass pass,
                           const char* where) {
    seqpar::detail::require(p.num_slices == static_cast<std::int64_t>(slices.size()) && p.pass == pass, where, "params",
                            p.num_slices,
                            "were prepared for another call (" + std::to_string(slices.size()) +
                                " slices given): pass the Params prepare() made for this call and pass");
  }
  static std::vector<seqpar::AttnSlice> download(const seqpar::gpu::CudaExec& exec,
                                                 std::span<const seqpar::AttnSlice> slices) {
    std::vector<seqpar::AttnSlice> host(slices.size());
    if (slices.empty()) return host;
    SEQPAR_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), slices.data(), slices.size_bytes(), cudaMemcpyDefault, exec.stream()),
        "TorchFlash: copying the slices to the host");
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "TorchFlash: copying the slices to the host");
    return host;
  }

  seqpar::gpu::CudaExec exec_;
};

static_assert(seqpar::attention::PreparingKernel<TorchFlash<__half>>);
static_assert(seqpar::attention::PreparingKernel<TorchFlash<__nv_bfloat16>>);

}  // namespace seqpar_torch
