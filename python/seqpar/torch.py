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
# Whether CUDA tensors run: attention::CudaFlash (fp32, fp16, bf16; head sizes 64/64, 128/128, 192/128), and for
# fp16 / bf16 cuDNN's SDPA (CUDNN) or torch's FlashAttention ops (the layer's `kernel`), over the process
# group's NCCL backend, stream-ordered with torch's current stream. Only in an extension built with
# SEQPAR_TORCH_CUDA=1; that path is compiled in CI and has never run on a GPU.
CUDA = bool(getattr(_C, "CUDA", False))
# Whether kernel="cudnn" (cuDNN's fused attention, attention::CudnnSdpa) is in this build: the CUDA path built
# where cuDNN and cudnn-frontend were found (python/setup.py). Compiled, never run on a GPU.
CUDNN = bool(getattr(_C, "CUDNN", False))
Lengths = Union[Sequence[int], Sequence[Sequence[int]]]

# The C++ layers by handle: the op's schema carries an int, not a Python object.
_layers: dict = {}
_group_sizes: dict = {}  # handle -> the size of its layer's process group (the sinks' gradient share)
_next_handle = itertools.count()
_layers_made: dict = {}  # process group -> layers made on it: each layer's number in the calls' agreement


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


def _as_cu_seqlens(lengths: Lengths) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Document lengths (a list, or a list of lists: one per sequence) as the varlen op's tensors:
    cu_seqlens (documents + 1 cumulative offsets, int64) and doc_counts (documents per sequence; None
    for one sequence)."""
    docs, per_seq = _flat(_nested(lengths))
    for i, d in enumerate(docs):
        if d < 1:
            s, j = _where(per_seq, i)
            raise ValueError(f"seqpar.torch.DistributedAttention: lengths[{s}][{j}] = {d}: must be >= 1 "
                             "(every document holds at least one token)")
    cu = torch.zeros(len(docs) + 1, dtype=torch.int64)
    if docs:
        cu[1:] = torch.tensor(docs, dtype=torch.int64).cumsum(0)
    counts = torch.tensor(per_seq, dtype=torch.int64) if len(per_seq) > 1 else None
    return cu, counts


def _where(per_seq: List[int], i: int) -> Tuple[int, int]:
    for s, n in enumerate(per_seq):
        if i < n:
            return s, i
        i -= n
    return len(per_seq), i


# The op: the batch as tensors (FlashAttention's cu_seqlens, and the documents of each sequence), so that
# torch.compile sees a batch of a new document count as a tensor of a new size (dynamic after the
# second), not as constants to recompile for. The layer by handle: the schema carries an int, not a
# Python object. window: keys (0: causal); scale: the softmax scale (0: 1 / sqrt(head_dim)).
@torch.library.custom_op("seqpar::varlen_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               doc_counts: Optional[torch.Tensor], sinks: Optional[torch.Tensor], handle: int, window: int,
               scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    o, lse = _layers[handle].forward(q, k, v, cu_seqlens, doc_counts, sinks, window, scale)
    return o, lse


@_attention.register_fake
def _(q, k, v, cu_seqlens, doc_counts, sinks, handle, window, scale):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=_accum_dtype(q.dtype)))


@torch.library.custom_op("seqpar::varlen_attention_backward", mutates_args=())
def _attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, cu_seqlens: torch.Tensor, doc_counts: Optional[torch.Tensor],
                        sinks: Optional[torch.Tensor], handle: int, window: int,
                        scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsinks = _layers[handle].backward(q, k, v, o, lse, dout, cu_seqlens, doc_counts, sinks, window, scale)
    return dq, dk, dv, dsinks


@_attention_backward.register_fake
def _(q, k, v, o, lse, dout, cu_seqlens, doc_counts, sinks, handle, window, scale):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            lse.new_empty((q.shape[1] if sinks is not None else 0,)))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, doc_counts, sinks, handle, window, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, doc_counts, sinks)
    ctx.handle, ctx.window, ctx.scale = handle, window, scale
    # The C++ layer itself: the graph keeps it for the backward even if the module is freed first.
    ctx.layer, ctx.group_size = _layers.get(handle), _group_sizes.get(handle)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, o, lse, cu_seqlens, doc_counts, sinks = ctx.saved_tensors
    # A module freed after its forward (del, or a model rebuilt on one rank): its backward still runs, on
    # the layer the graph kept, so that no rank raises alone while its peers wait in theirs.
    revived = ctx.handle not in _layers and getattr(ctx, "layer", None) is not None
    if revived:
        _layers[ctx.handle], _group_sizes[ctx.handle] = ctx.layer, ctx.group_size
    try:
        dq, dk, dv, dsinks = _attention_backward(q, k, v, o, lse, dout.contiguous(), cu_seqlens, doc_counts, sinks,
                                                 ctx.handle, ctx.window, ctx.scale)
    finally:
        if revived:
            _layers.pop(ctx.handle, None)
    if revived:
        group_size = ctx.group_size
    else:
        group_size = _group_sizes[ctx.handle]
    if sinks is None:
        return dq, dk, dv, None, None, None, None, None, None
    # The op sums the sinks' gradient over the group (the C++ API's contract); autograd gets this
    # rank's equal share of that sum, so that the all-reduce (sum) a trainer runs over every replicated
    # parameter's gradient gives the whole batch's gradient, as it does for the projections around
    # attention, whose gradients are each rank's partial sums.
    if revived:
        _group_sizes.pop(ctx.handle, None)
    return dq, dk, dv, None, None, dsinks / group_size, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


def _scale_of(softmax_scale) -> float:
    if softmax_scale is None:
        return 0.0
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"seqpar.torch.DistributedAttention: softmax_scale = {softmax_scale!r}: must be a "
                         "positive float or None (1 / sqrt(head_dim))") from None
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"seqpar.torch.DistributedAttention: softmax_scale = {softmax_scale!r}: must be finite "
                         "and > 0 (None: 1 / sqrt(head_dim))")
    return scale


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: Optional[int] = None, *, layer: "DistributedAttention",
                     softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, 0),
                     sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
                     doc_counts: Optional[torch.Tensor] = None):
    """Exact causal attention over a packed batch sharded over `layer`'s process group, in
    FlashAttention's varlen form (flash_attn_varlen_func's names; q, k, v hold this rank's rows).

    cu_seqlens: the cumulative token offsets of the documents of the WHOLE packed batch (every rank's
    tokens, in the packed order): an int32 or int64 tensor of documents + 1 values, 0 first, increasing;
    the same on every rank. doc_counts: the documents of each packed sequence, in order, when the batch
    holds several sequences (BASP places sequences on ranks; None: one sequence). A tensor batch does not
    make torch.compile recompile when the document count changes. max_seqlen: accepted for
    FlashAttention's signature; seqpar reads the lengths from cu_seqlens.

    q, k: (local tokens, heads, head_dim) in the order layer.token_indices(cu_seqlens=...) gives; v:
    (local tokens, heads_kv, head_dim_v). softmax_scale: None for 1 / sqrt(head_dim) (DeepSeek-V3's YaRN
    correction, Gemma's query_pre_attn_scalar: pass the model's). window_size: (-1, 0) full causal
    attention within each document, (w - 1, 0) a sliding window of w keys. sinks: (heads_q,) logits
    (gpt-oss). Returns o (local tokens, heads_q, head_dim_v), and the log-sum-exp (heads_q, local tokens)
    with return_lse. Differentiable in q, k, v and sinks."""
    return layer(q, k, v, None, return_lse=return_lse, sinks=sinks, window_size=window_size, cu_seqlens=cu_seqlens,
                 doc_counts=doc_counts, softmax_scale=softmax_scale, max_seqlen=max_seqlen)


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


_KERNELS = ("auto", "flash", "cudnn", "seqpar")


def _kernel_of(args) -> str:
    """The layer's kernel argument, checked here for its type (the C++ layer checks the name and says which
    kernels this build has). Layers pickled before the argument existed have none: "auto"."""
    kernel = args.get("kernel", "auto")
    if not isinstance(kernel, str):
        raise TypeError(f"seqpar.torch.DistributedAttention: kernel = {kernel!r}: must be a str, one of "
                        f"{', '.join(_KERNELS)}")
    return kernel


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

    capacity_factor: whole-doc's and the hybrid strategies' per-rank token capacity, capacity_factor x
    tokens / ranks (default 1.25): whole-doc keeps every document whole, so a batch whose longest document
    exceeds the capacity is refused, naming it; raise it (up to the number of ranks) for such batches.

    threads: the CPU kernels' threads on this rank (default: torch.get_num_threads() when the layer is
    made, as torch's own CPU ops use; torchrun sets it to 1 per process when several share a host). A
    warning says when the ranks on this host (LOCAL_WORLD_SIZE, else ranks_per_node) times threads
    exceed its cores. The kernels' instruction set is chosen at run time for this CPU (`cpu_isa`:
    avx512, avx2 or portable; bfloat16 avx512bf16 where the CPU has it, `cpu_isas`; SEQPAR_CPU_ISA forces one).

    kernel: the attention kernel of float16 / bfloat16 CUDA calls. "auto" (default): cuDNN's fused attention
    (attention::CudnnSdpa, where this build has it: CUDNN) for calls it takes (not sliding-window calls: cuDNN's
    band cannot be cut on the right by a ring step's last key), else torch's own FlashAttention ops
    (aten::_flash_attention_forward / _backward, varlen; FlashAttention 4 where
    torch.nn.attention.activate_flash_attention_impl("FA4") is active) where they take the shape (head_dim ==
    head_dim_v, a multiple of 8 up to 256, compute capability 8.0+), else seqpar's CudaFlash, which is also
    the float32 kernel. "cudnn" / "flash": that kernel where it takes the call, else CudaFlash with one
    warning per reason. "seqpar": seqpar's own kernels only. CPU tensors run seqpar's CpuFlash: there the
    kernel must be "auto" or "seqpar" ("cudnn" and "flash" are refused by name, as is a kernel this build
    lacks). The `kernel` property says which kernel ran the last call. The vendor kernels' paths are
    compiled, never run: no GPU has executed them yet.

    Made on every rank of `group` together: the ranks compare their strategy, heads and head sizes
    (one all_gather_object) and raise ValueError naming both values when they differ. A proper module
    attribute: copy.deepcopy makes a layer with the same arguments on the same group; pickling (torch.save
    of a model) keeps the constructor's arguments and the group's ranks, and loading finds the process
    group of those ranks (the world, or one made with new_group / a DeviceMesh before loading).
    """

    def __init__(self, strategy: str, heads_q: int, heads_kv: int, head_dim: int, group=None,
                 ranks_per_node: int = 0, timeout_s: Optional[float] = None, head_dim_v: Optional[int] = None,
                 mask_mix: Optional[Sequence[Tuple[Tuple[int, int], int]]] = None,
                 threads: Optional[int] = None, capacity_factor: Optional[float] = None, kernel: str = "auto"):
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
        if threads is None:
            threads = torch.get_num_threads()
        mask_mix = [tuple(part) if isinstance(part, (list, tuple)) else part for part in (mask_mix or ())]
        self._args = dict(strategy=strategy, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                          ranks_per_node=ranks_per_node, timeout_s=timeout_s, head_dim_v=head_dim_v,
                          mask_mix=mask_mix, threads=threads, capacity_factor=capacity_factor, kernel=kernel)
        self._build(group)

    def _build(self, group) -> None:
        a = self._args
        self.group = group
        self.heads_q, self.heads_kv, self.head_dim, self.head_dim_v = (a["heads_q"], a["heads_kv"], a["head_dim"],
                                                                      a["head_dim_v"])
        mix = []
        for i, part in enumerate(a["mask_mix"]):
            try:
                window_size, layers = part
            except (TypeError, ValueError):
                raise ValueError(f"seqpar.torch.DistributedAttention: mask_mix[{i}] = {part!r}: must be a pair "
                                 "(window_size, layers), e.g. ((127, 0), 24)") from None
            mix.append((_window_of(window_size, f"mask_mix[{i}] window_size"), int(layers)))
        _warn_if_oversubscribed(int(a["threads"]), int(a["ranks_per_node"]))
        self._layer = _C.Attention(a["strategy"], a["heads_q"], a["heads_kv"], a["head_dim"], group,
                                   float(a["timeout_s"]), int(a["ranks_per_node"]), int(a["head_dim_v"]), mix,
                                   int(a["threads"]), float(a["capacity_factor"] or 0.0), _kernel_of(a))
        self._agree(group)
        # Its number among the layers made on this group (made on every rank together: the same on each),
        # compared in every call: two layers called in different orders on two ranks raise, naming it.
        self._layer.set_layer(_layers_made.setdefault(group, itertools.count()).__next__())
        self._handle = next(_next_handle)
        _layers[self._handle] = self._layer
        _group_sizes[self._handle] = dist.get_world_size(group)

    def _agree(self, group) -> None:
        """The ranks' constructor arguments compared (one all_gather_object): a layer made with another
        strategy or shape on one rank would otherwise fail at its first call with a hash mismatch."""
        keys = ("strategy", "heads_q", "heads_kv", "head_dim", "head_dim_v", "ranks_per_node", "mask_mix",
                "capacity_factor", "kernel")
        mine = {key: self._args.get(key, "auto") if key == "kernel" else self._args[key] for key in keys}
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        me = dist.get_rank(group)
        for key in keys:
            for r, theirs in enumerate(everyone):
                if theirs[key] != mine[key]:
                    raise ValueError(f"seqpar.torch.DistributedAttention: {key} = {mine[key]!r} on rank {me} of the "
                                     f"group but {theirs[key]!r} on rank {r}: every rank must make the layer "
                                     "with the same arguments")

    # ---- a proper module attribute: deepcopy, pickling by constructor arguments, repr ----
    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_layer", "_handle", "group")}
        state["_group_ranks"] = (None if self.group is dist.group.WORLD or self.group == dist.group.WORLD
                                 else tuple(dist.get_process_group_ranks(self.group)))
        return state

    def __setstate__(self, state):
        ranks = state.pop("_group_ranks", None)
        self.__dict__.update(state)
        self._build(_group_of_ranks(ranks))

    def __deepcopy__(self, memo):
        import copy

        new = type(self).__new__(type(self))
        state = {k: v for k, v in self.__dict__.items() if k not in ("_layer", "_handle", "group")}
        new.__dict__.update(copy.deepcopy(state, memo))
        new._build(self.group)  # the same process group, not a copy of it
        return new

    def extra_repr(self) -> str:
        a = self._args
        text = (f"strategy={a['strategy']!r}, heads_q={a['heads_q']}, heads_kv={a['heads_kv']}, "
                f"head_dim={a['head_dim']}, head_dim_v={a['head_dim_v']}, group_size={dist.get_world_size(self.group)}")
        if a["mask_mix"]:
            text += f", mask_mix={a['mask_mix']!r}"
        chose = self._layer.chosen()
        if chose and a["strategy"] == "auto":
            text += f", chose={chose!r} (last batch)"
        text += f", kernel={_kernel_of(a)!r}"
        ran = self._layer.kernel_ran
        if ran:
            text += f" (ran {ran!r})"
        return text + f", threads={a['threads']}, cpu_isa={self.cpu_isa!r}"

    def __del__(self):
        _layers.pop(getattr(self, "_handle", None), None)
        _group_sizes.pop(getattr(self, "_handle", None), None)

    @property
    def strategy(self) -> str:
        return self._layer.strategy

    def chosen(self, lengths: Optional[Lengths] = None, *, cu_seqlens: Optional[torch.Tensor] = None,
               doc_counts: Optional[torch.Tensor] = None) -> str:
        """The strategy that runs this batch: the planner's choice for "auto", the layer's strategy
        otherwise. Local (no communication); every rank gets the same answer."""
        cu, counts = self._batch(lengths, cu_seqlens, doc_counts)
        return self._layer.chosen(cu, counts)

    @property
    def kernel(self) -> str:
        """The kernel that ran the last call: "seqpar" (seqpar's CpuFlash / CudaFlash), "cudnn" (cuDNN's fused
        attention) or "flash" (torch's FlashAttention ops); before the first call, the constructor's `kernel`
        argument ("auto", "cudnn", "flash" or "seqpar")."""
        return self._layer.kernel_ran or self._layer.kernel

    @property
    def threads(self) -> int:
        """The CPU kernels' threads on this rank."""
        return self._layer.threads

    @property
    def cpu_isa(self) -> str:
        """The instruction set the CPU kernels run on float32 tensors (avx512, avx2 or portable; float64 runs
        the portable path; bfloat16: cpu_isas)."""
        return self._layer.cpu_isa

    @property
    def cpu_isas(self) -> dict:
        """The instruction set of the CPU kernels per dtype: bfloat16 runs AVX512-BF16's bf16 dot products
        (avx512bf16) where the CPU has them, float32 the fp32 tiles, float64 the portable path."""
        return {torch.float64: "portable", torch.float32: self._layer.cpu_isa, torch.bfloat16: self._layer.cpu_isa_bf16}

    @staticmethod
    def _batch(lengths, cu_seqlens, doc_counts):
        if cu_seqlens is not None:
            if lengths is not None:
                raise ValueError("seqpar.torch.DistributedAttention: lengths and cu_seqlens both given: pass one "
                                 "(lengths: a list of document lengths; cu_seqlens: their cumulative offsets)")
            if not isinstance(cu_seqlens, torch.Tensor):
                raise TypeError(f"seqpar.torch.DistributedAttention: cu_seqlens = {type(cu_seqlens).__name__}: must "
                                "be a tensor (int32 or int64: documents + 1 cumulative offsets, from 0)")
            if doc_counts is not None and not isinstance(doc_counts, torch.Tensor):
                raise TypeError(f"seqpar.torch.DistributedAttention: doc_counts = {type(doc_counts).__name__}: must "
                                "be a tensor (the documents of each sequence) or None")
            return cu_seqlens, doc_counts
        if lengths is None:
            raise ValueError("seqpar.torch.DistributedAttention: no batch: pass lengths (document lengths) or "
                             "cu_seqlens= (their cumulative offsets, FlashAttention's varlen form)")
        if doc_counts is not None:
            raise ValueError("seqpar.torch.DistributedAttention: doc_counts goes with cu_seqlens; with lengths, "
                             "give a list of lists (one per sequence)")
        return _as_cu_seqlens(lengths)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Optional[Lengths] = None,
                return_lse: bool = False, sinks: Optional[torch.Tensor] = None,
                window_size: Tuple[int, int] = (-1, 0), *, cu_seqlens: Optional[torch.Tensor] = None,
                doc_counts: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                max_seqlen: Optional[int] = None):
        """o (local tokens, heads_q, head_dim_v), and with return_lse the log-sum-exp (heads_q, local
        tokens), of this rank's rows. q, k: (local tokens, heads, head_dim); v: (local tokens, heads_kv,
        head_dim_v). Differentiable in q, k, v and sinks.

        The batch: `lengths` (the documents' lengths: a list, or a list of lists, one per sequence), or
        FlashAttention's varlen form, `cu_seqlens=` (int tensor: documents + 1 cumulative offsets over
        the whole packed batch) with `doc_counts=` (documents per sequence; None: one). Under
        torch.compile pass tensors: a list is a constant the graph is specialised for. max_seqlen: accepted
        for flash_attn_varlen_func's signature; the lengths come from cu_seqlens.

        window_size: FlashAttention's (left, right): (-1, 0) full causal attention within each document
        (the default), (w - 1, 0) a sliding window of w keys (the query's own and its w - 1
        predecessors in its document). The same rows serve every window: layers of a model may differ.
        softmax_scale: the scale of q.k (None: 1 / sqrt(head_dim)), per call.

        sinks: attention sinks (gpt-oss), one logit per query head, shape (heads_q,), in the kernels'
        accumulation type (float32; float64 for float64 q), on q's device; typically a learnable
        parameter the same on every rank. Each joins the softmax of every row of its head as one more
        term with no value; -inf is a head without a sink; NaN and +inf are refused. Its gradient on each
        rank is an equal share (1 / group size) of the whole batch's, which the op sums over the group:
        the all-reduce (sum) of replicated parameters' gradients a trainer runs anyway gives the whole
        batch's gradient, as for every other parameter."""
        checked = (("q", q), ("k", k), ("v", v)) + ((("sinks", sinks),) if sinks is not None else ())
        try:
            for name, t in checked:
                # Checked here: a tensor on another device would dispatch the op to that device's
                # (fake) implementation instead of reaching the kernels' checks.
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"seqpar.torch.DistributedAttention: {name} = {type(t).__name__}: must be a "
                                    "tensor")
                if t.device.type == "cuda" and not CUDA:
                    raise ValueError(f"seqpar.torch.DistributedAttention: {name}.device = {t.device}: must be cpu "
                                     "(this extension was built without its CUDA path: SEQPAR_TORCH_CUDA=1)")
                if t.device.type not in ("cpu", "cuda"):
                    raise ValueError(f"seqpar.torch.DistributedAttention: {name}.device = {t.device}: must be cpu "
                                     "(the CPU kernels)" + (" or cuda (the CUDA kernels)" if CUDA else ""))
            window = _window_of(window_size)
            scale = _scale_of(softmax_scale)
            cu, counts = self._batch(lengths, cu_seqlens, doc_counts)
        except (TypeError, ValueError) as e:
            # This rank's outcome of the call's agreement: its peers, already in theirs, raise at once
            # (RuntimeError naming this rank and why) instead of waiting for it until the timeout.
            # CUDA tensors: over the CUDA path's own transport, where the peers' engines agree.
            self._layer.refuse(str(e), cuda=CUDA and isinstance(q, torch.Tensor) and q.is_cuda)
            raise
        o, lse = _attention(q, k, v, cu, counts, sinks, self._handle, window, scale)
        return (o, lse) if return_lse else o

    # ---- what a trainer needs around attention (the C++ train/ glue) ----
    def token_meta(self, lengths: Optional[Lengths] = None, *, cu_seqlens: Optional[torch.Tensor] = None,
                   doc_counts: Optional[torch.Tensor] = None) -> dict:
        """This rank's rows (plan order) as int64 tensors: global_index (the token of the packed batch),
        sequence, document, position (within its document: RoPE), label_index (the global token of
        its next-token label, -1 for a document's last token). The batch as forward takes it."""
        names = ("global_index", "sequence", "document", "position", "label_index")
        return dict(zip(names, self._layer.token_meta(*self._batch(lengths, cu_seqlens, doc_counts))))

    def token_indices(self, lengths: Optional[Lengths] = None, **batch) -> torch.Tensor:
        """The global tokens this rank holds, in the order q, k, v rows must be given."""
        return self.token_meta(lengths, **batch)["global_index"]

    def positions(self, lengths: Optional[Lengths] = None, **batch) -> torch.Tensor:
        """Each local row's position within its document (RoPE positions)."""
        return self.token_meta(lengths, **batch)["position"]

    def labels(self, ids: torch.Tensor, lengths: Optional[Lengths] = None, ignore_index: int = -100,
               **batch) -> torch.Tensor:
        """Next-token labels of the local rows from the whole batch's ids (a document's last token,
        whose next token belongs to another document, gets ignore_index; so does a row whose next
        token's id is ignore_index: a masked prompt). Right across cuts: the label of a row whose next
        token lives on another rank comes from the global ids."""
        idx = self.token_meta(lengths, **batch)["label_index"]
        out = torch.full(idx.shape, ignore_index, dtype=ids.dtype)
        has = idx >= 0
        out[has] = ids.reshape(-1)[idx[has]]
        return out


def _group_of_ranks(ranks):
    """The process group of `ranks` (None: the world) among those this process has made: what an
    unpickled layer runs on."""
    if ranks is None:
        return dist.group.WORLD
    ranks = tuple(ranks)
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    from torch.distributed import distributed_c10d as c10d

    for pg in list(getattr(c10d._world, "pg_map", {}).keys()):
        try:
            if tuple(dist.get_process_group_ranks(pg)) == ranks:
                return pg
        except (RuntimeError, ValueError):
            continue
    raise RuntimeError(f"seqpar.torch.DistributedAttention: no process group of ranks {list(ranks)} in this "
                       "process: make it (dist.new_group or a DeviceMesh) before loading the layer")


def data_parallel_loss_scale(group=None) -> int:
    """What to multiply the loss by before backward when DistributedDataParallel or FSDP (which average
    gradients over every rank they span) wrap a model whose attention runs over `group`, the
    context-parallel group (a DeviceMesh's "cp" dimension: mesh["cp"].get_group()).

    Each rank's loss is its rows' share of its sequence's loss (local sum / label_count), so the
    gradient of a replicated parameter is the SUM of the context-parallel ranks' gradients; DDP and FSDP
    average over data-parallel x context-parallel ranks instead, giving 1 / cp of the data-parallel mean.
    Scaling the loss by the context-parallel size makes their average the data-parallel mean of the
    whole sequences' gradients: what the same model on one process per data-parallel replica computes.

        mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
        attn = DistributedAttention(..., group=mesh["cp"].get_group())
        model = DistributedDataParallel(model)          # over the world: dp x cp replicas
        (loss * data_parallel_loss_scale(mesh["cp"].get_group())).backward()
    """
    return dist.get_world_size(group if group is not None else dist.group.WORLD)


def label_count(lengths: Optional[Lengths] = None, *, labels: Optional[torch.Tensor] = None, group=None,
                ignore_index: int = -100) -> int:
    """The loss normaliser, the same on every rank: sum the local per-token losses, divide by this, and
    sum (not average) the gradients of replicated parameters over the ranks (or use
    data_parallel_loss_scale under DDP / FSDP).

    label_count(lengths): every next-token label of the whole batch (every token but each document's
    last). label_count(labels=local_labels, group=g): the labels that are not ignore_index, counted over
    g's ranks (one all_reduce): supervised fine-tuning masks its prompts with -100, which the first form
    would count."""
    if labels is not None:
        if lengths is not None:
            raise ValueError("seqpar.torch.label_count: lengths and labels both given: pass one (labels: this "
                             "rank's labels, counted over the group without ignore_index)")
        count = (labels != ignore_index).sum().to(torch.int64).reshape(1)  # on labels' device (nccl: cuda)
        if dist.is_initialized():
            dist.all_reduce(count, group=group if group is not None else dist.group.WORLD)
        return int(count.item())
    if lengths is None:
        raise ValueError("seqpar.torch.label_count: give the batch's lengths, or labels= (this rank's labels)")
    nested = _nested(lengths)
    return sum(sum(s) - len(s) for s in nested)


__all__ = ["CUDA", "DistributedAttention", "STRATEGIES", "data_parallel_loss_scale", "label_count", "varlen_attention"]
