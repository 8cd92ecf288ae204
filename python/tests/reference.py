# SPDX-License-Identifier: Apache-2.0
"""The single-device truth: torch's own SDPA over the whole packed batch with a block-diagonal causal
mask, the definition written out (value heads of their own size, attention sinks), and the random
long-tail document mixes the tests run on."""
import random

import torch
import torch.nn.functional as F


def doc_mask(lengths, window=0):
    """(T, T) bool: token i sees token j iff they are in the same document and j <= i (and, with a
    sliding window of `window` keys, i - j < window)."""
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(d for s in lengths for d in s)])
    same = doc[:, None] == doc[None, :]
    mask = same & torch.ones_like(same).tril()
    if window > 0:
        mask = mask & ~torch.ones_like(same).tril(-window)
    return mask


def sdpa(q, k, v, lengths):
    """q (T, Hq, D), k/v (T, Hkv, D) of the whole batch -> o (T, Hq, D) and lse (Hq, T)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = doc_mask(lengths)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    scores = (q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2)) / q.shape[2] ** 0.5
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return o.transpose(0, 1), lse


def explicit(q, k, v, lengths, sinks=None, window=0, scale=None):
    """The definition written out, for value heads of their own size and attention sinks: q, k (T, H, D),
    v (T, Hkv, Dv) of the whole batch, sinks (Hq,) or None -> o (T, Hq, Dv), lse (Hq, T). Scores q.k /
    sqrt(D) under the document-causal mask; each query head's sink logit appended as one more column
    of every row (a softmax term with no value); softmax over the row; o = P v over the key columns.
    scale: the softmax scale (None: 1 / sqrt(D))."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, T, D)
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, T, Dv)
    scale = d ** -0.5 if scale is None else scale
    scores = (q.transpose(0, 1) @ kh.transpose(1, 2)) * scale  # (Hq, T, T)
    scores = scores.masked_fill(~doc_mask(lengths, window), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(hq, t, 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    o = p[..., :t] @ vh
    return o.transpose(0, 1), lse


def long_tail(seed, sequences=2, tokens=40):
    """Sequences of `tokens` tokens cut into lognormal documents, with length-1 documents mixed in."""
    rng = random.Random(seed)
    out = []
    for _ in range(sequences):
        docs, left = [], tokens
        while left > 0:
            n = 1 if rng.random() < 0.25 else max(1, int(rng.lognormvariate(2.0, 1.0)))
            docs.append(min(n, left))
            left -= docs[-1]
        out.append(docs)
    return out


def relative_error(got, want):
    """max |got - want| / max(1, max |want|) in float64 (0 for empty tensors): the error every test reports."""
    if not got.numel():
        return 0.0
    return (got.double() - want).abs().max().item() / max(1.0, want.abs().max().item())
