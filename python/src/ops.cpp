// SPDX-License-Identifier: Apache-2.0
// seqpar._C: seqpar's DistributedAttention on a torch.distributed process group, for the torch op
// in seqpar/torch.py. Tensors are used in place (views of their storage): the binding copies none of
// q, k, v, o, lse or the gradients. Bad arguments raise std::invalid_argument (Python ValueError)
// naming the argument; transport failures raise seqpar::Error (Python RuntimeError).
#include <torch/extension.h>

#include <seqpar/backend/c10d/transport.hpp>
#include <seqpar/plan/selected_attention.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/token_meta.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace sp = seqpar;
using Lengths = std::vector<std::vector<std::int64_t>>;
// torch's bfloat16 (c10::BFloat16) and seqpar's (attention::bf16) are both the upper 16 bits of an
// IEEE binary32: a bf16 tensor's storage is viewed as seqpar's type, no conversion.
using Bf16 = sp::attention::bf16;
static_assert(sizeof(Bf16) == sizeof(c10::BFloat16) && alignof(Bf16) <= alignof(c10::BFloat16));

// The strategies by the names `seqpar-plan` prints (plan/candidates.hpp), with the arguments its
// candidates start from, and "auto": the planner's choice per batch.
constexpr const char* kStrategies[] = {"ulysses",
                                       "ring",
                                       "zigzag-ring",
                                       "zigzag-ring-aware",
                                       "per-doc-aware",
                                       "allgather",
                                       "whole-doc",
                                       "hybrid-aware",
                                       "hybrid-allgather-aware",
                                       "hierarchical",
                                       "basp",
                                       "basp-hybrid-hierarchical",
                                       "auto"};

template <class S, class Kernel>
std::unique_ptr<sp::runtime::AttentionEngine<Kernel>> engine(sp::backend::c10d::Transport& t,
                                                             const sp::AttentionShape& shape,
                                                             typename S::Arguments args, int ranks_per_node) {
  args.ranks_per_node = ranks_per_node;
  return std::make_unique<sp::DistributedAttention<S, Kernel>>(t, shape, args);
}

template <class Kernel>
std::unique_ptr<sp::runtime::AttentionEngine<Kernel>> make_engine(const std::string& name,
                                                                  sp::backend::c10d::Transport& t,
                                                                  const sp::AttentionShape& shape, int rpn) {
  using namespace sp::partition;
  using sp::Strategy, sp::comm::AllGather, sp::comm::AllToAll, sp::comm::Ring;
  using Hier = sp::comm::Hierarchical<AllToAll, Ring>;
  if (name == "ulysses") return engine<Strategy<Uniform, AllToAll>, Kernel>(t, shape, {}, rpn);
  if (name == "ring") return engine<Strategy<Uniform, Ring>, Kernel>(t, shape, {}, rpn);
  if (name == "zigzag-ring") return engine<Strategy<Zigzag, Ring>, Kernel>(t, shape, {}, rpn);
  if (name == "zigzag-ring-aware") {
    Strategy<Zigzag, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<Zigzag, Ring>, Kernel>(t, shape, a, rpn);
  }
  if (name == "per-doc-aware") {
    Strategy<PerDoc, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<PerDoc, Ring>, Kernel>(t, shape, a, rpn);
  }
  if (name == "allgather") return engine<Strategy<Zigzag, AllGather>, Kernel>(t, shape, {}, rpn);
  if (name == "whole-doc") {
    Strategy<WholeDoc, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<WholeDoc, Ring>, Kernel>(t, shape, a, rpn);
  }
  if (name == "hybrid-aware") {
    Strategy<Hybrid, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<Hybrid, Ring>, Kernel>(t, shape, a, rpn);
  }
  if (name == "hybrid-allgather-aware") {
    Strategy<Hybrid, AllGather>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<Hybrid, AllGather>, Kernel>(t, shape, a, rpn);
  }
  if (name == "hierarchical") {
    Strategy<Zigzag, Hier>::Arguments a;
    a.comm.outer.sharding_aware = true;
    return engine<Strategy<Zigzag, Hier>, Kernel>(t, shape, a, rpn);
  }
  if (name == "basp") return engine<Strategy<BatchAware<Uniform>, AllToAll>, Kernel>(t, shape, {}, rpn);
  if (name == "basp-hybrid-hierarchical") {
    Strategy<BatchAware<Hybrid>, Hier>::Arguments a;
    a.comm.outer.sharding_aware = true;
    return engine<Strategy<BatchAware<Hybrid>, Hier>, Kernel>(t, shape, a, rpn);
  }
  if (name == "auto") {
    // plan::SelectedAttention: every batch shape simulated on each candidate (an H100 SXM profile:
    // the choice is the GPU's, whatever runs here) and the fastest run; every rank chooses the same
    // without talking. The candidates: one of each family seqpar-plan compares.
    using Selected =
        sp::plan::SelectedAttention<Kernel, Strategy<Uniform, AllToAll>, Strategy<Zigzag, Ring>, Strategy<Hybrid, Ring>,
                                    Strategy<Zigzag, Hier>, Strategy<BatchAware<Uniform>, AllToAll>>;
    typename Selected::Arguments a;
    a.names = {"ulysses", "zigzag-ring-aware", "hybrid-aware", "hierarchical", "basp"};
    std::get<1>(a.strategies).comm.sharding_aware = true;
    std::get<2>(a.strategies).comm.sharding_aware = true;
    std::get<3>(a.strategies).comm.outer.sharding_aware = true;
    a.simulation.hardware = sp::replay::profiles::h100_sxm();
    a.ranks_per_node = rpn;
    return std::make_unique<Selected>(t, shape, a);
  }
  std::string known;
  for (const char* s : kStrategies) known += std::string(known.empty() ? "" : ", ") + s;
  sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "strategy", "'" + name + "'",
                            "is not a strategy (one of: " + known + ")");
}

// A (tokens, heads, head_dim) view of `t`, which must be a CPU tensor of `dtype` whose head_dim axis
// is contiguous (token and head strides are the tensor's own: no copy).
template <class T>
sp::ThdView<T> thd(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  sp::detail::require(t.defined(), where, name, "None", "must be a tensor");
  sp::detail::require(t.device().is_cpu(), where, std::string(name) + ".device", t.device().str(),
                      "must be cpu (the CPU kernels run here)");
  sp::detail::require(t.scalar_type() == dtype, where, std::string(name) + ".dtype", c10::toString(t.scalar_type()),
                      std::string("must be ") + c10::toString(dtype) + " like q");
  sp::detail::require(t.dim() == 3, where, std::string(name) + ".dim()", t.dim(),
                      "must be 3: (tokens, heads, head_dim)");
  sp::detail::require(t.size(2) <= 1 || t.stride(2) == 1, where, std::string(name) + ".stride(2)", t.stride(2),
                      "must be 1 (head_dim contiguous)");
  return {static_cast<T*>(t.data_ptr()), t.size(0),   static_cast<int>(t.size(1)),
          static_cast<int>(t.size(2)),   t.stride(0), t.stride(1)};
}

template <class T>
sp::LseView<T> lse_view(const at::Tensor& t) {
  return sp::LseView<T>::dense(static_cast<T*>(t.data_ptr()), static_cast<int>(t.size(0)), t.size(1));
}

sp::DocumentBatch make_batch(const Lengths& lengths) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  sp::detail::require(!lengths.empty(), where, "lengths", "[]", "must hold at least one sequence");
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    sp::detail::require(!lengths[s].empty(), where, "lengths[" + std::to_string(s) + "]", "[]",
                        "must hold at least one document");
    for (std::size_t d = 0; d < lengths[s].size(); ++d)
      sp::detail::require(lengths[s][d] >= 1, where, "lengths[" + std::to_string(s) + "][" + std::to_string(d) + "]",
                          lengths[s][d], "must be >= 1");
  }
  return sp::DocumentBatch(lengths);
}

// One torch-facing attention layer: a transport on the group and one engine per dtype (made on
// first use; each keeps its own plan cache).
class Attention {
 public:
  Attention(std::string strategy, int heads_q, int heads_kv, int head_dim,
            const c10::intrusive_ptr<::c10d::ProcessGroup>& group, double timeout_s, int ranks_per_node)
      : strategy_(std::move(strategy)), shape_{heads_q, heads_kv, head_dim}, ranks_per_node_(ranks_per_node) {
    constexpr std::string_view where = "seqpar.torch.DistributedAttention";
    sp::detail::require(heads_q >= 1, where, "heads_q", heads_q, "must be >= 1");
    sp::detail::require(heads_kv >= 1 && heads_q % heads_kv == 0, where, "heads_kv", heads_kv,
                        "must be >= 1 and divide heads_q = " + std::to_string(heads_q));
    sp::detail::require(head_dim >= 1, where, "head_dim", head_dim, "must be >= 1");
    sp::detail::require(timeout_s > 0, where, "timeout_s", timeout_s, "must be > 0");
    sp::backend::c10d::Transport::Options options;
    options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
    transport_ = std::make_unique<sp::backend::c10d::Transport>(group, options);
    (void)meta_engine();  // an unknown strategy fails here, in the constructor
  }

  std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const Lengths& lengths) {
    switch (q.scalar_type()) {
      case at::kDouble:
        return forward_as<double>(doubles_, q, k, v, lengths);
      case at::kFloat:
        return forward_as<float>(floats_, q, k, v, lengths);
      case at::kBFloat16:  // CpuFlash<bf16> on the tensors' own storage: fp32 accumulation, fp32 lse
        return forward_as<Bf16>(bf16s_, q, k, v, lengths);
      default:
        break;
    }
    sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "q.dtype", c10::toString(q.scalar_type()),
                              "must be float64, float32 or bfloat16");
  }

  std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                                   const at::Tensor& lse, const at::Tensor& dout, const Lengths& lengths) {
    switch (q.scalar_type()) {
      case at::kDouble:
        return backward_as<double>(doubles_, q, k, v, o, lse, dout, lengths);
      case at::kFloat:
        return backward_as<float>(floats_, q, k, v, o, lse, dout, lengths);
      case at::kBFloat16:
        return backward_as<Bf16>(bf16s_, q, k, v, o, lse, dout, lengths);
      default:
        break;
    }
    sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "q.dtype", c10::toString(q.scalar_type()),
                              "must be float64, float32 or bfloat16");
  }

  // This rank's rows: for each, its global token, sequence, document, position in the document, and
  // the global token of its next-token label (-1 for a document's last token). Local: no communication.
  std::vector<at::Tensor> token_meta(const Lengths& lengths) {
    const sp::DocumentBatch batch = make_batch(lengths);
    auto& e = meta_engine();
    const sp::train::TokenMeta m = sp::train::token_meta(batch, e.plan(batch), transport_->rank());
    const auto longs = [](const auto& v) {
      at::Tensor t = at::empty({static_cast<std::int64_t>(v.size())}, at::kLong);
      for (std::size_t i = 0; i < v.size(); ++i) t.data_ptr<std::int64_t>()[i] = static_cast<std::int64_t>(v[i]);
      return t;
    };
    return {longs(m.global_index), longs(m.sequence), longs(m.document), longs(m.position), longs(m.label_index)};
  }

  [[nodiscard]] int rank() const { return transport_->rank(); }
  [[nodiscard]] int size() const { return transport_->size(); }
  [[nodiscard]] const std::string& strategy() const { return strategy_; }

 private:
  template <class T>
  using Engine = sp::runtime::AttentionEngine<sp::attention::CpuFlash<T>>;

  sp::runtime::AttentionEngine<sp::attention::CpuFlash<double>>& meta_engine() { return engine_for<double>(doubles_); }

  template <class T>
  Engine<T>& engine_for(std::unique_ptr<Engine<T>>& slot) {
    if (!slot) slot = make_engine<sp::attention::CpuFlash<T>>(strategy_, *transport_, shape_, ranks_per_node_);
    return *slot;
  }

  template <class T>
  std::vector<at::Tensor> forward_as(std::unique_ptr<Engine<T>>& slot, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const Lengths& lengths) {
    using Accum = typename sp::attention::CpuFlash<T>::accum_type;
    const at::ScalarType dtype = q.scalar_type();
    const sp::DocumentBatch batch = make_batch(lengths);
    const auto qv = thd<const T>(q, "q", dtype), kv = thd<const T>(k, "k", dtype), vv = thd<const T>(v, "v", dtype);
    at::Tensor o = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(c10::CppTypeToScalarType<Accum>::value));
    auto& e = engine_for<T>(slot);
    {
      pybind11::gil_scoped_release release;  // peers may be other threads of this process (tests)
      e.forward(batch, qv, kv, vv, thd<T>(o, "o", dtype), lse_view<Accum>(lse));
    }
    return {o, lse};
  }

  template <class T>
  std::vector<at::Tensor> backward_as(std::unique_ptr<Engine<T>>& slot, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                      const at::Tensor& dout, const Lengths& lengths) {
    using Accum = typename sp::attention::CpuFlash<T>::accum_type;
    const at::ScalarType dtype = q.scalar_type();
    const sp::DocumentBatch batch = make_batch(lengths);
    const auto qv = thd<const T>(q, "q", dtype), kv = thd<const T>(k, "k", dtype), vv = thd<const T>(v, "v", dtype),
               ov = thd<const T>(o, "o", dtype), dov = thd<const T>(dout, "dout", dtype);
    constexpr std::string_view where = "seqpar.torch.DistributedAttention";
    sp::detail::require(lse.scalar_type() == c10::CppTypeToScalarType<Accum>::value && lse.dim() == 2 &&
                            lse.is_contiguous() && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                        where, "lse", lse.sizes(), "must be the forward's lse: contiguous (heads_q, local tokens)");
    at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous),
               dk = at::empty_like(k, at::MemoryFormat::Contiguous),
               dv = at::empty_like(v, at::MemoryFormat::Contiguous);
    auto& e = engine_for<T>(slot);
    {
      pybind11::gil_scoped_release release;
      e.backward(batch, qv, kv, vv, ov, lse_view<const Accum>(lse), dov, thd<T>(dq, "dq", dtype),
                 thd<T>(dk, "dk", dtype), thd<T>(dv, "dv", dtype));
    }
    return {dq, dk, dv};
  }

  std::string strategy_;
  sp::AttentionShape shape_;
  int ranks_per_node_;
  std::unique_ptr<sp::backend::c10d::Transport> transport_;  // engines hold a reference: a stable address
  std::unique_ptr<Engine<double>> doubles_;
  std::unique_ptr<Engine<float>> floats_;
  std::unique_ptr<Engine<Bf16>> bf16s_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "seqpar's DistributedAttention on a torch.distributed process group (see seqpar.torch)";
  pybind11::class_<Attention>(m, "Attention")
      .def(pybind11::init<std::string, int, int, int, const c10::intrusive_ptr<::c10d::ProcessGroup>&, double, int>(),
           pybind11::arg("strategy"), pybind11::arg("heads_q"), pybind11::arg("heads_kv"), pybind11::arg("head_dim"),
           pybind11::arg("group"), pybind11::arg("timeout_s"), pybind11::arg("ranks_per_node"))
      .def("forward", &Attention::forward)
      .def("backward", &Attention::backward)
      .def("token_meta", &Attention::token_meta)
      .def_property_readonly("rank", &Attention::rank)
      .def_property_readonly("size", &Attention::size)
      .def_property_readonly("strategy", &Attention::strategy);
  std::vector<std::string> names(std::begin(kStrategies), std::end(kStrategies));
  m.attr("STRATEGIES") = names;
}
