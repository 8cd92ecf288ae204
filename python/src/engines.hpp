// SPDX-License-Identifier: Apache-2.0
// What the torch op's CPU and CUDA translation units share (python/src/ops.cpp, cuda_attention.cpp): the
// strategies by name, an engine made from a name, views of tensors, the batch from lengths.
#pragma once

#include <torch/extension.h>

#include <seqpar/plan/selected_attention.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/seqpar.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace seqpar_torch {

namespace sp = seqpar;
using Lengths = std::vector<std::vector<std::int64_t>>;

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

/// What "auto" runs: plan::SelectedAttention over one strategy of each family seqpar-plan compares (the
/// layer asks it which one a batch got).
template <class Kernel>
using AutoSelected = sp::plan::SelectedAttention<
    Kernel, sp::Strategy<sp::partition::Uniform, sp::comm::AllToAll>,
    sp::Strategy<sp::partition::Zigzag, sp::comm::Ring>, sp::Strategy<sp::partition::Hybrid, sp::comm::Ring>,
    sp::Strategy<sp::partition::Zigzag, sp::comm::Hierarchical<sp::comm::AllToAll, sp::comm::Ring>>,
    sp::Strategy<sp::partition::BatchAware<sp::partition::Uniform>, sp::comm::AllToAll>>;

template <class S, class Kernel, class Tr>
std::unique_ptr<sp::runtime::AttentionEngine<Kernel>> engine(Tr& t, const sp::AttentionShape& shape,
                                                             typename S::Arguments args, int ranks_per_node,
                                                             const sp::MaskMix& masks, Kernel kernel) {
  args.ranks_per_node = ranks_per_node;
  args.masks = masks;  // the model's mask mix: what the one placement of each batch is balanced for
  return std::make_unique<sp::DistributedAttention<S, Kernel>>(t, shape, args, std::move(kernel));
}

/// The strategies whose placement keeps documents whole within a per-rank token capacity
/// (capacity_factor x tokens / ranks): WholeDoc and Hybrid.
inline bool has_capacity(const std::string& name) {
  return name == "whole-doc" || name == "hybrid-aware" || name == "hybrid-allgather-aware" ||
         name == "basp-hybrid-hierarchical";
}

/// The named strategy's engine running `kernel`; `masks`: the model's mask mix (the placement serves every
/// layer's mask); `capacity_factor` (0: the partitioner's default, 1.25) for the strategies with a token
/// capacity. Only the named branch runs, so each one may take the kernel.
template <class Kernel, class Tr>
std::unique_ptr<sp::runtime::AttentionEngine<Kernel>> make_engine(const std::string& name, Tr& t,
                                                                  const sp::AttentionShape& shape, int rpn,
                                                                  const sp::MaskMix& masks, Kernel kernel = Kernel(),
                                                                  double capacity_factor = 0.0) {
  using namespace sp::partition;
  using sp::Strategy, sp::comm::AllGather, sp::comm::AllToAll, sp::comm::Ring;
  using Hier = sp::comm::Hierarchical<AllToAll, Ring>;
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  if (capacity_factor != 0.0 && !has_capacity(name))
    sp::detail::throw_invalid(where, "capacity_factor", capacity_factor,
                              "applies to whole-doc and the hybrid strategies (their per-rank token capacity), not "
                              "strategy '" +
                                  name + "'");
  if (capacity_factor != 0.0 && !(std::isfinite(capacity_factor) && capacity_factor >= 1.0))
    sp::detail::throw_invalid(where, "capacity_factor", capacity_factor,
                              "must be finite and >= 1 (a rank holds up to capacity_factor x tokens / ranks)");
  const auto capacity = [&](double& field) {
    if (capacity_factor != 0.0) field = capacity_factor;
  };
  if (name == "ulysses")
    return engine<Strategy<Uniform, AllToAll>, Kernel>(t, shape, {}, rpn, masks, std::move(kernel));
  if (name == "ring") return engine<Strategy<Uniform, Ring>, Kernel>(t, shape, {}, rpn, masks, std::move(kernel));
  if (name == "zigzag-ring") return engine<Strategy<Zigzag, Ring>, Kernel>(t, shape, {}, rpn, masks, std::move(kernel));
  if (name == "zigzag-ring-aware") {
    Strategy<Zigzag, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<Zigzag, Ring>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "per-doc-aware") {
    Strategy<PerDoc, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    return engine<Strategy<PerDoc, Ring>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "allgather")
    return engine<Strategy<Zigzag, AllGather>, Kernel>(t, shape, {}, rpn, masks, std::move(kernel));
  if (name == "whole-doc") {
    Strategy<WholeDoc, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    capacity(a.partition.capacity_factor);
    return engine<Strategy<WholeDoc, Ring>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "hybrid-aware") {
    Strategy<Hybrid, Ring>::Arguments a;
    a.comm.sharding_aware = true;
    capacity(a.partition.capacity_factor);
    return engine<Strategy<Hybrid, Ring>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "hybrid-allgather-aware") {
    Strategy<Hybrid, AllGather>::Arguments a;
    a.comm.sharding_aware = true;
    capacity(a.partition.capacity_factor);
    return engine<Strategy<Hybrid, AllGather>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "hierarchical") {
    Strategy<Zigzag, Hier>::Arguments a;
    a.comm.outer.sharding_aware = true;
    return engine<Strategy<Zigzag, Hier>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "basp")
    return engine<Strategy<BatchAware<Uniform>, AllToAll>, Kernel>(t, shape, {}, rpn, masks, std::move(kernel));
  if (name == "basp-hybrid-hierarchical") {
    Strategy<BatchAware<Hybrid>, Hier>::Arguments a;
    a.comm.outer.sharding_aware = true;
    capacity(a.partition.inner.capacity_factor);
    return engine<Strategy<BatchAware<Hybrid>, Hier>, Kernel>(t, shape, a, rpn, masks, std::move(kernel));
  }
  if (name == "auto") {
    // plan::SelectedAttention: every batch shape simulated on each candidate (an H100 SXM profile:
    // the choice is the GPU's, whatever runs here) and the fastest run; every rank chooses the same
    // without talking. The candidates: one of each family seqpar-plan compares.
    using Selected = AutoSelected<Kernel>;
    typename Selected::Arguments a;
    a.names = {"ulysses", "zigzag-ring-aware", "hybrid-aware", "hierarchical", "basp"};
    std::get<1>(a.strategies).comm.sharding_aware = true;
    std::get<2>(a.strategies).comm.sharding_aware = true;
    std::get<3>(a.strategies).comm.outer.sharding_aware = true;
    a.simulation.hardware = sp::replay::profiles::h100_sxm();
    a.ranks_per_node = rpn;
    a.masks = masks;
    return std::make_unique<Selected>(t, shape, a, std::move(kernel));
  }
  std::string known;
  for (const char* s : kStrategies) known += std::string(known.empty() ? "" : ", ") + s;
  sp::detail::throw_invalid("seqpar.torch.DistributedAttention", "strategy", "'" + name + "'",
                            "is not a strategy (one of: " + known + ")");
}

// A (tokens, heads, head_dim) view of `t`, which must be a tensor of `dtype` on `device` whose head_dim
// axis is contiguous (token and head strides are the tensor's own: no copy). The checks below build
// their messages only when they refuse: they run on every call of the op.
template <class T>
sp::ThdView<T> thd(const at::Tensor& t, const char* name, at::ScalarType dtype, const c10::Device& device = at::kCPU) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  if (!t.defined()) sp::detail::throw_invalid(where, name, "None", "must be a tensor");
  if (t.device() != device)
    sp::detail::throw_invalid(where, std::string(name) + ".device", t.device().str(),
                              device.is_cpu() ? std::string("must be cpu (the CPU kernels run here)")
                                              : "must be " + device.str() + " like q");
  if (t.scalar_type() != dtype)
    sp::detail::throw_invalid(where, std::string(name) + ".dtype", c10::toString(t.scalar_type()),
                              std::string("must be ") + c10::toString(dtype) + " like q");
  if (t.dim() != 3)
    sp::detail::throw_invalid(where, std::string(name) + ".dim()", t.dim(), "must be 3: (tokens, heads, head_dim)");
  // No rows (a rank the placement gave no tokens): nothing is read, and autograd may hand such a rank an
  // expanded gradient of stride 0, which torch counts as contiguous: the view takes dense strides.
  if (t.numel() == 0)
    return {static_cast<T*>(t.data_ptr()), t.size(0), static_cast<int>(t.size(1)), static_cast<int>(t.size(2)),
            t.size(1) * t.size(2),         t.size(2)};
  if (t.size(2) > 1 && t.stride(2) != 1)
    sp::detail::throw_invalid(where, std::string(name) + ".stride(2)", t.stride(2), "must be 1 (head_dim contiguous)");
  return {static_cast<T*>(t.data_ptr()), t.size(0),   static_cast<int>(t.size(1)),
          static_cast<int>(t.size(2)),   t.stride(0), t.stride(1)};
}

// q and k must have head_dim values per head, v head_dim_v (the sizes the layer was made with).
inline void check_head_sizes(const sp::AttentionShape& shape, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  for (const auto& [name, t] : {std::pair{"q.shape[2]", &q}, std::pair{"k.shape[2]", &k}})
    if (t->size(2) != shape.qk_dim())
      sp::detail::throw_invalid(
          where, name, t->size(2),
          "must be head_dim = " + std::to_string(shape.qk_dim()) + ", the layer's query/key head size");
  if (v.size(2) != shape.v_dim())
    sp::detail::throw_invalid(
        where, "v.shape[2]", v.size(2),
        "must be head_dim_v = " + std::to_string(shape.v_dim()) + ", the layer's value head size");
}

// The sinks of a call, checked (none: an undefined tensor): a 1-d tensor of heads_q logits of `dtype` (the
// kernels' accumulation type) on q's device; made contiguous (heads_q values). Their values (NaN, +inf)
// are checked by the engine.
inline at::Tensor sinks_tensor(const std::optional<at::Tensor>& sinks, const sp::AttentionShape& shape,
                               at::ScalarType dtype, const at::Tensor& q) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  if (!sinks || !sinks->defined()) return {};
  const at::Tensor& s = *sinks;
  if (s.scalar_type() != dtype)
    sp::detail::throw_invalid(where, "sinks.dtype", c10::toString(s.scalar_type()),
                              std::string("must be ") + c10::toString(dtype) +
                                  " (the kernels' accumulation type for q.dtype " + c10::toString(q.scalar_type()) +
                                  ")");
  if (s.device() != q.device())
    sp::detail::throw_invalid(where, "sinks.device", s.device().str(), "must be " + q.device().str() + " like q");
  if (s.dim() != 1 || s.size(0) != shape.heads_q)
    sp::detail::throw_invalid(
        where, "sinks.shape", s.sizes(),
        "must be (heads_q,) = (" + std::to_string(shape.heads_q) + ",): one logit per query head");
  return s.contiguous();
}

template <class T>
std::span<T> span_of(const at::Tensor& t) {
  return {static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
}

template <class T>
sp::LseView<T> lse_view(const at::Tensor& t) {
  return sp::LseView<T>::dense(static_cast<T*>(t.data_ptr()), static_cast<int>(t.size(0)), t.size(1));
}

/// The batch's document lengths from FlashAttention's varlen form: `cu_seqlens`, the cumulative token
/// offsets of the documents of the whole packed batch (every rank's tokens: documents + 1 values, from 0,
/// increasing), and `doc_counts`, the documents of each packed sequence in order (none: one sequence).
/// Integer tensors on any device (read on the host: a CUDA tensor costs one copy). Refusals name the
/// argument and the value at fault.
inline Lengths lengths_of(const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& doc_counts) {
  constexpr std::string_view where = "seqpar.torch.varlen_attention";
  const auto ints = [&](const at::Tensor& t, const char* name) {
    if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()) || t.scalar_type() == at::kBool)
      sp::detail::throw_invalid(where, std::string(name) + ".dtype", c10::toString(t.scalar_type()),
                                "must be an integer type (int32 or int64, as FlashAttention's cu_seqlens)");
    if (t.dim() != 1) sp::detail::throw_invalid(where, std::string(name) + ".dim()", t.dim(), "must be 1");
    const at::Tensor h = t.to(at::kCPU, at::kLong).contiguous();
    const std::int64_t* p = h.data_ptr<std::int64_t>();
    return std::vector<std::int64_t>(p, p + h.numel());
  };
  const std::vector<std::int64_t> cu = ints(cu_seqlens, "cu_seqlens");
  if (cu.size() < 2)
    sp::detail::throw_invalid(where, "cu_seqlens.shape[0]", static_cast<std::int64_t>(cu.size()),
                              "must be >= 2 (documents + 1 cumulative offsets, from 0)");
  if (cu[0] != 0) sp::detail::throw_invalid(where, "cu_seqlens[0]", cu[0], "must be 0");
  std::vector<std::int64_t> docs(cu.size() - 1);
  for (std::size_t i = 0; i < docs.size(); ++i) {
    docs[i] = cu[i + 1] - cu[i];
    if (docs[i] < 1)
      sp::detail::throw_invalid(where, "cu_seqlens[" + std::to_string(i + 1) + "]", cu[i + 1],
                                "must exceed cu_seqlens[" + std::to_string(i) + "] = " + std::to_string(cu[i]) +
                                    " (every document holds at least one token)");
  }
  if (!doc_counts || !doc_counts->defined()) return {std::move(docs)};
  const std::vector<std::int64_t> counts = ints(*doc_counts, "doc_counts");
  Lengths out;
  std::size_t at = 0;
  for (std::size_t s = 0; s < counts.size(); ++s) {
    if (counts[s] < 1 || counts[s] > static_cast<std::int64_t>(docs.size() - at))
      sp::detail::throw_invalid(where, "doc_counts[" + std::to_string(s) + "]", counts[s],
                                "must be in [1, " + std::to_string(docs.size() - at) +
                                    "]: each sequence holds at least one of cu_seqlens' " +
                                    std::to_string(docs.size()) + " documents, in order");
    out.emplace_back(docs.begin() + static_cast<std::ptrdiff_t>(at),
                     docs.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(counts[s])));
    at += static_cast<std::size_t>(counts[s]);
  }
  if (at != docs.size())
    sp::detail::throw_invalid(where, "doc_counts", "sum " + std::to_string(at),
                              "must be " + std::to_string(docs.size()) + ", cu_seqlens' documents");
  return out;
}

/// A refusal of the engine, in the torch op's terms: the views' fields as the tensors' shapes (q.tokens
/// is q.shape[0]; lse is (heads_q, tokens)), the C++ entry point as the op's name.
inline std::string torch_terms(std::string what) {
  const auto replace_all = [&](const std::string& from, const std::string& to) {
    for (std::size_t at = what.find(from); at != std::string::npos; at = what.find(from, at + to.size()))
      what.replace(at, from.size(), to);
  };
  for (const char* t : {"q", "k", "v", "o", "dout", "dq", "dk", "dv"}) {
    replace_all(std::string(t) + ".tokens", std::string(t) + ".shape[0]");
    replace_all(std::string(t) + ".heads", std::string(t) + ".shape[1]");
    replace_all(std::string(t) + ".head_dim", std::string(t) + ".shape[2]");
  }
  replace_all("owned_ranges(batch)", "token_indices() of the same lengths");
  replace_all("lse.heads", "lse.shape[0]");
  replace_all("lse.tokens", "lse.shape[1]");
  replace_all("DistributedAttention::forward", "seqpar.torch.DistributedAttention (forward)");
  replace_all("DistributedAttention::backward", "seqpar.torch.DistributedAttention (backward)");
  return what;
}

inline sp::DocumentBatch make_batch(const Lengths& lengths) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  if (lengths.empty()) sp::detail::throw_invalid(where, "lengths", "[]", "must hold at least one sequence");
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    if (lengths[s].empty())
      sp::detail::throw_invalid(where, "lengths[" + std::to_string(s) + "]", "[]", "must hold at least one document");
    for (std::size_t d = 0; d < lengths[s].size(); ++d)
      if (lengths[s][d] < 1)
        sp::detail::throw_invalid(where, "lengths[" + std::to_string(s) + "][" + std::to_string(d) + "]", lengths[s][d],
                                  "must be >= 1");
  }
  return sp::DocumentBatch(lengths);
}

}  // namespace seqpar_torch
