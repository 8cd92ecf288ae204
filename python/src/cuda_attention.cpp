// SPDX-License-Identifier: Apache-2.0
// seqpar_torch::CudaAttention (cuda_attention.hpp). Host code only: CudaFlash and DataOps<CudaExec>
// come compiled from kernels/instances (nvcc), built into the same extension; TorchFlash (torch_flash.hpp)
// calls torch's own FlashAttention ops.
#include "cuda_attention.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <seqpar/attention/sinks.hpp>
#include <seqpar/backend/c10d/device_transport.hpp>

#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <type_traits>
#include <utility>

#include "engines.hpp"
#include "op_call.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"
#include "torch_flash.hpp"

#ifndef SEQPAR_TORCH_CUDNN
#define SEQPAR_TORCH_CUDNN 0  // python/setup.py defines it 1 where it finds cuDNN and cudnn-frontend
#endif
#if SEQPAR_TORCH_CUDNN
#include "seqpar/gpu/cudnn_sdpa.hpp"
#endif

namespace seqpar_torch {

namespace {

constexpr std::string_view kWhere = "seqpar.torch.DistributedAttention";

// One engine per softmax scale a call used (0: 1 / sqrt(head_dim)), per kernel type.
template <class K>
using EnginesOf = std::map<double, std::unique_ptr<sp::runtime::AttentionEngine<K>>>;
template <class T>
using Engines = EnginesOf<sp::attention::CudaFlash<T>>;
template <class T>
using FlashEngines = EnginesOf<TorchFlash<T>>;

// The vendor kernels' engines of a 16-bit type T (none for float): TorchFlash's, and CudnnSdpa's where this
// build has cuDNN (SEQPAR_TORCH_CUDNN, python/setup.py), with one CudnnSdpa asked can_implement (its cuDNN
// version checks need a handle on q's device).
template <class T>
struct Vendors {
  FlashEngines<T> flash;
#if SEQPAR_TORCH_CUDNN
  EnginesOf<sp::attention::CudnnSdpa<T>> cudnn;
  std::unique_ptr<sp::attention::CudnnSdpa<T>> cudnn_probe;
#endif
};
template <>
struct Vendors<float> {};

enum class Choice { kCudnn, kFlash, kSeqpar };
const char* name_of(Choice c) {
  return c == Choice::kCudnn ? "cudnn" : c == Choice::kFlash ? "flash" : "seqpar";
}

// `to` waits for what `from` has issued so far (an event; no host wait). Returns the first error.
cudaError_t order_status(cudaStream_t from, cudaStream_t to) noexcept {
  if (from == to) return cudaSuccess;
  cudaEvent_t event = nullptr;
  if (const cudaError_t created = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); created != cudaSuccess)
    return created;
  const cudaError_t recorded = cudaEventRecord(event, from);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(to, event, 0) : recorded;
  (void)cudaEventDestroy(event);  // released once the wait is done
  return waited;
}
void order(cudaStream_t from, cudaStream_t to) {
  SEQPAR_CUDA_CHECK(order_status(from, to), "seqpar.torch (CUDA): ordering torch's stream and seqpar's");
}

// Static review B1: torch's stream after seqpar's compute and comm streams on every path out of a call,
// exceptions included. The outputs (and any temporaries) are blocks of torch's caching allocator on torch's
// stream: were a throw to skip the ordering, torch would free and reuse them while seqpar's streams may still
// write them. The destructor never throws: where an event cannot order the streams (a broken context), it
// waits on the host for seqpar's streams instead, and ignores what that returns.
class OrderOnExit {
 public:
  OrderOnExit(cudaStream_t compute, cudaStream_t comm, cudaStream_t torch) noexcept
      : compute_(compute), comm_(comm), torch_(torch) {}
  OrderOnExit(const OrderOnExit&) = delete;
  OrderOnExit& operator=(const OrderOnExit&) = delete;
  /// The normal path: order now and report a failure as an exception (the destructor then does nothing).
  void order_now() {
    done_ = true;
    order(comm_, torch_);  // the executor orders compute after every transfer; comm too, for the error paths' sake
    order(compute_, torch_);
  }
  ~OrderOnExit() {
    if (done_) return;
    for (cudaStream_t s : {comm_, compute_})
      if (order_status(s, torch_) != cudaSuccess) (void)cudaStreamSynchronize(s);
  }

 private:
  cudaStream_t compute_, comm_, torch_;
  bool done_ = false;
};

}  // namespace

struct CudaAttention::State {
  std::string strategy;
  sp::AttentionShape shape;
  c10::intrusive_ptr<::c10d::ProcessGroup> group;
  std::chrono::milliseconds timeout;
  int ranks_per_node;
  sp::MaskMix masks;                                              // the model's: placements balance it
  double capacity_factor;                                         // whole-doc's and hybrid's (0: default)
  std::string kernel;                                             // "auto", "cudnn", "flash", "seqpar" (ops.cpp checks)
  std::optional<c10::Device> device;                              // of the first call: every call's
  std::unique_ptr<sp::backend::c10d::DeviceTransport> transport;  // engines hold a reference
  Engines<float> floats;
  Engines<__half> halves;
  Engines<__nv_bfloat16> bf16s;
  Vendors<float> vendor_floats;  // none: CudaFlash is the fp32 kernel
  Vendors<__half> vendor_halves;
  Vendors<__nv_bfloat16> vendor_bf16s;
  std::string ran;                     // the kernel of the last call: "cudnn", "flash" or "seqpar"
  std::set<std::string> warned;        // fallbacks already said (one log line each)
  bool in_engine = false;              // the last call reached its engine (whose agreement reports its refusals)
  std::optional<std::uint64_t> layer;  // set_layer's, given to every engine (else each its order on the transport)

  // The transport on q's device, made at the first call: the group must have an NCCL backend for CUDA.
  sp::backend::c10d::DeviceTransport& transport_on(const at::Tensor& q) {
    if (device)
      sp::detail::require(q.device() == *device, kWhere, "q.device", q.device().str(),
                          "must be " + device->str() + " (this layer's first CUDA call ran there)");
    return transport_at(q.device());
  }
  // The layer's transport, made on `dev` unless an earlier call made it (on its device).
  sp::backend::c10d::DeviceTransport& transport_at(c10::Device dev) {
    if (device) return *transport;
    std::string backend = "none";
    try {
      backend = group->getBackend(c10::DeviceType::CUDA)->getBackendName();
    } catch (const std::exception&) {  // no backend for CUDA tensors
    }
    sp::detail::require(backend == "nccl", kWhere, "group's CUDA backend", backend,
                        "must be nccl for CUDA tensors (init_process_group(\"nccl\") or \"cpu:gloo,cuda:nccl\")");
    sp::backend::c10d::DeviceTransport::Options options;
    options.timeout = timeout;
    options.device = dev.index();
    transport = std::make_unique<sp::backend::c10d::DeviceTransport>(group, options);
    device = dev;
    return *transport;
  }

  template <class K>
  sp::runtime::AttentionEngine<K>& engine_for(EnginesOf<K>& engines, double scale,
                                              sp::backend::c10d::DeviceTransport& t) {
    // K{}: CudaFlash and TorchFlash make streams of their own on the current device (the guard's: q's).
    std::unique_ptr<sp::runtime::AttentionEngine<K>>& slot = engines[scale];
    if (!slot) {
      sp::AttentionShape scaled = shape;
      scaled.softmax_scale = scale;
      slot = make_engine<K>(strategy, t, scaled, ranks_per_node, masks, K(), capacity_factor);
      if (layer) slot->set_layer(*layer);
    }
    return *slot;
  }

  // Which kernel runs a call of T at `scale` under `mask` on q's device (a choice per layer, dtype, scale and
  // mask: the forward's and the backward's agree). "auto": CudnnSdpa where this build has it and it takes the
  // shape, else TorchFlash where torch's FlashAttention takes it, else CudaFlash (the float32 kernel too);
  // "cudnn" / "flash": that kernel where it takes the shape, else CudaFlash; "seqpar": CudaFlash. A fallback to
  // CudaFlash from a vendor kernel is said once per layer and reason (a warning, never an exception).
  template <class T>
  Choice choose(Vendors<T>& vendors, double scale, sp::AttentionMask mask, const at::Tensor& q) {
    if (kernel == "seqpar") return Choice::kSeqpar;
    std::string why;
    if constexpr (std::is_same_v<T, float>) {
      (void)vendors, (void)mask;
      if (kernel == "auto") return Choice::kSeqpar;  // CudaFlash is the fp32 kernel
      why = "q.dtype = float32 (cuDNN's SDPA and FlashAttention run float16 and bfloat16)";
    } else {
      sp::AttentionShape scaled = shape;
      scaled.softmax_scale = scale;
#if SEQPAR_TORCH_CUDNN
      if (kernel == "auto" || kernel == "cudnn") {
        if (mask.window != 0) {
          // CudnnSdpa refuses, mid-call, a window whose rows reach past a slice's last key (cuDNN's band has no
          // right cut), which ring and all-gather steps make: windowed calls never go to it.
          why = "sliding-window calls (cuDNN's band cannot be cut on the right by a slice's last key)";
        } else {
          if (!vendors.cudnn_probe) vendors.cudnn_probe = std::make_unique<sp::attention::CudnnSdpa<T>>();
          const sp::Status s = vendors.cudnn_probe->can_implement(vendors.cudnn_probe->exec(), scaled);
          if (s.ok) return Choice::kCudnn;
          why = s.reason;
        }
      }
#else
      (void)mask;
#endif
      if (kernel == "auto" || kernel == "flash") {
        const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q.device().index());
        const sp::Status s = TorchFlash<T>::shape_status(10 * prop->major + prop->minor, scaled);
        if (s.ok) return Choice::kFlash;
        why = s.reason;
      }
    }
    if (warned.insert(why).second)
      TORCH_WARN("seqpar.torch.DistributedAttention: kernel='", kernel, "' falls back to seqpar's CudaFlash for ", why);
    return Choice::kSeqpar;
  }

  // The head sizes CudaFlash is built for (64/64, 128/128 and MLA's 192/128): others are refused here,
  // by name, before any device work.
  void require_cuda_head_sizes() const {
    sp::detail::throw_if_refused(sp::attention::cuda_flash_shape_status(shape, std::string(kWhere).c_str()));
  }

  // The sinks checked (sinks_tensor) and their values on a host copy (NaN, +inf refused by name): the
  // stream-ordered engine cannot read device memory on the host.
  at::Tensor checked_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& q) const {
    at::Tensor s = sinks_tensor(sinks, shape, at::kFloat, q);
    if (s.defined()) {
      const at::Tensor host = s.cpu();
      sp::attention::check_sinks(std::string(kWhere).c_str(), span_of<const float>(host), shape.heads_q);
    }
    return s;
  }

  // The call's checks and views (op_call.hpp, shared with the CPU path) on q's device, then the engine's call
  // ordered after and before torch's stream (run).
  template <class K>
  std::vector<at::Tensor> forward_as(EnginesOf<K>& engines, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const Lengths& lengths,
                                     const std::optional<at::Tensor>& sinks, sp::AttentionMask mask, double scale) {
    using T = typename K::value_type;
    const c10::cuda::CUDAGuard guard(q.device());
    if constexpr (std::is_same_v<K, sp::attention::CudaFlash<T>>) require_cuda_head_sizes();
    auto& t = transport_on(q);
    const ForwardCall<T, float> call(shape, q, k, v, lengths, q.device(), [&] { return checked_sinks(sinks, q); });
    auto& e = engine_for<K>(engines, scale, t);
    in_engine = true;  // from here the engine's agreement reports this rank's refusals
    run(e, [&] { call.run(e, mask); });
    return call.outputs();
  }

  template <class K>
  std::vector<at::Tensor> backward_as(EnginesOf<K>& engines, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                      const at::Tensor& dout, const Lengths& lengths,
                                      const std::optional<at::Tensor>& sinks, sp::AttentionMask mask, double scale) {
    using T = typename K::value_type;
    const c10::cuda::CUDAGuard guard(q.device());
    if constexpr (std::is_same_v<K, sp::attention::CudaFlash<T>>) require_cuda_head_sizes();
    auto& t = transport_on(q);
    const BackwardCall<T, float> call(shape, q, k, v, o, lse, dout, lengths, q.device(),
                                      [&] { return checked_sinks(sinks, q); });
    auto& e = engine_for<K>(engines, scale, t);
    in_engine = true;  // from here the engine's agreement reports this rank's refusals
    run(e, [&] { call.run(e, mask); });
    return call.outputs();
  }

  // The engine's work after what torch's current stream has issued (the inputs' producers), and torch's
  // stream after the engine's (the outputs' consumers; the compute stream is after every transfer of the
  // program, the executor orders it so): no host wait. The transport enqueues on the engine's comm stream.
  // torch's stream is ordered after seqpar's on every path, a throw included (OrderOnExit, review B1).
  template <class K, class F>
  void run(sp::runtime::AttentionEngine<K>& e, F&& call) {
    const cudaStream_t torch_stream = c10::cuda::getCurrentCUDAStream(device->index()).stream();
    const cudaStream_t compute = e.exec().stream();
    OrderOnExit after(compute, e.exec().comm_stream(), torch_stream);
    order(torch_stream, compute);
    {
      pybind11::gil_scoped_release release;
      call();
    }
    after.order_now();
  }

  template <class T>
  std::vector<at::Tensor> forward_typed(Engines<T>& own, Vendors<T>& vendors, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const Lengths& lengths,
                                        const std::optional<at::Tensor>& sinks, sp::AttentionMask mask, double scale) {
    const Choice choice = choose<T>(vendors, scale, mask, q);
    ran = name_of(choice);
    if constexpr (!std::is_same_v<T, float>) {
#if SEQPAR_TORCH_CUDNN
      if (choice == Choice::kCudnn)
        return forward_as<sp::attention::CudnnSdpa<T>>(vendors.cudnn, q, k, v, lengths, sinks, mask, scale);
#endif
      if (choice == Choice::kFlash)
        return forward_as<TorchFlash<T>>(vendors.flash, q, k, v, lengths, sinks, mask, scale);
    }
    return forward_as<sp::attention::CudaFlash<T>>(own, q, k, v, lengths, sinks, mask, scale);
  }
  template <class T>
  std::vector<at::Tensor> backward_typed(Engines<T>& own, Vendors<T>& vendors, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                         const at::Tensor& dout, const Lengths& lengths,
                                         const std::optional<at::Tensor>& sinks, sp::AttentionMask mask, double scale) {
    const Choice choice = choose<T>(vendors, scale, mask, q);  // the forward's (same layer, dtype, scale, mask)
    ran = name_of(choice);
    if constexpr (!std::is_same_v<T, float>) {
#if SEQPAR_TORCH_CUDNN
      if (choice == Choice::kCudnn)
        return backward_as<sp::attention::CudnnSdpa<T>>(vendors.cudnn, q, k, v, o, lse, dout, lengths, sinks, mask,
                                                        scale);
#endif
      if (choice == Choice::kFlash)
        return backward_as<TorchFlash<T>>(vendors.flash, q, k, v, o, lse, dout, lengths, sinks, mask, scale);
    }
    return backward_as<sp::attention::CudaFlash<T>>(own, q, k, v, o, lse, dout, lengths, sinks, mask, scale);
  }
};

CudaAttention::CudaAttention(std::string strategy, const sp::AttentionShape& shape,
                             c10::intrusive_ptr<::c10d::ProcessGroup> group, std::chrono::milliseconds timeout,
                             int ranks_per_node, sp::MaskMix masks, double capacity_factor, std::string kernel)
    : s_(std::make_unique<State>(State{std::move(strategy),
                                       shape,
                                       std::move(group),
                                       timeout,
                                       ranks_per_node,
                                       std::move(masks),
                                       capacity_factor,
                                       std::move(kernel),
                                       std::nullopt,
                                       nullptr,
                                       {},
                                       {},
                                       {},
                                       {},
                                       {},
                                       {},
                                       {},
                                       {},
                                       false,
                                       std::nullopt})) {}

void CudaAttention::set_layer(std::uint64_t layer) noexcept {
  s_->layer = layer;
  const auto name = [&](auto& engines) {
    for (auto& [scale, e] : engines) e->set_layer(layer);
  };
  name(s_->floats), name(s_->halves), name(s_->bf16s);
  name(s_->vendor_halves.flash), name(s_->vendor_bf16s.flash);
#if SEQPAR_TORCH_CUDNN
  name(s_->vendor_halves.cudnn), name(s_->vendor_bf16s.cudnn);
#endif
}

bool CudaAttention::in_engine() const noexcept {
  return s_->in_engine;
}

void CudaAttention::refuse(const std::string& why) noexcept {
  try {
    const c10::Device dev = s_->device ? *s_->device : c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
    const c10::cuda::CUDAGuard guard(dev);
    refuse_over(s_->transport_at(dev), why);
  } catch (...) {  // no transport could be made (no NCCL backend, no device): the peers have their timeout
  }
}

const std::string& CudaAttention::kernel_ran() const noexcept {
  return s_->ran;
}

CudaAttention::~CudaAttention() = default;

std::vector<at::Tensor> CudaAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const Lengths& lengths, const std::optional<at::Tensor>& sinks,
                                               sp::AttentionMask mask, double scale) {
  s_->in_engine = false;
  switch (q.scalar_type()) {
    case at::kFloat:
      return s_->forward_typed<float>(s_->floats, s_->vendor_floats, q, k, v, lengths, sinks, mask, scale);
    case at::kHalf:
      return s_->forward_typed<__half>(s_->halves, s_->vendor_halves, q, k, v, lengths, sinks, mask, scale);
    case at::kBFloat16:
      return s_->forward_typed<__nv_bfloat16>(s_->bf16s, s_->vendor_bf16s, q, k, v, lengths, sinks, mask, scale);
    default:
      break;
  }
  sp::detail::throw_invalid(kWhere, "q.dtype", c10::toString(q.scalar_type()),
                            "must be float32, float16 or bfloat16 on CUDA (the CUDA kernels' types)");
}

std::vector<at::Tensor> CudaAttention::backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                                                const Lengths& lengths, const std::optional<at::Tensor>& sinks,
                                                sp::AttentionMask mask, double scale) {
  s_->in_engine = false;
  switch (q.scalar_type()) {
    case at::kFloat:
      return s_->backward_typed<float>(s_->floats, s_->vendor_floats, q, k, v, o, lse, dout, lengths, sinks, mask,
                                       scale);
    case at::kHalf:
      return s_->backward_typed<__half>(s_->halves, s_->vendor_halves, q, k, v, o, lse, dout, lengths, sinks, mask,
                                        scale);
    case at::kBFloat16:
      return s_->backward_typed<__nv_bfloat16>(s_->bf16s, s_->vendor_bf16s, q, k, v, o, lse, dout, lengths, sinks, mask,
                                               scale);
    default:
      break;
  }
  sp::detail::throw_invalid(kWhere, "q.dtype", c10::toString(q.scalar_type()),
                            "must be float32, float16 or bfloat16 on CUDA (the CUDA kernels' types)");
}

}  // namespace seqpar_torch
