# SPDX-License-Identifier: Apache-2.0
"""seqpar as a differentiable torch op over torch.distributed.

    attn = seqpar.torch.DistributedAttention("zigzag-ring", heads_q=8, heads_kv=2, head_dim=64)
    rows = attn.token_indices(lengths)           # this rank's tokens of the packed batch
    o = attn(q[rows], k[rows], v[rows], lengths)  # (local tokens, heads, head_dim), autograd-aware

Value heads may be smaller than query/key heads (MLA: head_dim=192, head_dim_v=128: v and o have
head_dim_v values per head), and attention sinks (gpt-oss) are an optional (heads_q,) tensor of
logits passed to the call: o = attn(q, k, v, lengths, sinks=sinks).

The mask is per call, as FlashAttention's window_size=(left, 0): o = attn(q, k, v, lengths,
window_size=(127, 0)) is a sliding window of 128 keys (each query and its 127 predecessors in its
document); (-1, 0), the default, is full causal attention. A rank's rows (token_indices) are the same
for every layer whatever its window: one module can serve every layer of a model that mixes window and
full layers. Declare the mix once (mask_mix=[((-1, 0), 24), ((127, 0), 24)]) so that the rows are
balanced for it.

`lengths` is the batch's document lengths: a list of ints (one packed sequence) or a list of lists
(one per sequence). q, k, v hold this rank's rows in the order token_indices() gives.
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C

STRATEGIES = tuple(_C.STRATEGIES)
# Whether CUDA tensors run: attention::CudaFlash (fp32, fp16, bf16; head sizes 64/64, 128/128, 192/128) over the
# process group's NCCL backend, stream-ordered with torch's current stream. Only in an extension built
# with SEQPAR_TORCH_CUDA=1; that path is compiled in CI and has never run on a GPU.
CUDA = bool(getattr(_C, "CUDA", False))
Lengths = Union[Sequence[int], Sequence[Sequence[int]]]

# The C++ layers by handle: the op's schema carries an int, not a Python object.
_layers: dict = {}
_group_sizes: dict = {}  # handle -> the size of its layer's process group (the sinks' gradient share)
_next_handle = itertools.count()


def _nested(lengths: Lengths) -> List[List[int]]:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    lengths = list(lengths)
    if lengths and all(isinstance(x, (list, tuple)) for x in lengths):
        return [[int(d) for d in s] for s in lengths]
    for i, x in enumerate(lengths):
        if isinstance(x, (list, tuple)) or not float(x).is_integer():
            raise ValueError(f"seqpar.torch.DistributedAttention: lengths[{i}] = {x!r}: must be an int "
                             "(or give a list of lists, one per sequence)")
    return [[int(d) for d in lengths]]


def _flat(nested: List[List[int]]) -> Tuple[List[int], List[int]]:
    return [d for s in nested for d in s], [len(s) for s in nested]


def _unflat(docs: List[int], per_seq: List[int]) -> List[List[int]]:
    out, at = [], 0
    for n in per_seq:
        out.append(list(docs[at:at + n]))
        at += n
    return out


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # the kernels' accumulation type


def _window_of(window_size, what: str = "window_size") -> int:
    """FlashAttention's (left, right) as seqpar's window in keys (the query's own included; 0: causal)."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"seqpar.torch.DistributedAttention: {what} = {window_size!r}: must be a pair (left, 0) "
                         "as FlashAttention's window_size: (-1, 0) full causal, (w - 1, 0) a window of w keys") from None
    if right != 0:
        raise ValueError(f"seqpar.torch.DistributedAttention: {what} = {window_size!r}: right must be 0 "
                         "(causal attention: a query sees no later key)")
    if left < -1:
        raise ValueError(f"seqpar.torch.DistributedAttention: {what} = {window_size!r}: left must be -1 "
                         "(no window) or >= 0 (the keys before the query)")
    return 0 if left < 0 else left + 1


@torch.library.custom_op("seqpar::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], docs: List[int],
               per_seq: List[int], handle: int, window: int) -> Tuple[torch.Tensor, torch.Tensor]:
    o, lse = _layers[handle].forward(q, k, v, _unflat(docs, per_seq), sinks, window)
    return o, lse


@_attention.register_fake
def _(q, k, v, sinks, docs, per_seq, handle, window):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=_accum_dtype(q.dtype)))


@torch.library.custom_op("seqpar::attention_backward", mutates_args=())
def _attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, sinks: Optional[torch.Tensor], docs: List[int], per_seq: List[int],
                        handle: int, window: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsinks = _layers[handle].backward(q, k, v, o, lse, dout, _unflat(docs, per_seq), sinks, window)
    return dq, dk, dv, dsinks


@_attention_backward.register_fake
def _(q, k, v, o, lse, dout, sinks, docs, per_seq, handle, window):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            lse.new_empty((q.shape[1] if sinks is not None else 0,)))


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, docs, per_seq, handle, window = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks)
    ctx.docs, ctx.per_seq, ctx.handle, ctx.window = docs, per_seq, handle, window
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, o, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _attention_backward(q, k, v, o, lse, dout.contiguous(), sinks, ctx.docs, ctx.per_seq,
                                             ctx.handle, ctx.window)
    if sinks is None:
        return dq, dk, dv, None, None, None, None, None
    # The op sums the sinks' gradient over the group (the C++ API's contract); autograd gets this
    # rank's equal share of that sum, so that the all-reduce (sum) a trainer runs over every replicated
    # parameter's gradient gives the whole batch's gradient, as it does for the projections around
    # attention, whose gradients are each rank's partial sums.
    return dq, dk, dv, dsinks / _group_sizes[ctx.handle], None, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


def _warn_if_oversubscribed(threads: int, ranks_per_node: int) -> None:
    """Warns when this host's ranks times the kernels' threads exceed its cores (each rank's threads then
    share cores with its neighbours': every collective waits for the slowest)."""
    import os
    import warnings

    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = int(local) if local and local.isdigit() else max(ranks_per_node, 1)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if threads >= 1 and ranks * threads > cores:
        warnings.warn(f"seqpar.torch.DistributedAttention: {ranks} ranks on this host x threads = {threads} "
                      f"exceed its {cores} cores: pass threads={max(cores // ranks, 1)} (or call "
                      "torch.set_num_threads) so that ranks do not share cores", RuntimeWarning, stacklevel=3)


class DistributedAttention(torch.nn.Module):
    """Exact causal attention over a packed batch of documents, sharded over `group`'s ranks.

    strategy: a name `seqpar-plan` prints (see STRATEGIES), e.g. "ulysses", "zigzag-ring",
    "hybrid-aware", "basp", "hierarchical", or "auto" (the planner's choice per batch shape, as
    plan::SelectedAttention makes it on an H100 profile). heads_kv divides heads_q (GQA). q and k have
    head_dim values per head; v and the output head_dim_v (default: head_dim; MLA: 192 and 128). group: a
    torch.distributed process group (default: the world). ranks_per_node: ranks sharing a node (for
    the hierarchical strategies; 0: all). timeout_s: how long any wait on a peer may take before
    RuntimeError (default: SEQPAR_TIMEOUT_S or 600 s, the C++ transports' default; float("inf") or any
    value past 100 years waits 100 years, without a bound in practice; NaN, 0 or a negative value raises
    ValueError naming timeout_s).

    Tensors: CPU (gloo, or any backend the group has for the CPU): float64, float32, bfloat16 (the
    bf16 kernel on the tensors' storage; fp32 lse). CUDA, only where seqpar.torch.CUDA is true (built
    with SEQPAR_TORCH_CUDA=1): float32, float16, bfloat16, head sizes 64/64, 128/128 or 192/128 (MLA), on a group whose CUDA
    backend is NCCL; the transfers and kernels run on seqpar's streams, ordered after and before
    torch's current stream. The CUDA path is compiled, never run: no GPU has executed it yet; it takes
    sinks.

    mask_mix: the model's masks with their layer counts, as ((left, right) window_size, layers) pairs,
    e.g. [((-1, 0), 24), ((127, 0), 24)] for 24 full and 24 window-128 layers (default: every layer
    full). A rank's rows are made once per batch for every layer, balanced for this mix; a call may
    use any window_size (only the balance follows the mix).

    threads: the CPU kernels' threads on this rank (default: torch.get_num_threads() when the layer is
    made, as torch's own CPU ops use; torchrun sets it to 1 per process when several share a host). A
    warning says when the ranks on this host (LOCAL_WORLD_SIZE, else ranks_per_node) times threads
    exceed its cores. The kernels' instruction set is chosen at run time for this CPU (`cpu_isa`:
    avx512, avx2 or portable; SEQPAR_CPU_ISA forces one).
    """

    def __init__(self, strategy: str, heads_q: int, heads_kv: int, head_dim: int, group=None,
                 ranks_per_node: int = 0, timeout_s: Optional[float] = None, head_dim_v: Optional[int] = None,
                 mask_mix: Optional[Sequence[Tuple[Tuple[int, int], int]]] = None,
                 threads: Optional[int] = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("seqpar.torch.DistributedAttention: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        if group is None:
            group = dist.group.WORLD
        if timeout_s is None:
            import os
            timeout_s = float(os.environ.get("SEQPAR_TIMEOUT_S", "600"))
        if head_dim_v is None:
            head_dim_v = head_dim
        self.heads_q, self.heads_kv, self.head_dim, self.head_dim_v = heads_q, heads_kv, head_dim, head_dim_v
        mix = []
        for i, part in enumerate(mask_mix or ()):
            try:
                window_size, layers = part
            except (TypeError, ValueError):
                raise ValueError(f"seqpar.torch.DistributedAttention: mask_mix[{i}] = {part!r}: must be a pair "
                                 "(window_size, layers), e.g. ((127, 0), 24)") from None
            mix.append((_window_of(window_size, f"mask_mix[{i}] window_size"), int(layers)))
        if threads is None:
            threads = torch.get_num_threads()
        _warn_if_oversubscribed(int(threads), int(ranks_per_node))
        self._layer = _C.Attention(strategy, heads_q, heads_kv, head_dim, group, float(timeout_s),
                                   int(ranks_per_node), int(head_dim_v), mix, int(threads))
        self._handle = next(_next_handle)
        _layers[self._handle] = self._layer
        _group_sizes[self._handle] = dist.get_world_size(group)

    def __del__(self):
        _layers.pop(getattr(self, "_handle", None), None)
        _group_sizes.pop(getattr(self, "_handle", None), None)

    @property
    def strategy(self) -> str:
        return self._layer.strategy

    @property
    def threads(self) -> int:
        """The CPU kernels' threads on this rank."""
        return self._layer.threads

    @property
    def cpu_isa(self) -> str:
        """The instruction set the CPU kernels run (float32 and bfloat16; float64 runs the portable path)."""
        return self._layer.cpu_isa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Lengths,
                return_lse: bool = False, sinks: Optional[torch.Tensor] = None,
                window_size: Tuple[int, int] = (-1, 0)):
        """o (local tokens, heads_q, head_dim_v), and with return_lse the log-sum-exp (heads_q, local
        tokens), of this rank's rows. q, k: (local tokens, heads, head_dim); v: (local tokens, heads_kv,
        head_dim_v). Differentiable in q, k, v and sinks.

        window_size: FlashAttention's (left, right): (-1, 0) full causal attention within each document
        (the default), (w - 1, 0) a sliding window of w keys (the query's own and its w - 1
        predecessors in its document). The same rows serve every window: layers of a model may differ.

        sinks: attention sinks (gpt-oss), one logit per query head, shape (heads_q,), in the kernels'
        accumulation type (float32; float64 for float64 q), on q's device; typically a learnable
        parameter the same on every rank. Each joins the softmax of every row of its head as one more
        term with no value; -inf is a head without a sink; NaN and +inf are refused. Its gradient on each
        rank is an equal share (1 / group size) of the whole batch's, which the op sums over the group:
        the all-reduce (sum) of replicated parameters' gradients a trainer runs anyway gives the whole
        batch's gradient, as for every other parameter."""
        checked = (("q", q), ("k", k), ("v", v)) + ((("sinks", sinks),) if sinks is not None else ())
        for name, t in checked:
            # Checked here: a tensor on another device would dispatch the op to that device's
            # (fake) implementation instead of reaching the kernels' checks.
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"seqpar.torch.DistributedAttention: {name} = {type(t).__name__}: must be a tensor")
            if t.device.type == "cuda" and not CUDA:
                raise ValueError(f"seqpar.torch.DistributedAttention: {name}.device = {t.device}: must be cpu "
                                 "(this extension was built without its CUDA path: SEQPAR_TORCH_CUDA=1)")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"seqpar.torch.DistributedAttention: {name}.device = {t.device}: must be cpu "
                                 "(the CPU kernels)" + (" or cuda (the CUDA kernels)" if CUDA else ""))
        window = _window_of(window_size)
        docs, per_seq = _flat(_nested(lengths))
        o, lse = _attention(q, k, v, sinks, docs, per_seq, self._handle, window)
        return (o, lse) if return_lse else o

    # ---- what a trainer needs around attention (the C++ train/ glue) ----
    def token_meta(self, lengths: Lengths) -> dict:
        """This rank's rows (plan order) as int64 tensors: global_index (the token of the packed batch),
        sequence, document, position (within its document: RoPE), label_index (the global token of
        its next-token label, -1 for a document's last token)."""
        names = ("global_index", "sequence", "document", "position", "label_index")
        return dict(zip(names, self._layer.token_meta(_nested(lengths))))

    def token_indices(self, lengths: Lengths) -> torch.Tensor:
        """The global tokens this rank holds, in the order q, k, v rows must be given."""
        return self.token_meta(lengths)["global_index"]

    def positions(self, lengths: Lengths) -> torch.Tensor:
        """Each local row's position within its document (RoPE positions)."""
        return self.token_meta(lengths)["position"]

    def labels(self, ids: torch.Tensor, lengths: Lengths, ignore_index: int = -100) -> torch.Tensor:
        """Next-token labels of the local rows from the whole batch's ids (a document's last token,
        whose next token belongs to another document, gets ignore_index). Right across cuts: the
        label of a row whose next token lives on another rank comes from the global ids."""
        idx = self.token_meta(lengths)["label_index"]
        out = torch.full(idx.shape, ignore_index, dtype=ids.dtype)
        has = idx >= 0
        out[has] = ids.reshape(-1)[idx[has]]
        return out


def label_count(lengths: Lengths) -> int:
    """The loss normaliser: label tokens of the whole batch (every token but each document's last),
    the same on every rank. Sum the local per-token losses, divide by this, and sum (not average)
    the gradients of replicated parameters over the ranks."""
    nested = _nested(lengths)
    return sum(sum(s) - len(s) for s in nested)


__all__ = ["CUDA", "DistributedAttention", "STRATEGIES", "label_count"]
