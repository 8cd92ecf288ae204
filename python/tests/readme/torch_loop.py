# SPDX-License-Identifier: Apache-2.0
# The README's "torch-loop" recipe, run as written on the gloo processes of test_readme_recipes.py (the
# region between the markers is what the README shows, checked byte for byte by docs.readme_recipes);
# around it, a one-attention-layer model and its one-process reference (float64).
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import explicit

torch.set_default_dtype(torch.float64)
heads_q, heads_kv, head_dim, width, vocab = 4, 2, 8, 16, 32
lengths = [[9, 1, 14, 4], [20, 3, 5]]
ids = torch.randint(0, vocab, (sum(map(sum, lengths)),), generator=torch.Generator().manual_seed(1))
torch.manual_seed(0)
model = torch.nn.ModuleDict(dict(embed=torch.nn.Embedding(vocab, width),
                                 qkv=torch.nn.Linear(width, (heads_q + 2 * heads_kv) * head_dim),
                                 head=torch.nn.Linear(heads_q * head_dim, vocab)))
embed = model["embed"]


def qkv(x):
    t = model["qkv"](x).view(x.shape[0], heads_q + 2 * heads_kv, head_dim)
    return t[:, :heads_q], t[:, heads_q:heads_q + heads_kv], t[:, heads_q + heads_kv:]


def rope(x, pos):
    half = x.shape[-1] // 2
    angle = pos[:, None, None] * 0.1 ** torch.arange(half)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)


def head(o):
    return model["head"](o.reshape(o.shape[0], -1))


# BEGIN README: torch-loop
import seqpar.torch as spt                                    # after dist.init_process_group("gloo")
attn = spt.DistributedAttention("zigzag-ring", heads_q, heads_kv, head_dim)   # a seqpar-plan name
rows = attn.token_indices(lengths)         # lengths: the packed batch's document lengths
x = embed(ids[rows])                       # this rank's tokens only
pos = attn.positions(lengths)              # RoPE positions within each document
q, k, v = qkv(x)                           # (local tokens, heads, head_dim) each
o = attn(rope(q, pos), rope(k, pos), v, lengths)   # (local tokens, heads, head_dim), differentiable
labels = attn.labels(ids, lengths)         # next tokens across cuts; -100 at document ends
loss = F.cross_entropy(head(o), labels, reduction="sum") / spt.label_count(lengths)
loss.backward()
for p in model.parameters(): dist.all_reduce(p.grad)   # sum, not average
# END README

got = {n: p.grad.clone() for n, p in model.named_parameters()}
total = loss.detach().clone()
dist.all_reduce(total)
model.zero_grad()
pos_all = torch.cat([torch.arange(n) for s in lengths for n in s]).to(torch.get_default_dtype())
q_all, k_all, v_all = qkv(embed(ids))
o_all, _ = explicit(rope(q_all, pos_all), rope(k_all, pos_all), v_all, lengths)
target = torch.full_like(ids, -100)
target[:-1] = ids[1:]
target[torch.tensor([n for s in lengths for n in s]).cumsum(0) - 1] = -100
want = F.cross_entropy(head(o_all), target, reduction="sum") / int((target != -100).sum())
want.backward()
result = {"loss": abs(total.item() - want.item()),
          **{n: (got[n] - p.grad).abs().max().item() for n, p in model.named_parameters()}}
