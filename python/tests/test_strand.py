# SPDX-License-Identifier: Apache-2.0
"""The torch op never strands a peer (issue 40, item 4): a refusal of the op's own checks on one rank
only (dtype, strides, head sizes, sinks, window, lengths) reaches every rank at once, through the call's
agreement, never as one rank raising while its peers wait for the timeout; a layer freed before its
backward still runs it; a rank holding no rows takes part in forward and backward of every strategy
(autograd hands it an expanded, zero-stride gradient)."""
import time

from dist_util import run

TIMEOUT_S = 30  # the layer's: a stranded rank would wait this long
PROMPT_S = 15  # a refusal arrives well before it (margin for 2 shared cores under load)


def _one_rank_refuses(rank, world):
    import torch
    import seqpar.torch as spt

    lengths = [[5, 1, 2]]
    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=TIMEOUT_S)
    n = len(attn.token_indices(lengths))
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(n, h, 4, dtype=torch.float64, generator=gen) for h in (2, 1, 1))
    f64 = dict(dtype=torch.float64)
    good = dict(q=q, k=k, v=v, lengths=lengths)
    # (name, what rank 1 passes, words of rank 1's error): rank 0 passes good arguments.
    cases = [
        ("q.dtype", dict(good, q=q.int()), ["q.dtype", "Int"]),
        ("k.dtype", dict(good, k=k.float()), ["k.dtype", "Float"]),
        ("stride", dict(good, q=q.transpose(1, 2)), ["q.stride(2)"]),
        ("head size", dict(good, v=v[..., :3]), ["v.shape[2] = 3"]),
        ("sinks dtype", dict(good, sinks=torch.zeros(2)), ["sinks.dtype", "Float"]),
        ("sinks shape", dict(good, sinks=torch.zeros(3, **f64)), ["sinks.shape"]),
        ("sinks value", dict(good, sinks=torch.tensor([0.0, float("nan")], **f64)), ["sinks[1]"]),
        ("sinks type", dict(good, sinks=[0.0, 0.0]), ["sinks", "list"]),
        ("window", dict(good, window_size=(3, 1)), ["window_size", "right must be 0"]),
        ("lengths", dict(good, lengths=[[5, 0, 3]]), ["lengths[0][1] = 0"]),
        ("scale", dict(good, softmax_scale=-1.0), ["softmax_scale"]),
        ("rows", dict(good, q=q[:-1], k=k[:-1], v=v[:-1]), ["q.shape[0]"]),
    ]
    out = []
    for name, bad, words in cases:
        args = bad if rank == 1 else good
        start = time.monotonic()
        try:
            attn(args["q"], args["k"], args["v"], args["lengths"], sinks=args.get("sinks"),
                 window_size=args.get("window_size", (-1, 0)), softmax_scale=args.get("softmax_scale"))
            what, kind = "no error", None
        except (ValueError, TypeError, RuntimeError) as e:
            what, kind = str(e), type(e).__name__
        took = time.monotonic() - start
        out.append((name, kind, what, took, words))
    # Rank 1 runs another dtype than rank 0 (both valid): the ranks disagree on the element type.
    start = time.monotonic()
    try:
        attn(*((x.float() if rank == 1 else x) for x in (q, k, v)), lengths)
        what, kind = "no error", None
    except RuntimeError as e:
        what, kind = str(e), type(e).__name__
    out.append(("element type", kind, what, time.monotonic() - start, ["element type", "85308 vs 42404"]))
    # Sinks on rank 1 only: the ranks disagree on whether the call has sinks.
    start = time.monotonic()
    try:
        attn(q, k, v, lengths, sinks=torch.zeros(2, **f64) if rank == 1 else None)
        what, kind = "no error", None
    except RuntimeError as e:
        what, kind = str(e), type(e).__name__
    out.append(("sinks on one rank", kind, what, time.monotonic() - start, ["attention sinks"]))
    # The layer still works afterwards: the ranks stayed in step.
    o = attn(q, k, v, lengths)
    assert o.shape == q.shape
    return out


def test_one_rank_refusing_makes_every_rank_raise_at_once():
    results = run(_one_rank_refuses, 2, timeout=180)
    for (name, kind0, what0, took0, _), (name1, kind1, what1, took1, words) in zip(results[0], results[1]):
        assert name == name1
        assert kind1 is not None, f"{name}: rank 1 accepted"
        assert kind0 == "RuntimeError", f"{name}: rank 0 got {kind0}: {what0}"
        for w in words:
            assert w in what1 or w in what0, f"{name}: {w!r} not in {what1!r} / {what0!r}"
        if name not in ("element type", "sinks on one rank"):
            assert kind1 in ("ValueError", "TypeError"), (name, kind1, what1)
            # The peer names the refusing rank and its reason.
            assert "rank 1 refused its arguments before any communication" in what0, (name, what0)
            # In the op's terms, the engine's own refusal relayed by the peer too (q.shape[0], not q.tokens).
            assert words[0] in what0, (name, what0)
            assert ".tokens" not in what0 and "DistributedAttention::" not in what0, (name, what0)
        assert took0 < PROMPT_S and took1 < PROMPT_S, (name, took0, took1, what0)


def _freed_before_backward(rank, world):
    import gc

    import torch
    import seqpar.torch as spt
    from reference import explicit, relative_error

    lengths = [[6, 3, 7]]
    total = sum(lengths[0])
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(total, h, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=TIMEOUT_S)
    rows = attn.token_indices(lengths)
    lq, lk, lv = (x[rows].clone().requires_grad_(True) for x in (q, k, v))
    o = attn(lq, lk, lv, lengths)
    if rank == 1:  # the module goes away on one rank only, its graph does not
        del attn
        gc.collect()
    start = time.monotonic()
    o.backward(do[rows])
    took = time.monotonic() - start
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_ref, _ = explicit(*ref, lengths)
    grads = torch.autograd.grad(o_ref, ref, do)
    err = max(relative_error(g, r[rows]) for g, r in zip((lq.grad, lk.grad, lv.grad), grads))
    return err, took


def test_a_layer_freed_before_its_backward_still_runs_it():
    for err, took in run(_freed_before_backward, 2, timeout=120):
        assert err < 1e-10
        assert took < PROMPT_S


def _no_rows(rank, world):
    import torch
    import seqpar.torch as spt
    from reference import explicit, relative_error

    lengths = [[1, 2]]  # 3 tokens on 2 ranks: most strategies leave one rank 1 row, some none
    total = 3
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(total, h, 4, generator=gen, dtype=torch.float64) for h in (2, 2, 2))
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_ref, _ = explicit(*ref, lengths)
    grads = torch.autograd.grad(o_ref.sum(), ref)
    out = {}
    for name in spt.STRATEGIES:
        attn = spt.DistributedAttention(name, 2, 2, 4, timeout_s=TIMEOUT_S)
        for tokens in ([[1]], lengths):
            rows = attn.token_indices(tokens)
            n = sum(sum(s) for s in tokens)
            lq, lk, lv = (x[:n][rows].clone().requires_grad_(True) for x in (q, k, v))
            o = attn(lq, lk, lv, tokens)
            o.sum().backward()  # a rank with no rows gets an expanded (0, 2, 4) gradient of stride 0
            if tokens is lengths:
                err = max(relative_error(o, o_ref[rows]),
                          *(relative_error(g, r[rows]) for g, r in zip((lq.grad, lk.grad, lv.grad), grads)))
            else:
                err = 0.0 if len(rows) == 0 or o.shape[0] == 1 else 1.0
            out[(name, len(tokens[0]))] = (len(rows), err)
    return out


def test_a_rank_with_no_rows_takes_part_in_every_strategy():
    results = run(_no_rows, 2, timeout=240)
    for name_docs in results[0]:
        rows = [r[name_docs][0] for r in results]
        if name_docs[1] == 1:  # the one-token batch: one rank holds it, the other none
            assert sorted(rows) == [0, 1], (name_docs, rows)
        for r in results:
            assert r[name_docs][1] < 1e-10, (name_docs, r[name_docs])


def _swapped_layers(rank, world):
    import torch
    import seqpar.torch as spt

    lengths = [[5, 1, 2]]
    a = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=TIMEOUT_S)
    b = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=TIMEOUT_S)
    n = len(a.token_indices(lengths))
    q, k, v = (torch.randn(n, h, 4, dtype=torch.float64) for h in (2, 1, 1))
    first, second = (b, a) if rank == 1 else (a, b)
    start = time.monotonic()
    try:
        first(q, k, v, lengths)
        second(q, k, v, lengths)
        what = "no error"
    except RuntimeError as e:
        what = str(e)
    took = time.monotonic() - start
    a(q, k, v, lengths)  # in order: both layers still work
    b(q, k, v, lengths)
    return what, took


def test_two_layers_called_in_different_orders_raise_on_every_rank():
    for what, took in run(_swapped_layers, 2, timeout=120):
        assert "disagree on the layer" in what, what
        assert took < PROMPT_S
