# SPDX-License-Identifier: Apache-2.0
# The README's "torch-ddp" recipe, run as written on 4 gloo processes (2 data-parallel x 2 context-parallel)
# by test_readme_recipes.py; around it, a one-attention-layer model fed each data-parallel replica's own
# batch, and the one-process reference: the mean over the replicas of their whole batches' gradients.
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import explicit

torch.set_default_dtype(torch.float64)
dp, cp, heads_q, heads_kv, head_dim, width, vocab = 2, 2, 4, 2, 8, 16, 32
batches = [[9, 1, 14, 4, 20, 3, 5], [6, 6, 2, 30, 4, 8]]
tokens = [torch.randint(0, vocab, (sum(b),), generator=torch.Generator().manual_seed(i)) for i, b in enumerate(batches)]


class Model(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.Linear(width, (heads_q + 2 * heads_kv) * head_dim)
        self.head = torch.nn.Linear(heads_q * head_dim, vocab)

    def forward(self, ids, cu_seqlens, attend=None):
        t = self.qkv(self.embed(ids)).view(ids.shape[0], heads_q + 2 * heads_kv, head_dim)
        q, k, v = t[:, :heads_q], t[:, heads_q:heads_q + heads_kv], t[:, heads_q + heads_kv:]
        if attend is None:  # seqpar: a sliding window of 128 keys and DeepSeek-V3's softmax scale
            o = spt.varlen_attention(q, k, v, cu_seqlens, layer=self.attn, window_size=(127, 0), softmax_scale=0.61)
        else:
            o = attend(q, k, v)
        return self.head(o.reshape(ids.shape[0], -1))


def cumulative(lengths):
    return torch.tensor([0] + lengths).cumsum(0)


def next_token_labels(ids, lengths):
    target = torch.full_like(ids, -100)
    target[:-1] = ids[1:]
    target[torch.tensor(lengths).cumsum(0) - 1] = -100
    return target


torch.manual_seed(0)
# BEGIN README: torch-ddp
import seqpar.torch as spt
from torch.distributed.device_mesh import init_device_mesh

mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
cp_group = mesh["cp"].get_group()          # the context-parallel ranks share one packed batch
attn = spt.DistributedAttention("hybrid-aware", heads_q, heads_kv, head_dim, group=cp_group,
                                mask_mix=[((127, 0), 1)])   # every layer: a window of 128 keys
model = torch.nn.parallel.DistributedDataParallel(Model(attn))   # over every rank: dp x cp
lengths = batches[mesh.get_local_rank("dp")]   # this replica's batch: its documents' lengths
cu_seqlens = torch.tensor([0] + lengths).cumsum(0)   # FlashAttention's varlen form, a tensor
rows = attn.token_indices(cu_seqlens=cu_seqlens)
ids = tokens[mesh.get_local_rank("dp")]
labels = attn.labels(ids, cu_seqlens=cu_seqlens)
logits = model(ids[rows], cu_seqlens)      # inside: spt.varlen_attention(q, k, v, cu_seqlens, layer=attn, ...)
loss = F.cross_entropy(logits, labels, reduction="sum") / spt.label_count(labels=labels, group=cp_group)
(loss * spt.data_parallel_loss_scale(cp_group)).backward()   # DDP's average is then the batch's gradient
# END README

got = {n: p.grad.clone() for n, p in model.module.named_parameters()}
reference = Model(None)
reference.load_state_dict(model.module.state_dict())
for lengths, ids in zip(batches, tokens):
    logits = reference(ids, None, lambda q, k, v: explicit(q, k, v, [lengths], window=128, scale=0.61)[0])
    target = next_token_labels(ids, lengths)
    (F.cross_entropy(logits, target, reduction="sum") / int((target != -100).sum()) / dp).backward()
result = {n: ((got[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in reference.named_parameters()}
