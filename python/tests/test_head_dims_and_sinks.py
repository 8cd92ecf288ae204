# SPDX-License-Identifier: Apache-2.0
"""Value heads of their own size (head_dim_v: MLA's 192/128, here 24/16) and attention sinks (gpt-oss:
one logit per query head, a softmax term with no value) through seqpar.torch.DistributedAttention,
against the definition written out in fp64 (reference.explicit: explicit softmax with the sink column
appended, document-causal mask from the packed lengths): o, lse, dq, dk, dv and d(sinks) on 1 and 2
gloo processes for four strategies, in float64 (1e-10), float32 and bfloat16 (CpuFlash<bf16>); and
gradcheck and torch.compile of the op with both."""
import pytest

from dist_util import run

STRATEGIES = ["ulysses", "zigzag-ring", "hybrid-aware", "basp"]
# (head_dim, head_dim_v, with sinks): unequal sizes with and without sinks, and sinks at one size.
CASES = [(24, 16, True), (24, 16, False), (16, 16, True)]
# Relative to max(1, largest reference value). float32: CpuFlash<float> accumulates in fp32 over rows of
# at most 40 keys. bfloat16: the tolerances of test_attention.py's bf16 test (8 significant bits; the
# reference reads the same bf16-rounded q, k, v, dout).
TOLERANCE = {"float64": (1e-10, 1e-10), "float32": (1e-5, 1e-4), "bfloat16": (1e-2, 2e-2)}


def _sinks(torch, hq, seed):
    """Logits comparable with the rows' scores, one large (most of its softmax) and one -inf (no sink)."""
    gen = torch.Generator().manual_seed(100 + seed)
    s = torch.randn(hq, generator=gen, dtype=torch.float64) * 1.5
    s[0] = 4.0
    s[-1] = float("-inf")
    return s


def _compare(rank, world, dtypes):
    import torch
    import torch.distributed as dist
    import seqpar.torch as spt
    from reference import explicit, long_tail, relative_error

    hq, hkv = 4, 2
    errors = {}
    for name in STRATEGIES:
        layers = {}
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            accum = torch.float64 if dtype == torch.float64 else torch.float32
            for d, dv, with_sinks in CASES:
                if (d, dv) not in layers:
                    layers[(d, dv)] = spt.DistributedAttention(name, hq, hkv, d, head_dim_v=dv, timeout_s=60)
                attn = layers[(d, dv)]
                for seed in (1, 2):
                    lengths = long_tail(seed, sequences=2, tokens=24 + 8 * seed)
                    total = sum(sum(s) for s in lengths)
                    gen = torch.Generator().manual_seed(seed)
                    # Values the op's dtype holds exactly: the reference reads what the kernel reads.
                    q, k, v, do = (torch.randn(total, h, w, generator=gen).to(dtype).double()
                                   for h, w in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
                    sinks = _sinks(torch, hq, seed).to(accum).double() if with_sinks else None
                    ins = [q, k, v] + ([sinks] if with_sinks else [])
                    for x in ins:
                        x.requires_grad_(True)
                    o_ref, lse_ref = explicit(q, k, v, lengths, sinks)
                    grads_ref = torch.autograd.grad(o_ref, ins, do)

                    rows = attn.token_indices(lengths)
                    lq, lk, lv = (x.detach()[rows].to(dtype).requires_grad_(True) for x in (q, k, v))
                    ls = sinks.detach().to(accum).requires_grad_(True) if with_sinks else None
                    o, lse = attn(lq, lk, lv, lengths, return_lse=True, sinks=ls)
                    assert o.shape == (len(rows), hq, dv) and o.dtype == dtype, (o.shape, o.dtype)
                    o.backward(do[rows].to(dtype))
                    got = {"o": (o, o_ref[rows]), "lse": (lse, lse_ref[:, rows]), "dq": (lq.grad, grads_ref[0][rows]),
                           "dk": (lk.grad, grads_ref[1][rows]), "dv": (lv.grad, grads_ref[2][rows])}
                    if with_sinks:
                        # Each rank holds an equal share of the whole batch's gradient: the all-reduce
                        # (sum) a trainer runs over replicated parameters gives the whole gradient.
                        assert ls.grad.dtype == accum and ls.grad.shape == (hq,)
                        assert ls.grad[-1].item() == 0.0  # the head without a sink
                        shares = [torch.empty_like(ls.grad) for _ in range(dist.get_world_size())]
                        dist.all_gather(shares, ls.grad)
                        assert all(torch.equal(x, ls.grad) for x in shares), "the ranks' shares differ"
                        summed = ls.grad.clone()
                        dist.all_reduce(summed)
                        got["dsinks"] = (summed, grads_ref[3])
                    for what, (a, b) in got.items():
                        err = relative_error(a, b)
                        errors[(dtype_name, name, d, dv, with_sinks, seed, what)] = err
    return errors


@pytest.mark.parametrize("world", [1, 2])
def test_head_dim_v_and_sinks_match_the_definition(world):
    dtypes = ["float64", "float32", "bfloat16"]
    for rank, errors in enumerate(run(_compare, world, dtypes, timeout=300)):
        # 5 tensors a case, 6 with sinks: every strategy, dtype, case and seed ran.
        per_seed = sum(6 if s else 5 for _, _, s in CASES)
        assert len(errors) == len(STRATEGIES) * len(dtypes) * 2 * per_seed
        bad = {key: err for key, err in errors.items()
               if not err < TOLERANCE[key[0]][0 if key[-1] in ("o", "lse") else 1]}
        assert not bad, f"rank {rank}: errors above tolerance: {bad}"
        worst = {}
        for key, err in errors.items():
            worst[key[0]] = max(worst.get(key[0], 0.0), err)
        print(f"rank {rank} of {world}: largest relative error by dtype: {worst}")


def _gradcheck_and_compile(rank, world):
    import torch
    import seqpar.torch as spt

    lengths = [[3, 1, 2]]
    attn = spt.DistributedAttention("ulysses", 2, 1, 3, head_dim_v=2, timeout_s=60)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, h, w, generator=gen, dtype=torch.float64, requires_grad=True)
               for h, w in ((2, 3), (1, 3), (1, 2)))
    s = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    ok = torch.autograd.gradcheck(lambda a, b, c, d: attn(a, b, c, lengths, sinks=d), (q, k, v, s), eps=1e-6,
                                  atol=1e-8)

    def layer(a, b, c, d):
        return (attn(a, b, c, lengths, sinks=d) * 2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager = layer(q, k, v, s)
    traced = compiled(q, k, v, s)
    g_eager = torch.autograd.grad(eager, (q, k, v, s))
    g_traced = torch.autograd.grad(traced, (q, k, v, s))
    same = torch.equal(eager, traced) and all(torch.equal(a, b) for a, b in zip(g_eager, g_traced))
    return ok, same


def test_gradcheck_and_torch_compile_with_head_dim_v_and_sinks():
    ok, same = run(_gradcheck_and_compile, 1)[0]
    assert ok
    assert same
