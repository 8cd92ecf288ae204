# SPDX-License-Identifier: Apache-2.0
"""seqpar as a Hugging Face transformers attention implementation: a packed batch sharded over a
process group runs through any model that calls `ALL_ATTENTION_FUNCTIONS` (Llama, Qwen3, gpt-oss with
its sinks and alternating sliding windows, DeepSeek-V3's 192/128 heads, ...).

    import seqpar.integrations.transformers as sphf
    sphf.register()                                             # "seqpar" in transformers' interfaces
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="seqpar")
    sphf.configure(model, "zigzag-ring", group=cp_group)        # every attention module's seqpar layer
    local = sphf.shard(model, input_ids, lengths, labels=labels)   # this rank's rows of the packed batch
    logits = model(**local.model_inputs()).logits               # (1, local tokens, vocab)
    loss = sphf.loss(logits, local)                             # the whole batch's mean token loss, shared
    loss.backward()                                             # then sum gradients over cp_group's ranks

`shard` takes the whole packed batch (input ids of every document, one after the other) and its
document lengths, and gives this rank's input ids, its RoPE positions (within each document), its
next-token labels (-100 at document ends and where `labels` is -100: masked prompts) and the batch as
FlashAttention's cu_seqlens, which the model passes to the attention calls (transformers' own kwarg
name, `cu_seq_lens_q`). Under DistributedDataParallel or FSDP multiply the loss by
seqpar.torch.data_parallel_loss_scale(cp_group) instead of summing gradients by hand.

The model's attention masks are not used: documents are separated by cu_seqlens, sliding windows
come from each layer's `sliding_window`, sinks from gpt-oss's `s_aux`, the scale from the module's
`scaling` (DeepSeek-V3's YaRN correction included). Padding (a 2-D attention_mask with zeros) and a
KV cache (generation) are refused by name: this is for training on packed batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import torch as spt

NAME = "seqpar"


def register(name: str = NAME) -> None:
    """Registers seqpar's attention function and its (empty) mask function under `name` in transformers'
    AttentionInterface and AttentionMaskInterface: attn_implementation=name then selects it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _no_mask)


def _no_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             **kwargs):
    # seqpar separates documents by cu_seqlens and applies windows itself: the model needs no mask. A
    # padding mask would be silently ignored, so it is refused.
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("seqpar (transformers attention): attention_mask has padding (zeros): seqpar runs packed "
                         "batches without padding; pack the documents and pass their lengths to shard()")
    return None


def _attention_modules(model: torch.nn.Module):
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]


def _head_sizes(module, config):
    heads_q = config.num_attention_heads
    heads_kv = getattr(config, "num_key_value_heads", None) or heads_q
    head_dim = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None) or \
        config.hidden_size // heads_q
    head_dim_v = getattr(module, "v_head_dim", None) or head_dim
    return heads_q, heads_kv, head_dim, head_dim_v


def _mask_mix(config) -> list:
    """The model's masks with their layer counts, from config.layer_types and sliding_window (the rows of a
    batch are balanced for it)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not types or not window:
        return []
    full = sum(1 for t in types if t != "sliding_attention")
    sliding = len(types) - full
    return [part for part in (((-1, 0), full), ((int(window) - 1, 0), sliding)) if part[1] > 0]


def configure(model: torch.nn.Module, strategy: str = "auto", group=None, **layer_args) -> spt.DistributedAttention:
    """Gives every attention module of `model` one seqpar layer (DistributedAttention) made on `group`
    (default: the world) with `strategy` and the model's head sizes and mask mix; layer_args go to
    DistributedAttention (ranks_per_node, timeout_s, threads, capacity_factor). Collective: every rank of
    the group calls it. Returns the layer (token_indices, labels, ... of a batch: shard() uses it)."""
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"seqpar.integrations.transformers.configure: model = {type(model).__name__}: has no "
                         "attention module (modules with num_key_value_groups and layer_idx)")
    config = model.config
    shapes = {_head_sizes(m, getattr(m, "config", config)) for m in modules}
    if len(shapes) != 1:
        raise ValueError(f"seqpar.integrations.transformers.configure: the attention modules have head sizes "
                         f"{sorted(shapes)}: one layer serves one (heads_q, heads_kv, head_dim, head_dim_v)")
    heads_q, heads_kv, head_dim, head_dim_v = shapes.pop()
    layer = spt.DistributedAttention(strategy, heads_q, heads_kv, head_dim, group=group, head_dim_v=head_dim_v,
                                     mask_mix=layer_args.pop("mask_mix", None) or _mask_mix(config), **layer_args)
    for m in modules:
        m.seqpar_attention = layer  # a submodule without parameters: state_dict is unchanged
    return layer


def _require_seqpar(model: torch.nn.Module) -> None:
    # A model whose config names another implementation would run it on this rank's rows alone: attention
    # confined to the rank, silently wrong. (from_config sets the implementation on the config object it is
    # given: a config shared with another model can switch this one.)
    name = getattr(model.config, "_attn_implementation", None)
    if name not in _registered_names():
        raise ValueError(f"seqpar.integrations.transformers: model.config._attn_implementation = {name!r}: the model "
                         "does not run seqpar's attention: load it with attn_implementation=\"seqpar\" (after "
                         "register()) or call model.set_attn_implementation(\"seqpar\"); a config object shared "
                         "with another model may have been switched by it")


def _registered_names() -> set:
    """The names seqpar's attention function is registered under."""
    from transformers import AttentionInterface

    return {k for k, fn in AttentionInterface._global_mapping.items() if fn is attention_forward}


def layer_of(model: torch.nn.Module) -> spt.DistributedAttention:
    for m in _attention_modules(model):
        layer = getattr(m, "seqpar_attention", None)
        if layer is not None:
            return layer
    raise ValueError(f"seqpar.integrations.transformers: model = {type(model).__name__}: no seqpar layer: call "
                     "configure(model, strategy, group) first")


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, s_aux=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                      seqpar_doc_counts=None, **kwargs):
    """transformers' attention function: query (1, heads_q, local tokens, head_dim), key and value
    (1, heads_kv, local tokens, head_dim / head_dim_v): this rank's rows of the packed batch whose
    cu_seqlens the model was given (cu_seq_lens_q). Returns ((1, local tokens, heads_q, head_dim_v), None)."""
    layer = getattr(module, "seqpar_attention", None)
    where = f"seqpar (transformers attention, layer {getattr(module, 'layer_idx', '?')})"
    if layer is None:
        raise ValueError(f"{where}: the module has no seqpar layer: call "
                         "seqpar.integrations.transformers.configure(model, strategy, group) after loading the model")
    if cu_seq_lens_q is None:
        raise ValueError(f"{where}: cu_seq_lens_q is missing: pass the packed batch's cu_seqlens to the model "
                         "(model(**shard(model, ids, lengths).model_inputs()) does)")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k,
                                                                                               cu_seq_lens_q):
        raise ValueError(f"{where}: cu_seq_lens_k differs from cu_seq_lens_q: seqpar runs self-attention over one "
                         "packed batch")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{where}: query.shape = {tuple(query.shape)}: must be (1, heads, local tokens, head_dim): "
                         "one packed sequence of this rank's rows")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{where}: key.shape[2] = {key.shape[2]} but query.shape[2] = {query.shape[2]}: a KV cache "
                         "(generation) is not supported; seqpar is for training on packed batches")
    if dropout:
        raise ValueError(f"{where}: dropout = {dropout}: attention dropout is not supported (set "
                         "config.attention_dropout = 0)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, heads, dim) views, no copy
    sinks = None
    if s_aux is not None:
        sinks = s_aux.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    window_size = (int(sliding_window) - 1, 0) if sliding_window else (-1, 0)
    o = layer(q, k, v, cu_seqlens=cu_seq_lens_q, doc_counts=seqpar_doc_counts, softmax_scale=scaling,
              window_size=window_size, sinks=sinks)
    return o.unsqueeze(0), None


@dataclass
class Shard:
    """This rank's part of a packed batch: input_ids and position_ids (1, local tokens), labels (local
    tokens: next-token labels, -100 where none), cu_seqlens (the whole batch's), label_count (the
    labels of the whole batch that count, the same on every rank)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    label_count: int
    rows: torch.Tensor

    def model_inputs(self) -> dict:
        """The keyword arguments of the model's forward (no KV cache: training)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, cu_seq_lens_q=self.cu_seqlens,
                    cu_seq_lens_k=self.cu_seqlens, use_cache=False)


def shard(model_or_layer, input_ids: torch.Tensor, lengths: Sequence[int],
          labels: Optional[torch.Tensor] = None, ignore_index: int = -100) -> Shard:
    """This rank's rows of the packed batch `input_ids` ((T,) or (1, T): every document's tokens in
    order) whose documents have `lengths` tokens. `labels` (same shape; default input_ids) are the
    unshifted targets, -100 where a token is not to be predicted (a masked prompt): the row of token i
    gets labels[i + 1] within its document."""
    if isinstance(model_or_layer, spt.DistributedAttention):
        layer = model_or_layer
    else:
        _require_seqpar(model_or_layer)
        layer = layer_of(model_or_layer)
    ids = input_ids.reshape(-1)
    lengths = [int(n) for n in lengths]
    if sum(lengths) != ids.numel():
        raise ValueError(f"seqpar.integrations.transformers.shard: lengths sum to {sum(lengths)} but input_ids has "
                         f"{ids.numel()} tokens: lengths must be the packed batch's documents, in order")
    targets = ids if labels is None else labels.reshape(-1)
    if targets.numel() != ids.numel():
        raise ValueError(f"seqpar.integrations.transformers.shard: labels has {targets.numel()} tokens, input_ids "
                         f"{ids.numel()}: they must be the same packed batch")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    meta = layer.token_meta(cu_seqlens=cu)
    rows = meta["global_index"]
    local_labels = torch.full(rows.shape, ignore_index, dtype=torch.int64)
    has = meta["label_index"] >= 0
    local_labels[has] = targets[meta["label_index"][has]].to(torch.int64)
    # The labels that count, over the whole batch: every rank sees the global targets, no communication.
    nxt = torch.ones(ids.numel(), dtype=torch.bool)
    nxt[(cu[1:] - 1)] = False  # a document's last token has no next-token label
    shifted = torch.full_like(targets, ignore_index)
    shifted[:-1] = targets[1:]
    count = int(((shifted != ignore_index) & nxt).sum())
    device = input_ids.device
    return Shard(input_ids=ids[rows.to(device)][None], position_ids=meta["position"].to(device)[None],
                 labels=local_labels.to(device), cu_seqlens=cu.to(device), label_count=count, rows=rows)


def loss(logits: torch.Tensor, local: Shard, ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the whole batch's mean next-token loss (its rows' summed cross entropy over
    the batch's label_count); the shares sum to the batch's loss, and the summed gradients to its
    gradient."""
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat, local.labels,
                           reduction="sum", ignore_index=ignore_index) / max(local.label_count, 1)


__all__ = ["NAME", "Shard", "attention_forward", "configure", "layer_of", "loss", "register", "shard"]
