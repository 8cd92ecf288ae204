# SPDX-License-Identifier: Apache-2.0
"""A two-process fuzz of the torch op's arguments (issue 40, item 6): each case draws a batch, a window, a
scale, sinks and value head size shared by both ranks, then maybe one mistake on one rank (a bad dtype,
stride, head size, sinks, window, lengths, scale or row count) or two valid but different arguments on the
two ranks (dtype, window, scale, sinks' values). What must happen is decided here: no mistake, the fp64
definition's answer (forward and backward); a mistake, every rank raises within the case's time limit
(the rank at fault ValueError or TypeError naming the argument, its peer RuntimeError), and the layer
keeps working for the next case."""
import random
import time

from dist_util import run

CASES = 24
CASE_LIMIT_S = 10  # a refusal reaches both ranks well inside the layer's timeout (30 s)

MISTAKES = ["q.dtype", "k.dtype", "stride", "v.shape", "sinks.shape", "sinks.dtype", "sinks value", "window",
            "lengths", "softmax_scale", "rows"]
DISAGREEMENTS = ["dtype", "window", "scale", "sinks values"]


def _fuzz(rank, world, seed):
    import torch
    import seqpar.torch as spt
    from reference import explicit, relative_error

    f64 = dict(dtype=torch.float64)
    layers = {}
    outcomes = []
    for case in range(CASES):
        rng = random.Random(seed * 1000 + case)  # the same draws on both ranks
        hkv = rng.choice([1, 2])
        hq = hkv * rng.choice([1, 2])
        dv = rng.choice([4, 3, 6])
        key = (hq, hkv, dv)
        if key not in layers:
            layers[key] = spt.DistributedAttention("zigzag-ring", hq, hkv, 4, head_dim_v=dv, timeout_s=30)
        attn = layers[key]
        # A first document of 4 or more tokens: each rank holds rows (a rank without rows has no strides
        # or rows to get wrong; test_strand.py runs that case).
        lengths = [[rng.randint(4, 9)] + [rng.randint(1, 9) for _ in range(rng.randint(0, 2))]]
        total = sum(lengths[0])
        window = rng.choice([-1, rng.randint(0, 6), 2 ** 62])  # FlashAttention's left: -1 none, w - 1 keys
        scale = rng.choice([None, 0.3])
        sinks = None
        if rng.random() < 0.5:
            sinks = torch.tensor([rng.gauss(0, 2) for _ in range(hq)], **f64)
            if rng.random() < 0.3:
                sinks[rng.randrange(hq)] = float("-inf")
        gen = torch.Generator().manual_seed(case)
        q, k = (torch.randn(total, h, 4, generator=gen, **f64) for h in (hq, hkv))
        v = torch.randn(total, hkv, dv, generator=gen, **f64)
        do = torch.randn(total, hq, dv, generator=gen, **f64)
        rows = attn.token_indices(lengths)
        args = dict(q=q[rows], k=k[rows], v=v[rows], lengths=lengths, sinks=sinks, window_size=(window, 0),
                    softmax_scale=scale)
        kind = rng.choice(["none", "none", "mistake", "disagree"])
        what = rng.choice(MISTAKES if kind == "mistake" else DISAGREEMENTS)
        at_fault = rng.randrange(world)
        if kind == "mistake" and rank == at_fault:
            a = args
            if what == "q.dtype":
                a["q"] = a["q"].int()
            elif what == "k.dtype":
                a["k"] = a["k"].float()
            elif what == "stride":
                pass  # below: a view the clone would make contiguous
            elif what == "v.shape":
                a["v"] = torch.randn(len(rows), hkv, dv + 1, **f64)
            elif what == "sinks.shape":
                a["sinks"] = torch.zeros(hq + 1, **f64)
            elif what == "sinks.dtype":
                a["sinks"] = torch.zeros(hq)
            elif what == "sinks value":
                a["sinks"] = torch.full((hq,), float("nan"), **f64)
            elif what == "window":
                a["window_size"] = (window, 1)
            elif what == "lengths":
                a["lengths"] = [lengths[0] + [0]]
            elif what == "softmax_scale":
                a["softmax_scale"] = -1.0
            elif what == "rows":
                a["q"], a["k"], a["v"] = (torch.cat([x, x[:1]]) for x in (a["q"], a["k"], a["v"]))
        if kind == "disagree" and rank == at_fault:
            a = args
            if what == "dtype":
                a["q"], a["k"], a["v"] = (x.float() for x in (a["q"], a["k"], a["v"]))
                a["sinks"] = None if sinks is None else sinks.float()
            elif what == "window":
                a["window_size"] = (window + 1 if window >= 0 else 0, 0)
            elif what == "scale":
                a["softmax_scale"] = 0.7  # (None is 1 / sqrt(4) = 0.5)
            elif what == "sinks values":
                a["sinks"] = (torch.zeros(hq, **f64) if sinks is None
                              else torch.where(torch.isinf(sinks), torch.zeros_like(sinks), sinks + 1.0))
        lq, lk, lv = (x.clone().requires_grad_(x.is_floating_point()) for x in (args["q"], args["k"], args["v"]))
        if kind == "mistake" and what == "stride" and rank == at_fault:
            lq = torch.randn(len(rows), hq, 8, **f64, requires_grad=True)[..., ::2]  # head_dim stride 2
        start = time.monotonic()
        try:
            o = attn(lq, lk, lv, args["lengths"], sinks=args["sinks"], window_size=args["window_size"],
                     softmax_scale=args["softmax_scale"])
            o.backward(do[rows][: o.shape[0]] if o.dtype == torch.float64 else do[rows].float())
            got = "ok"
        except (ValueError, TypeError, RuntimeError) as e:
            got = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        err = None
        if got == "ok" and kind == "none":
            ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
            w = 0 if window < 0 else window + 1
            o_ref, _ = explicit(*ref, lengths, sinks=sinks, window=w, scale=scale)
            grads = torch.autograd.grad(o_ref, ref, do)
            err = max(relative_error(o, o_ref[rows]),
                      *(relative_error(g, r[rows]) for g, r in zip((lq.grad, lk.grad, lv.grad), grads)))
        outcomes.append((case, kind, what, at_fault, got, took, err))
    return outcomes


def test_two_process_fuzz_of_the_op_arguments():
    seed = 40
    results = run(_fuzz, 2, seed, timeout=300)
    seen = {"none": 0, "mistake": 0, "disagree": 0}
    for r0, r1 in zip(*results):
        case, kind, what, at_fault = r0[:4]
        seen[kind] += 1
        for rank, (_, _, _, _, got, took, err) in enumerate((r0, r1)):
            where = f"case {case} ({kind} {what} on rank {at_fault}), rank {rank}: {got}"
            assert took < CASE_LIMIT_S, where + f" took {took:.1f} s"
            if kind == "none":
                assert got == "ok", where
                assert err < 1e-10, where + f": error {err}"
            elif kind == "mistake" and rank == at_fault:
                assert got.startswith(("ValueError", "TypeError")), where
            elif kind == "mistake":
                assert got.startswith("RuntimeError") and f"rank {at_fault} refused" in got, where
            else:
                assert got.startswith("RuntimeError") and "disagree on" in got, where
    assert all(n > 0 for n in seen.values()), seen
