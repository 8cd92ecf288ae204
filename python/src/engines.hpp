// SPDX-License-Identifier: Apache-2.0
// What the torch op's CPU and CUDA translation units share (python/src/ops.cpp, cuda_attention.cpp): the
// strategies by name, an engine made from a name, views of tensors, the batch from lengths.
#pragma once

#include <torch/extension.h>

#include <seqpar/plan/named_strategies.hpp>
#include <seqpar/plan/selected_attention.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace seqpar_torch {

namespace sp = seqpar;
using Lengths = std::vector<std::vector<std::int64_t>>;

// The strategies by name: plan::NamedStrategies (plan/named_strategies.hpp), the table seqpar-plan's
// candidates are made from too, and "auto": the planner's choice per batch (the op's own entry).
constexpr auto kStrategies = [] {
  std::array<std::string_view, sp::plan::kNamedStrategyCount + 1> names{};
  std::copy(sp::plan::kNamedStrategyNames.begin(), sp::plan::kNamedStrategyNames.end(), names.begin());
  names.back() = "auto";
  return names;
}();

// The entries "auto" selects among: one strategy of each family seqpar-plan compares.
namespace auto_named {
namespace named = sp::plan::named;
using Candidates =
    std::tuple<named::Ulysses, named::ZigzagRingAware, named::HybridAware, named::Hierarchical, named::Basp>;
// SelectedAttention over the entries' strategy types (declared only: its type is all that is used).
template <class Kernel, class... E>
sp::plan::SelectedAttention<Kernel, typename E::strategy...>* selected(std::tuple<E...>*);
}  // namespace auto_named
/// What "auto" runs: plan::SelectedAttention over auto_named::Candidates' strategies (the layer asks it
/// which one a batch got).
template <class Kernel>
using AutoSelected =
    std::remove_pointer_t<decltype(auto_named::selected<Kernel>(static_cast<auto_named::Candidates*>(nullptr)))>;

/// The named strategy's engine running `kernel`; `masks`: the model's mask mix (the placement serves every
/// layer's mask); `capacity_factor` (0: the partitioner's default, 1.25) for the strategies with a token
/// capacity (the table refuses it for the others). Only the named entry runs, so it may take the kernel.
///
/// Hybrid placements: the op is given no hardware profile (its ranks are this host's CPUs or whatever GPU
/// it runs on), so the table's rule for options without one applies: partition::Hybrid's proxy cost, as
/// the op placed them before the table. seqpar-plan passes its profile (plan::standard_candidates), so its
/// "hybrid-aware" may choose another threshold than the op's for the same batch.
template <class Kernel, class Tr>
std::unique_ptr<sp::runtime::AttentionEngine<Kernel>> make_engine(const std::string& name, Tr& t,
                                                                  const sp::AttentionShape& shape, int rpn,
                                                                  const sp::MaskMix& masks, Kernel kernel = Kernel(),
                                                                  double capacity_factor = 0.0) {
  constexpr std::string_view where = "seqpar.torch.DistributedAttention";
  sp::plan::NamedStrategyOptions options;
  options.ranks_per_node = rpn;
  options.masks = masks;  // the model's mask mix: what the one placement of each batch is balanced for
  options.capacity_factor = capacity_factor;
  options.caller = where;
  std::unique_ptr<sp::runtime::AttentionEngine<Kernel>> made;
  const bool found = sp::plan::visit_named_strategy(name, [&]<class E>() {
    made = std::make_unique<sp::DistributedAttention<typename E::strategy, Kernel>>(
        t, shape, sp::plan::named_arguments<E>(options, shape), std::move(kernel));
  });
  if (found) return made;
  if (name == "auto") {
    sp::plan::check_capacity_factor(name, false, capacity_factor, where);
    // plan::SelectedAttention: every batch shape simulated on each candidate (an H100 SXM profile:
    // the choice is the GPU's, whatever runs here) and the fastest run; every rank chooses the same
    // without talking. The candidates: one of each family seqpar-plan compares, with the table's
    // arguments (Hybrid on the proxy: the profile here picks the strategy, not Hybrid's threshold).
    using Selected = AutoSelected<Kernel>;
    typename Selected::Arguments a;
    // The candidates' own ranks_per_node and masks are SelectedAttention's (`a` below) when it compiles.
    sp::plan::NamedStrategyOptions plain;
    plain.caller = where;
    [&]<class... E>(std::tuple<E...>*) {
      std::size_t i = 0;
      ((a.names[i++] = std::string(E::name)), ...);
      a.strategies = std::make_tuple(sp::plan::named_arguments<E>(plain, shape)...);
    }(static_cast<auto_named::Candidates*>(nullptr));
    a.simulation.hardware = sp::replay::profiles::h100_sxm();
    a.ranks_per_node = rpn;
    a.masks = masks;
    return std::make_unique<Selected>(t, shape, a, std::move(kernel));
  }
  std::string known;
  for (std::string_view s : kStrategies) known += (known.empty() ? "" : ", ") + std::string(s);
  sp::detail::throw_invalid(where, "strategy", "'" + name + "'", "is not a strategy (one of: " + known + ")");
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
