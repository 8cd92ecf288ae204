// SPDX-License-Identifier: Apache-2.0
// seqpar._C: seqpar's DistributedAttention on a torch.distributed process group, for the torch op
// in seqpar/torch.py. Tensors are used in place (views of their storage): the binding copies none of
// q, k, v, o, lse or the gradients. q and k have head_dim values per head, v and o head_dim_v (MLA:
// 192 and 128). Optional attention sinks: one logit per query head in the kernels' accumulation type
// (float64 for float64 q, else float32); backward returns their gradient summed over the group's ranks.
// Bad arguments raise std::invalid_argument (Python ValueError) naming the argument; transport failures
// raise seqpar::Error (Python RuntimeError).
#include <torch/extension.h>

#include <seqpar/backend/c10d/transport.hpp>
#include <seqpar/plan/candidates.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/token_meta.hpp>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engines.hpp"
#include "op_call.hpp"
#ifndef SEQPAR_TORCH_CUDA
#define SEQPAR_TORCH_CUDA 0  // python/setup.py defines it 1 when built with CUDA (SEQPAR_TORCH_CUDA=1)
#endif
#ifndef SEQPAR_TORCH_CUDNN
#define SEQPAR_TORCH_CUDNN 0  // python/setup.py defines it 1 with CUDA where it finds cuDNN and cudnn-frontend
#endif
#if SEQPAR_TORCH_CUDA
#include "cuda_attention.hpp"
#endif

namespace {

using namespace seqpar_torch;
// torch's bfloat16 (c10::BFloat16) and seqpar's (attention::bf16) are both the upper 16 bits of an
// IEEE binary32: a bf16 tensor's storage is viewed as seqpar's type, no conversion.
using Bf16 = sp::attention::bf16;
static_assert(sizeof(Bf16) == sizeof(c10::BFloat16) && alignof(Bf16) <= alignof(c10::BFloat16));

// One torch-facing attention layer: a transport on the group and one engine per dtype (made on
// first use; each keeps its own plan cache).
class Attention {
 public:
  // mask_mix: the model's (window, layers) pairs, window 0 = causal (empty: every layer causal): what the
  // one placement of each batch is balanced for; every call may pass any window.
  Attention(std::string strategy, int heads_q, int heads_kv, int head_dim,
            const c10::intrusive_ptr<::c10d::ProcessGroup>& group, double timeout_s, int ranks_per_node, int head_dim_v,
            const std::vector<std::pair<std::int64_t, std::int64_t>>& mask_mix, int threads, double capacity_factor,
            std::string kernel = "auto")
      : strategy_(std::move(strategy)),
        shape_{heads_q, heads_kv, head_dim, 0.0, head_dim_v},
        ranks_per_node_(ranks_per_node),
        masks_(mix_of(mask_mix)),
        threads_(threads),
        capacity_factor_(capacity_factor),
        kernel_(std::move(kernel)) {
    constexpr std::string_view where = "seqpar.torch.DistributedAttention";
    check_kernel(kernel_);
    sp::detail::require(threads >= 1 && threads <= 1024, where, "threads", threads,
                        "must be in [1, 1024] (the CPU kernel's threads on this rank; None: torch.get_num_threads())");
    sp::detail::require(heads_q >= 1, where, "heads_q", heads_q, "must be >= 1");
    sp::detail::require(heads_kv >= 1 && heads_q % heads_kv == 0, where, "heads_kv", heads_kv,
                        "must be >= 1 and divide heads_q = " + std::to_string(heads_q));
    sp::detail::require(head_dim >= 1 && head_dim <= 1024, where, "head_dim", head_dim, "must be in [1, 1024]");
    sp::detail::require(head_dim_v >= 1 && head_dim_v <= 1024, where, "head_dim_v", head_dim_v,
                        "must be in [1, 1024] (the value head size; None: head_dim)");
    sp::backend::c10d::Transport::Options options;
    options.timeout = sp::detail::timeout_from_seconds(where, "timeout_s", timeout_s);  // inf: no bound in practice
    transport_ = std::make_unique<sp::backend::c10d::Transport>(group, options);
    (void)meta_engine();  // an unknown strategy fails here, in the constructor
#if SEQPAR_TORCH_CUDA
    cuda_ = std::make_unique<CudaAttention>(strategy_, shape_, group, options.timeout, ranks_per_node, masks_,
                                            capacity_factor, kernel_);
#endif
  }

  // The batch: cu_seqlens (documents + 1 cumulative offsets over the whole packed batch) and doc_counts (the
  // documents of each sequence; none: one). window: the call's sliding window in keys, the query's own
  // included (0: causal): FlashAttention's window_size = (window - 1, 0). scale: the softmax scale (0:
  // 1 / sqrt(head_dim)).
  std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& doc_counts,
                                  const std::optional<at::Tensor>& sinks, std::int64_t window, double scale) {
    return in_torch_terms(q, cu_seqlens, doc_counts, [&] {
      const Lengths lengths = lengths_of(cu_seqlens, doc_counts);
      const sp::AttentionMask mask = mask_of(window);
      check_scale(scale);
      if (strategy_ == "auto") last_lengths_ = lengths;  // what repr's "chose" reports (no copy otherwise)
#if SEQPAR_TORCH_CUDA
      if (q.is_cuda()) {  // its refusals go to its own transport (refuse_peers, cuda_attention.cpp)
        last_cuda_ = true;
        return cuda_->forward(q, k, v, lengths, sinks, mask, scale);
      }
#endif
      require_cpu_kernel();
      switch (q.scalar_type()) {
        case at::kDouble:
          return forward_as<double>(doubles_, q, k, v, lengths, sinks, mask, scale);
        case at::kFloat:
          return forward_as<float>(floats_, q, k, v, lengths, sinks, mask, scale);
        case at::kBFloat16:  // CpuFlash<bf16> on the tensors' own storage: fp32 accumulation, fp32 lse
          return forward_as<Bf16>(bf16s_, q, k, v, lengths, sinks, mask, scale);
        default:
          break;
      }
      sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "q.dtype", c10::toString(q.scalar_type()),
                                "must be float64, float32 or bfloat16");
    });
  }

  // dq, dk, dv and the sinks' gradient (summed over the ranks; an empty tensor without sinks).
  std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                                   const at::Tensor& lse, const at::Tensor& dout, const at::Tensor& cu_seqlens,
                                   const std::optional<at::Tensor>& doc_counts, const std::optional<at::Tensor>& sinks,
                                   std::int64_t window, double scale) {
    return in_torch_terms(q, cu_seqlens, doc_counts, [&] {
      const Lengths lengths = lengths_of(cu_seqlens, doc_counts);
      const sp::AttentionMask mask = mask_of(window);
      check_scale(scale);
#if SEQPAR_TORCH_CUDA
      if (q.is_cuda()) {  // its refusals go to its own transport (refuse_peers, cuda_attention.cpp)
        last_cuda_ = true;
        return cuda_->backward(q, k, v, o, lse, dout, lengths, sinks, mask, scale);
      }
#endif
      require_cpu_kernel();
      switch (q.scalar_type()) {
        case at::kDouble:
          return backward_as<double>(doubles_, q, k, v, o, lse, dout, lengths, sinks, mask, scale);
        case at::kFloat:
          return backward_as<float>(floats_, q, k, v, o, lse, dout, lengths, sinks, mask, scale);
        case at::kBFloat16:
          return backward_as<Bf16>(bf16s_, q, k, v, o, lse, dout, lengths, sinks, mask, scale);
        default:
          break;
      }
      sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "q.dtype", c10::toString(q.scalar_type()),
                                "must be float64, float32 or bfloat16");
    });
  }

  // This rank's rows: for each, its global token, sequence, document, position in the document, and
  // the global token of its next-token label (-1 for a document's last token). Local: no communication.
  std::vector<at::Tensor> token_meta(const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& doc_counts) {
    const sp::DocumentBatch batch = make_batch(lengths_of(cu_seqlens, doc_counts));
    auto& e = meta_engine();
    const sp::train::TokenMeta m = sp::train::token_meta(batch, e.placement(batch), transport_->rank());
    const auto longs = [](const auto& v) {
      at::Tensor t = at::empty({static_cast<std::int64_t>(v.size())}, at::kLong);
      for (std::size_t i = 0; i < v.size(); ++i) t.data_ptr<std::int64_t>()[i] = static_cast<std::int64_t>(v[i]);
      return t;
    };
    return {longs(m.global_index), longs(m.sequence), longs(m.document), longs(m.position), longs(m.label_index)};
  }

  // The strategy "auto" chose for the batch (the planner's choice; the strategy's own name otherwise).
  // Local: no communication.
  // Without a batch: the last forward's ("" before the first, for "auto").
  std::string chosen(const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& doc_counts) {
    if (strategy_ != "auto") return strategy_;
    Lengths lengths = cu_seqlens ? lengths_of(*cu_seqlens, doc_counts) : last_lengths_;
    if (lengths.empty()) return {};
    if (auto* selected = dynamic_cast<AutoSelected<sp::attention::CpuFlash<double>>*>(&meta_engine()))
      return selected->choice(make_batch(lengths)).name;
    return strategy_;
  }

  [[nodiscard]] int rank() const {
    return transport_->rank();
  }
  [[nodiscard]] int size() const {
    return transport_->size();
  }
  [[nodiscard]] const std::string& strategy() const {
    return strategy_;
  }
  [[nodiscard]] int threads() const {
    return threads_;
  }
  // The kernel the constructor was given ("auto", "cudnn", "flash" or "seqpar").
  [[nodiscard]] const std::string& kernel() const {
    return kernel_;
  }
  // The kernel of the last call: "seqpar" (CpuFlash on CPU tensors, CudaFlash on CUDA ones), "cudnn"
  // (CudnnSdpa) or "flash" (torch's FlashAttention ops); "" before the first call.
  [[nodiscard]] std::string kernel_ran() const {
#if SEQPAR_TORCH_CUDA
    if (last_cuda_) return cuda_->kernel_ran();
#endif
    return ran_cpu_ ? "seqpar" : "";
  }
  // The instruction set of the CPU kernels' micro-kernels (chosen at run time for this CPU; SEQPAR_CPU_ISA
  // forces one): the float and bfloat16 paths', float64 always runs the portable one.
  [[nodiscard]] std::string cpu_isa() const {
    return sp::attention::to_string(sp::attention::resolve_cpu_isa(sp::attention::CpuIsa::kAuto, "seqpar.torch"));
  }
  // The same for bfloat16 tensors, whose kernels take AVX512-BF16's bf16 dot products where the CPU has them.
  [[nodiscard]] std::string cpu_isa_bf16() const {
    return sp::attention::to_string(sp::attention::resolve_cpu_isa(sp::attention::CpuIsa::kAuto, "seqpar.torch",
                                                                   sp::attention::cpu_features(), true));
  }

 private:
  // The kernel names the layer takes: "cudnn" where the extension was built with cuDNN (SEQPAR_TORCH_CUDNN),
  // "flash" where it has the CUDA path, "auto" and "seqpar" always; the others refused by name, saying what
  // this build lacks (issue 38).
  static void check_kernel(const std::string& kernel) {
    constexpr std::string_view where = "seqpar.torch.DistributedAttention";
    if (kernel == "auto" || kernel == "seqpar") return;
    if (kernel == "cudnn") {
      if (SEQPAR_TORCH_CUDNN) return;
      sp::detail::throw_invalid(
          where, "kernel", "'cudnn'",
          SEQPAR_TORCH_CUDA
              ? "is not in this build: the extension was built without cuDNN (python/setup.py links "
                "attention::CudnnSdpa where it finds cuDNN, e.g. the nvidia-cudnn wheel of a CUDA torch, "
                "and cudnn-frontend's headers: CUDNN_FRONTEND_ROOT or build/cudnn_frontend)"
              : "is not in this build: cuDNN's SDPA needs the extension's CUDA path (SEQPAR_TORCH_CUDA=1) "
                "and cuDNN; this build runs CPU tensors only, whose kernel is 'seqpar' (or 'auto')");
    }
    if (kernel == "flash") {
      if (SEQPAR_TORCH_CUDA) return;
      sp::detail::throw_invalid(where, "kernel", "'flash'",
                                "needs the extension's CUDA path (built with SEQPAR_TORCH_CUDA=1): this build runs CPU "
                                "tensors only, whose kernel is 'seqpar' (or 'auto')");
    }
    sp::detail::throw_invalid(where, "kernel", "'" + kernel + "'",
                              "is not a kernel (one of: auto, flash, cudnn, seqpar)");
  }
  // CPU tensors run CpuFlash: a layer made with kernel="flash" refuses them by name.
  void require_cpu_kernel() {
    if (kernel_ != "auto" && kernel_ != "seqpar")
      sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "kernel", "'" + kernel_ + "'",
                                "runs CUDA tensors only; on CPU tensors the kernel is 'seqpar' (make the layer with "
                                "kernel='auto' or 'seqpar')");
    ran_cpu_ = true;
#if SEQPAR_TORCH_CUDA
    last_cuda_ = false;
#endif
  }

  template <class T>
  using Engine = sp::runtime::AttentionEngine<sp::attention::CpuFlash<T>>;
  // One engine per softmax scale a call used (0: 1 / sqrt(head_dim)); a model has one or two.
  template <class T>
  using Engines = std::map<double, std::unique_ptr<Engine<T>>>;

  // Runs `call`, rethrowing its refusals in the op's terms (tensor shapes, not the C++ views' fields), and
  // a refusal of q's rows with the rows this rank holds of the batch (lengths of another batch, or rows
  // not taken with token_indices, are the usual cause).
  //
  // A refusal of the binding's own checks (dtype, strides, head sizes, sinks, lengths, window, scale: any
  // exception before the engine's call) is this rank's outcome of the call's agreement: refuse() sends it
  // to every peer, whose engine call then raises "rank R refused its arguments ..." at once instead of
  // waiting for this rank until the timeout. The engine's own refusals went through its agreement already.
  template <class F>
  std::vector<at::Tensor> in_torch_terms(const at::Tensor& q, const at::Tensor& cu_seqlens,
                                         const std::optional<at::Tensor>& doc_counts, F&& call) {
    in_engine_ = false;
    cuda_call_ = q.is_cuda();
    try {
      return call();
    } catch (const sp::Error& e) {
      // A peer's refusal relayed by the agreement (or a transport failure): the peer's message names the
      // C++ views' fields when its engine refused; in the op's terms here too. One before the engine's call
      // (making the CUDA path's transport) is this rank's refusal, sent to its peers as the others are.
      const std::string what = torch_terms(e.detail());
      if (!reached_engine()) refuse_peers(what, cuda_call_);
      throw sp::Error(e.code(), what);
    } catch (const std::invalid_argument& e) {
      std::string what = torch_terms(e.what());
      if (what.find("q.shape[0] = ") != std::string::npos) {
        std::int64_t rows = -1, total = -1;
        try {
          const sp::DocumentBatch batch = make_batch(lengths_of(cu_seqlens, doc_counts));
          rows = meta_engine().local_tokens(batch);
          total = batch.total_tokens();
        } catch (const std::exception&) {
        }
        if (rows >= 0)
          what += " (this rank holds " + std::to_string(rows) + " of the batch's " + std::to_string(total) +
                  " tokens under strategy '" + strategy_ +
                  "': q, k, v must be the rows token_indices() gives for "
                  "the same lengths; q.shape[0] = " +
                  std::to_string(q.size(0)) +
                  " suggests rows of another batch, or lengths that do not describe these rows)";
      }
      if (!reached_engine()) refuse_peers(what, cuda_call_);
      throw std::invalid_argument(what);
    } catch (const std::exception& e) {
      if (!reached_engine()) refuse_peers(e.what(), cuda_call_);
      throw;
    }
  }

  // Whether the failed call reached its engine, whose agreement reported this rank's refusal already.
  [[nodiscard]] bool reached_engine() const {
#if SEQPAR_TORCH_CUDA
    if (cuda_call_) return cuda_->in_engine();
#endif
    return in_engine_;
  }
  // This rank's refusal to its peers, over the transport their engines agree on: the CUDA path's own NCCL
  // transport for CUDA tensors, the group's host transport for CPU ones.
  void refuse_peers(const std::string& why, bool cuda) {
#if SEQPAR_TORCH_CUDA
    if (cuda) {
      cuda_->refuse(why);
      return;
    }
#else
    (void)cuda;
#endif
    refuse(why);
  }

 public:
  // Which layer this is, compared in every call's agreement (seqpar/torch.py numbers the layers made on a
  // process group: their constructor is collective, so every rank numbers them alike): two layers called
  // in different orders on two ranks are then a RuntimeError naming the layer on every rank. Every engine
  // of the layer (one per dtype and scale) carries it: the element type tells those apart.
  void set_layer(std::int64_t layer) {
    layer_ = static_cast<std::uint64_t>(layer);
    for (auto& [scale, e] : doubles_) e->set_layer(layer_);
    for (auto& [scale, e] : floats_) e->set_layer(layer_);
    for (auto& [scale, e] : bf16s_) e->set_layer(layer_);
#if SEQPAR_TORCH_CUDA
    cuda_->set_layer(layer_);
#endif
  }

  // This rank refuses the call its peers are making (`why`: the exception it raises), as its outcome of
  // the call's agreement (runtime/agreement.hpp): the peers raise seqpar::Error (kPeerFailed) naming this
  // rank and `why` at once. For the checks seqpar/torch.py makes before the op. Returns once the peers
  // have it (a peer that is gone too: the transport's timeout, whose error is dropped for `why`).
  //
  // cuda: the call was on CUDA tensors, whose peers agree over the CUDA path's transport (a build without
  // that path has none: its peers, refusing CUDA tensors too, agree on the host transport).
  void refuse_from_python(const std::string& why, bool cuda) {
    refuse_peers(why, cuda);
  }

  void refuse(const std::string& why) {
    refuse_over(*transport_, why);
  }

 private:
  static void check_scale(double scale) {
    if (!(std::isfinite(scale) && scale >= 0.0))
      sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "softmax_scale", scale,
                                "must be finite and > 0 (None: 1 / sqrt(head_dim))");
  }

  static sp::AttentionMask mask_of(std::int64_t window) {
    const sp::AttentionMask mask{window};
    mask.validate("seqpar.torch.DistributedAttention", "window");
    return mask;
  }
  static sp::MaskMix mix_of(const std::vector<std::pair<std::int64_t, std::int64_t>>& pairs) {
    std::vector<sp::MaskMix::Part> parts;
    for (const auto& [window, layers] : pairs) parts.push_back({sp::AttentionMask{window}, layers});
    sp::MaskMix mix(std::move(parts));
    mix.validate("seqpar.torch.DistributedAttention", "mask_mix");
    return mix;
  }

  sp::runtime::AttentionEngine<sp::attention::CpuFlash<double>>& meta_engine() {
    return engine_for<double>(doubles_);  // placements do not depend on the scale
  }

  template <class T>
  Engine<T>& engine_for(Engines<T>& engines, double scale = 0.0) {
    std::unique_ptr<Engine<T>>& slot = engines[scale];
    if (!slot) {
      sp::AttentionShape shape = shape_;
      shape.softmax_scale = scale;
      slot =
          make_engine<sp::attention::CpuFlash<T>>(strategy_, *transport_, shape, ranks_per_node_, masks_,
                                                  sp::attention::CpuFlash<T>({.threads = threads_}), capacity_factor_);
      if (layer_ != kUnnamed) slot->set_layer(layer_);
    }
    return *slot;
  }

  // The call's checks and views (op_call.hpp, shared with the CUDA path), then the engine's call with the GIL
  // released: peers may be other threads of this process (tests).
  template <class T>
  std::vector<at::Tensor> forward_as(Engines<T>& engines, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const Lengths& lengths, const std::optional<at::Tensor>& sinks,
                                     sp::AttentionMask mask, double scale) {
    using Accum = typename sp::attention::CpuFlash<T>::accum_type;
    const ForwardCall<T, Accum> call(shape_, q, k, v, lengths, at::kCPU, [&] {
      return sinks_tensor(sinks, shape_, c10::CppTypeToScalarType<Accum>::value, q);
    });
    auto& e = engine_for<T>(engines, scale);
    in_engine_ = true;  // from here the engine's agreement reports this rank's refusals
    {
      pybind11::gil_scoped_release release;
      call.run(e, mask);
    }
    return call.outputs();
  }

  template <class T>
  std::vector<at::Tensor> backward_as(Engines<T>& engines, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                      const at::Tensor& dout, const Lengths& lengths,
                                      const std::optional<at::Tensor>& sinks, sp::AttentionMask mask, double scale) {
    using Accum = typename sp::attention::CpuFlash<T>::accum_type;
    const BackwardCall<T, Accum> call(shape_, q, k, v, o, lse, dout, lengths, at::kCPU, [&] {
      return sinks_tensor(sinks, shape_, c10::CppTypeToScalarType<Accum>::value, q);
    });
    auto& e = engine_for<T>(engines, scale);
    in_engine_ = true;
    {
      pybind11::gil_scoped_release release;
      call.run(e, mask);
    }
    return call.outputs();
  }

  std::string strategy_;
  sp::AttentionShape shape_;
  int ranks_per_node_;
  sp::MaskMix masks_;
  int threads_ = 1;               // the CPU kernels' threads on this rank (torch.get_num_threads() unless given)
  double capacity_factor_ = 0.0;  // whole-doc's and hybrid's token capacity (0: the partitioner's default)
  std::string kernel_ = "auto";   // the constructor's kernel (check_kernel)
  bool ran_cpu_ = false;          // a CPU call ran (kernel_ran)
  Lengths last_lengths_;          // the last forward's batch ("auto" only)
  bool in_engine_ = false;        // the call reached the engine (its agreement reports this rank's refusals)
  bool cuda_call_ = false;        // the call is on CUDA tensors (its peers agree over the CUDA path's transport)
  static constexpr std::uint64_t kUnnamed = ~std::uint64_t{0};
  std::uint64_t layer_ = kUnnamed;  // set_layer's number (unnamed: each engine's order on the transport)
  std::unique_ptr<sp::backend::c10d::Transport> transport_;  // engines hold a reference: a stable address
  Engines<double> doubles_;
  Engines<float> floats_;
  Engines<Bf16> bf16s_;
#if SEQPAR_TORCH_CUDA
  std::unique_ptr<CudaAttention> cuda_;  // CUDA tensors: TorchFlash or CudaFlash over the group's NCCL backend
  bool last_cuda_ = false;               // the last call ran CUDA tensors (kernel_ran)
#endif
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "seqpar's DistributedAttention on a torch.distributed process group (see seqpar.torch)";
  pybind11::class_<Attention>(m, "Attention")
      .def(pybind11::init<std::string, int, int, int, const c10::intrusive_ptr<::c10d::ProcessGroup>&, double, int, int,
                          const std::vector<std::pair<std::int64_t, std::int64_t>>&, int, double, std::string>(),
           pybind11::arg("strategy"), pybind11::arg("heads_q"), pybind11::arg("heads_kv"), pybind11::arg("head_dim"),
           pybind11::arg("group"), pybind11::arg("timeout_s"), pybind11::arg("ranks_per_node"),
           pybind11::arg("head_dim_v"),
           pybind11::arg("mask_mix") = std::vector<std::pair<std::int64_t, std::int64_t>>{},
           pybind11::arg("threads") = 1, pybind11::arg("capacity_factor") = 0.0, pybind11::arg("kernel") = "auto")
      .def("forward", &Attention::forward, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
           pybind11::arg("cu_seqlens"), pybind11::arg("doc_counts") = std::nullopt,
           pybind11::arg("sinks") = std::nullopt, pybind11::arg("window") = 0, pybind11::arg("scale") = 0.0)
      .def("backward", &Attention::backward, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
           pybind11::arg("o"), pybind11::arg("lse"), pybind11::arg("dout"), pybind11::arg("cu_seqlens"),
           pybind11::arg("doc_counts") = std::nullopt, pybind11::arg("sinks") = std::nullopt,
           pybind11::arg("window") = 0, pybind11::arg("scale") = 0.0)
      .def("refuse", &Attention::refuse_from_python, pybind11::arg("why"), pybind11::arg("cuda") = false)
      .def("set_layer", &Attention::set_layer, pybind11::arg("layer"))
      .def("token_meta", &Attention::token_meta, pybind11::arg("cu_seqlens"),
           pybind11::arg("doc_counts") = std::nullopt)
      .def("chosen", &Attention::chosen, pybind11::arg("cu_seqlens") = std::nullopt,
           pybind11::arg("doc_counts") = std::nullopt)
      .def_property_readonly("rank", &Attention::rank)
      .def_property_readonly("size", &Attention::size)
      .def_property_readonly("strategy", &Attention::strategy)
      .def_property_readonly("threads", &Attention::threads)
      .def_property_readonly("cpu_isa", &Attention::cpu_isa)
      .def_property_readonly("cpu_isa_bf16", &Attention::cpu_isa_bf16)
      .def_property_readonly("kernel", &Attention::kernel)
      .def_property_readonly("kernel_ran", &Attention::kernel_ran);
  std::vector<std::string> names(std::begin(kStrategies), std::end(kStrategies));
  m.attr("STRATEGIES") = names;
  // seqpar-plan's names (plan::standard_candidates): the op's strategies are the same list, plus "auto".
  m.def("plan_names", [] {
    std::vector<std::string> out;
    for (const auto& c : sp::plan::standard_candidates()) out.push_back(c.name);
    return out;
  });
  // Whether CUDA tensors run (CudaFlash over the group's NCCL backend): built with SEQPAR_TORCH_CUDA=1.
  m.attr("CUDA") = static_cast<bool>(SEQPAR_TORCH_CUDA);
  // Whether kernel="cudnn" (attention::CudnnSdpa) is in this build: CUDA with cuDNN and cudnn-frontend found.
  m.attr("CUDNN") = static_cast<bool>(SEQPAR_TORCH_CUDNN);
}
