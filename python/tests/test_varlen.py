# SPDX-License-Identifier: Apache-2.0
"""seqpar.torch.varlen_attention, the op in FlashAttention's varlen form: the batch as tensors
(cu_seqlens over the whole packed batch, doc_counts per sequence), the softmax scale and the window per
call, against the definition in float64 on 1 and 2 processes; torch.compile(fullgraph=True) over batches
whose document count changes every step (at most 2 compilations, equal to eager); the layer as a module
attribute (deepcopy, torch.save / torch.load, repr with what "auto" chose); the strategy names
seqpar-plan prints; messages in the op's terms."""
import pytest
import torch

from dist_util import run

TOL = 1e-10
VARLEN_STRATEGIES = [("ulysses", 0), ("zigzag-ring-aware", 0), ("hybrid-aware", 0), ("basp", 0),
                     ("per-doc-aware", 0), ("whole-doc", 0), ("auto", 1)]


def _cu(lengths, dtype):
    import torch

    docs = [d for s in lengths for d in s]
    cu = torch.zeros(len(docs) + 1, dtype=dtype)
    cu[1:] = torch.tensor(docs).cumsum(0)
    return cu, torch.tensor([len(s) for s in lengths], dtype=dtype)


def _varlen_exact(rank, world):
    import torch
    import seqpar.torch as spt
    from reference import explicit, long_tail, relative_error

    hq, hkv, d, dv = 4, 2, 8, 6
    errors = {}
    for name, rpn in VARLEN_STRATEGIES:
        # whole-doc keeps documents whole: a capacity of every token lets it take the long-tail mixes.
        attn = spt.DistributedAttention(name, hq, hkv, d, head_dim_v=dv, ranks_per_node=rpn, timeout_s=60,
                                        mask_mix=[((-1, 0), 1), ((4, 0), 1)],
                                        capacity_factor=float(world) if name == "whole-doc" else None)
        for seed, scale, window in ((1, None, (-1, 0)), (2, 0.61, (4, 0)), (3, 1.9 / d ** 0.5, (-1, 0))):
            lengths = long_tail(seed, sequences=1 + seed % 2, tokens=24)
            cu, counts = _cu(lengths, torch.int32 if seed % 2 else torch.int64)
            total = int(cu[-1])
            gen = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(total, h, e, generator=gen, dtype=torch.float64)
                       for h, e in ((hq, d), (hkv, d), (hkv, dv)))
            do = torch.randn(total, hq, dv, generator=gen, dtype=torch.float64)
            sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if seed == 3 else None
            for x in (q, k, v):
                x.requires_grad_(True)
            w = 0 if window[0] < 0 else window[0] + 1
            o_ref, lse_ref = explicit(q, k, v, lengths, sinks=sinks, window=w, scale=scale)
            dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q, k, v), do)

            rows = attn.token_indices(cu_seqlens=cu, doc_counts=counts)
            assert torch.equal(rows, attn.token_indices(lengths))  # the two forms of one batch
            lq, lk, lv = (x.detach()[rows].clone().requires_grad_(True) for x in (q, k, v))
            o, lse = spt.varlen_attention(lq, lk, lv, cu, max(max(s) for s in lengths), layer=attn,
                                          softmax_scale=scale, window_size=window, sinks=sinks, return_lse=True,
                                          doc_counts=counts)
            o.backward(do[rows])
            got = {"o": (o, o_ref[rows]), "lse": (lse, lse_ref[:, rows]), "dq": (lq.grad, dq_ref[rows]),
                   "dk": (lk.grad, dk_ref[rows]), "dv": (lv.grad, dv_ref[rows])}
            for what, (a, b) in got.items():
                err = relative_error(a, b)
                errors[(name, seed, what)] = err
    return errors


@pytest.mark.parametrize("world", [1, 2])
def test_varlen_matches_definition(world):
    for rank, errors in enumerate(run(_varlen_exact, world, timeout=300)):
        assert len(errors) == len(VARLEN_STRATEGIES) * 3 * 5
        bad = {key: err for key, err in errors.items() if not err < TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"


def _scale_is_used(rank, world):
    """A scale that is not 1/sqrt(d) changes the result (the argument is not ignored), and a second scale
    on one layer gets its own engine, not the first one's."""
    import torch
    import seqpar.torch as spt

    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=60)
    cu = torch.tensor([0, 5, 6, 12])
    rows = attn.token_indices(cu_seqlens=cu)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(12, h, 4, generator=gen, dtype=torch.float64)[rows] for h in (2, 1, 1))
    a = attn(q, k, v, cu_seqlens=cu)
    b = attn(q, k, v, cu_seqlens=cu, softmax_scale=1.7)
    c = attn(q, k, v, cu_seqlens=cu, softmax_scale=0.5)  # 1 / sqrt(4): the default's value
    return (a - b).abs().max().item(), (a - c).abs().max().item()


def test_softmax_scale_is_per_call():
    for differs, same in run(_scale_is_used, 2):
        assert differs > 1e-3 and same < 1e-14, (differs, same)


def _compile_across_batches(rank, world, steps):
    import torch
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    import seqpar.torch as spt

    torch._dynamo.reset()
    compilations = [0]

    def counting(gm, example_inputs):
        compilations[0] += 1
        return aot_eager(gm, example_inputs)

    hq, hkv, d, width = 2, 1, 8, 16
    torch.manual_seed(0)
    proj = torch.nn.Linear(width, (hq + 2 * hkv) * d, dtype=torch.float64)
    attn = spt.DistributedAttention("hybrid-aware", hq, hkv, d, timeout_s=60)

    def step(x, cu_seqlens, doc_counts):
        qkv = proj(x).view(x.shape[0], hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        o = spt.varlen_attention(q, k, v, cu_seqlens, layer=attn, doc_counts=doc_counts,
                                 window_size=(5, 0))
        return (o * o).sum()

    compiled = torch.compile(step, fullgraph=True, backend=counting)
    import random

    rng = random.Random(11)
    worst = 0.0
    counts = []
    for i in range(steps):
        # A new document count (and token count) every step, as a data loader gives; two sequences per
        # batch (doc_counts' length: a dimension of size 1 would be specialised by dynamo, as any).
        sequences = 2
        lengths = [[rng.randint(1, 9) for _ in range(rng.randint(1, 6) + i % 5)] for _ in range(sequences)]
        cu, per_seq = _cu(lengths, torch.int32)
        counts.append(len(cu) - 1)
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(int(cu[-1]), width, generator=gen, dtype=torch.float64)
        rows = attn.token_indices(cu_seqlens=cu, doc_counts=per_seq)
        results = []
        for fn in (step, compiled):
            proj.zero_grad()
            loss = fn(x[rows], cu, per_seq)
            loss.backward()
            results.append((loss.detach(), proj.weight.grad.clone()))
        (le, ge), (lc, gc) = results
        worst = max(worst, (le - lc).abs().item(), (ge - gc).abs().max().item())
    return compilations[0], worst, len(set(counts))


@pytest.mark.parametrize("world", [1, 2])
def test_torch_compile_does_not_recompile_per_batch(world):
    for compilations, worst, distinct in run(_compile_across_batches, world, 20, timeout=300):
        assert distinct >= 8, distinct  # the batches really differ in document count
        assert compilations <= 2, f"{compilations} compilations over 20 batches"
        assert worst < 1e-12, worst


class _Model(torch.nn.Module):
    def __init__(self):
        import seqpar.torch as spt

        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.attn = spt.DistributedAttention("auto", 2, 2, 4, ranks_per_node=1, timeout_s=60,
                                             mask_mix=[((-1, 0), 2), ((3, 0), 1)])

    def forward(self, x, cu):
        qkv = self.proj(x).view(-1, 2, 4)
        return self.attn(qkv, qkv, qkv, cu_seqlens=cu, window_size=(3, 0))


def _module_attribute(rank, world):
    import copy
    import io
    import pickle

    model = _Model()
    cu = torch.tensor([0, 7, 9, 20, 21])
    rows = model.attn.token_indices(cu_seqlens=cu)
    x = torch.randn(21, 8, dtype=torch.float64)[rows]
    before_repr = repr(model.attn)
    want = model(x, cu)
    after_repr = repr(model.attn)
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    results = {name: (m(x, cu) - want).abs().max().item() for name, m in (("deepcopy", twin), ("torch.load", loaded))}
    same_group = twin.attn.group is model.attn.group
    pickled = pickle.loads(pickle.dumps(model.attn))
    return (results, same_group, before_repr, after_repr, model.attn.chosen(cu_seqlens=cu), repr(pickled),
            twin.attn.strategy, loaded.attn.heads_q)


def test_layer_is_a_module_attribute():
    for results, same_group, before, after, chosen, pickled, strategy, heads in run(_module_attribute, 2):
        assert all(err == 0.0 for err in results.values()), results
        assert same_group
        assert "strategy='auto'" in before and "chose" not in before, before
        assert f"chose='{chosen}'" in after and chosen in _plan_names(), (after, chosen)
        assert "mask_mix=[((-1, 0), 2), ((3, 0), 1)]" in after, after
        assert "strategy='auto'" in pickled and strategy == "auto" and heads == 2


def _plan_names():
    import seqpar._C as C

    return C.plan_names()


def test_strategy_names_are_seqpar_plans():
    # One list: the op's strategies are seqpar-plan's candidates (plan::standard_candidates), and "auto".
    import seqpar.torch as spt

    assert list(spt.STRATEGIES) == _plan_names() + ["auto"]


def _messages(rank, world):
    import pytest
    import torch
    import seqpar.torch as spt

    said = {}

    def message(exc, fn):
        with pytest.raises(exc) as info:
            fn()
        return str(info.value)

    # Ranks that make the layer with different strategies: named on every rank, at construction.
    said["strategy"] = message(ValueError, lambda: spt.DistributedAttention(
        "ulysses" if rank == 0 else "zigzag-ring", 2, 1, 4, timeout_s=20))
    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=20)
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    n = len(attn.token_indices(cu_seqlens=cu))
    q, k, v = (torch.randn(n, h, 4, dtype=torch.float64) for h in (2, 1, 1))
    # Rows of another batch (both ranks): the rows this rank holds, in the op's terms.
    said["rows"] = message(ValueError, lambda: attn(q[:-1], k[:-1], v[:-1], cu_seqlens=cu))
    said["cu0"] = message(ValueError, lambda: attn(q, k, v, cu_seqlens=torch.tensor([1, 5, 6, 14])))
    said["cu_order"] = message(ValueError, lambda: attn(q, k, v, cu_seqlens=torch.tensor([0, 5, 5, 14])))
    said["cu_dtype"] = message(ValueError, lambda: attn(q, k, v, cu_seqlens=torch.tensor([0.0, 5.0, 14.0])))
    said["counts"] = message(ValueError, lambda: attn(q, k, v, cu_seqlens=cu, doc_counts=torch.tensor([1, 1])))
    said["scale"] = message(ValueError, lambda: attn(q, k, v, cu_seqlens=cu, softmax_scale=-1.0))
    said["both"] = message(ValueError, lambda: attn(q, k, v, [5, 1, 8], cu_seqlens=cu))
    said["dtype"] = message(ValueError, lambda: attn(q, k.float(), v, cu_seqlens=cu))
    o = attn(q, k, v, cu_seqlens=cu)  # the layer still works
    assert o.shape == (n, 2, 4)
    return said


def test_messages_in_the_ops_terms():
    for rank, said in enumerate(run(_messages, 2, timeout=120)):
        assert "strategy = " in said["strategy"] and "'ulysses'" in said["strategy"], said["strategy"]
        assert "'zigzag-ring'" in said["strategy"] and "rank 0" in said["strategy"], said["strategy"]
        rows = said["rows"]
        assert "q.shape[0]" in rows and "token_indices" in rows and "q.tokens" not in rows, rows
        assert "cu_seqlens[0] = 1" in said["cu0"], said["cu0"]
        assert "cu_seqlens[2] = 5" in said["cu_order"] and "at least one token" in said["cu_order"], said["cu_order"]
        assert "cu_seqlens.dtype" in said["cu_dtype"], said["cu_dtype"]
        assert "doc_counts" in said["counts"], said["counts"]
        assert "softmax_scale = -1" in said["scale"], said["scale"]
        assert "lengths and cu_seqlens" in said["both"], said["both"]
        assert "k.dtype" in said["dtype"] and "Float" in said["dtype"], said["dtype"]


def _sft_label_count(rank, world):
    import torch
    import seqpar.torch as spt

    lengths = [[6, 3, 7]]
    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=20)
    labels = torch.arange(16)
    labels[:4] = -100  # a masked prompt
    labels[9:11] = -100
    local = attn.labels(labels, lengths)
    return spt.label_count(labels=local), spt.label_count(lengths)


def test_label_count_skips_ignored_labels():
    # 16 tokens in documents [0, 6), [6, 9), [9, 16): 13 next-token labels. Masked: the labels 1, 2, 3
    # (targets of tokens 0-2) and 10 (of token 9); label 9 is no token's target (its document's first).
    for masked, every in run(_sft_label_count, 2):
        assert every == 13
        assert masked == 13 - 3 - 1, masked
