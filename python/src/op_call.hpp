// SPDX-License-Identifier: Apache-2.0
// One call of the torch op on its tensors, as the CPU path (ops.cpp: CpuFlash) and the CUDA path
// (cuda_attention.cpp: CudaFlash, CudnnSdpa, TorchFlash) both make it: the arguments checked and viewed in
// one order (the batch from lengths, q/k/v's dtype/device/strides, the head sizes, the sinks, then lse for
// the backward), the outputs allocated, and the engine's forward or backward with or without sinks. The
// paths differ only in what surrounds the engine's call (the GIL released; on CUDA also torch's stream
// ordered around it) and in the kernels' types; refuse_over is the refusal both send to their peers.
#pragma once

#include <torch/extension.h>

#include <seqpar/runtime/agreement.hpp>
#include <seqpar/seqpar.hpp>

#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engines.hpp"

namespace seqpar_torch {

/// The inputs of a forward, checked and viewed, and its outputs: o (tokens, heads_q, head_dim_v) in q's
/// dtype, lse (heads_q, tokens) in Accum. `sinks`: the call's checked sinks tensor (undefined: none), made
/// by the path's own check (CUDA also checks their values on a host copy) after the views' checks. `device`:
/// where the path's kernels run (cpu, or q's CUDA device): q, k, v and the outputs must be there.
template <class T, class Accum>
struct ForwardCall {
  sp::DocumentBatch batch;
  sp::ThdView<const T> q, k, v;
  at::Tensor sinks, o, lse;

  template <class CheckSinks>
  ForwardCall(const sp::AttentionShape& shape, const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt,
              const Lengths& lengths, c10::Device device, CheckSinks&& check_sinks)
      : batch(make_batch(lengths)),
        q(thd<const T>(qt, "q", qt.scalar_type(), device)),
        k(thd<const T>(kt, "k", qt.scalar_type(), device)),
        v(thd<const T>(vt, "v", qt.scalar_type(), device)) {
    check_head_sizes(shape, qt, kt, vt);
    sinks = check_sinks();
    o = at::empty({qt.size(0), qt.size(1), shape.v_dim()}, qt.options());
    lse = at::empty({qt.size(1), qt.size(0)}, qt.options().dtype(c10::CppTypeToScalarType<Accum>::value));
  }

  template <class Engine>
  void run(Engine& e, sp::AttentionMask mask) const {
    const auto ov = thd<T>(o, "o", o.scalar_type(), o.device());
    if (sinks.defined())
      e.forward(batch, mask, q, k, v, ov, lse_view<Accum>(lse), span_of<const Accum>(sinks));
    else
      e.forward(batch, mask, q, k, v, ov, lse_view<Accum>(lse));
  }
  [[nodiscard]] std::vector<at::Tensor> outputs() const { return {o, lse}; }
};

/// The inputs of a backward (q, k, v, the forward's o and lse, dout) on `device`, checked and viewed, and its outputs:
/// dq, dk, dv (contiguous, like q, k, v) and the sinks' gradient (heads_q values; empty without sinks).
template <class T, class Accum>
struct BackwardCall {
  sp::DocumentBatch batch;
  sp::ThdView<const T> q, k, v, o, dout;
  at::Tensor lse, sinks, dq, dk, dv, dsinks;

  template <class CheckSinks>
  BackwardCall(const sp::AttentionShape& shape, const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt,
               const at::Tensor& ot, const at::Tensor& lset, const at::Tensor& doutt, const Lengths& lengths,
               c10::Device device, CheckSinks&& check_sinks)
      : batch(make_batch(lengths)),
        q(thd<const T>(qt, "q", qt.scalar_type(), device)),
        k(thd<const T>(kt, "k", qt.scalar_type(), device)),
        v(thd<const T>(vt, "v", qt.scalar_type(), device)),
        o(thd<const T>(ot, "o", qt.scalar_type(), device)),
        dout(thd<const T>(doutt, "dout", qt.scalar_type(), device)),
        lse(lset) {
    check_head_sizes(shape, qt, kt, vt);
    sinks = check_sinks();
    sp::detail::require(lse.scalar_type() == c10::CppTypeToScalarType<Accum>::value && lse.device() == device &&
                            lse.dim() == 2 && lse.is_contiguous() && lse.size(0) == qt.size(1) &&
                            lse.size(1) == qt.size(0),
                        "seqpar.torch.DistributedAttention", "lse", lse.sizes(),
                        "must be the forward's lse: contiguous (heads_q, local tokens)");
    dq = at::empty_like(qt, at::MemoryFormat::Contiguous);
    dk = at::empty_like(kt, at::MemoryFormat::Contiguous);
    dv = at::empty_like(vt, at::MemoryFormat::Contiguous);
    dsinks = at::empty({sinks.defined() ? shape.heads_q : 0}, lse.options());
  }

  template <class Engine>
  void run(Engine& e, sp::AttentionMask mask) const {
    const auto at_type = dq.scalar_type();
    const auto dqv = thd<T>(dq, "dq", at_type, dq.device()), dkv = thd<T>(dk, "dk", at_type, dq.device()),
               dvv = thd<T>(dv, "dv", at_type, dq.device());
    if (sinks.defined())
      e.backward(batch, mask, q, k, v, o, lse_view<const Accum>(lse), dout, dqv, dkv, dvv, span_of<const Accum>(sinks),
                 span_of<Accum>(dsinks));
    else
      e.backward(batch, mask, q, k, v, o, lse_view<const Accum>(lse), dout, dqv, dkv, dvv);
  }
  [[nodiscard]] std::vector<at::Tensor> outputs() const { return {dq, dk, dv, dsinks}; }
};

/// This rank refuses the call its peers are making (`why`: the exception it raises), as its outcome of the
/// call's agreement (runtime/agreement.hpp) over `transport`, where the peers' engines agree: they raise
/// seqpar::Error (kPeerFailed) naming this rank and `why` at once. Never throws: the agreement rethrows `why`
/// itself (or a transport error, when a peer is gone: then the peers have their timeout), and the caller
/// raises `why`. The GIL is released: peers may be other threads of this process (the tests).
template <class Transport>
void refuse_over(Transport& transport, const std::string& why) noexcept {
  try {
    sp::runtime::Agreement agreement("seqpar.torch.DistributedAttention");
    std::vector<sp::runtime::Agreement::Record> records;
    pybind11::gil_scoped_release release;
    agreement.run(transport, std::make_exception_ptr(std::invalid_argument(why)), records);
  } catch (...) {
  }
}

}  // namespace seqpar_torch
