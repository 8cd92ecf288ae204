# SPDX-License-Identifier: Apache-2.0
"""seqpar.torch.DistributedAttention against torch's SDPA over the whole packed batch (float64,
1e-10), forward and backward, on 1, 2 and 4 gloo processes; gradcheck; torch.compile."""
import pytest

from dist_util import run

# (strategy, ranks_per_node on 4 ranks): the hierarchical strategy runs 2 nodes of 2 ranks; "auto" is
# the planner's choice per batch (plan::SelectedAttention), on 2 nodes of 2 too.
STRATEGIES = [("ulysses", 0), ("zigzag-ring", 0), ("hybrid-aware", 0), ("basp", 0), ("hierarchical", 2), ("auto", 2)]
TOL = 1e-10


def _exact(rank, world, seeds):
    import torch
    import seqpar.torch as spt
    from reference import long_tail, sdpa

    hq, hkv, d = 4, 2, 8
    errors = {}
    for name, rpn in STRATEGIES:
        attn = spt.DistributedAttention(name, hq, hkv, d, ranks_per_node=rpn if world == 4 else 0, timeout_s=60)
        for seed in seeds:
            lengths = long_tail(seed, sequences=1 + seed % 3, tokens=24 + 8 * (seed % 2))
            total = sum(sum(s) for s in lengths)
            gen = torch.Generator().manual_seed(seed)
            q, k, v, do = (torch.randn(total, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
            for x in (q, k, v):
                x.requires_grad_(True)
            o_ref, lse_ref = sdpa(q, k, v, lengths)
            dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q, k, v), do)

            rows = attn.token_indices(lengths)
            lq, lk, lv = (x.detach()[rows].clone().requires_grad_(True) for x in (q, k, v))
            o, lse = attn(lq, lk, lv, lengths, return_lse=True)
            o.backward(do[rows])
            got = {"o": (o, o_ref[rows]), "lse": (lse, lse_ref[:, rows]), "dq": (lq.grad, dq_ref[rows]),
                   "dk": (lk.grad, dk_ref[rows]), "dv": (lv.grad, dv_ref[rows])}
            for what, (a, b) in got.items():
                err = (a - b).abs().max().item() / max(1.0, b.abs().max().item()) if a.numel() else 0.0
                errors[(name, seed, what)] = err
    return errors


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_sdpa_float64(world):
    seeds = [1, 2, 3] if world != 4 else [1, 2]
    for rank, errors in enumerate(run(_exact, world, seeds, timeout=240)):
        bad = {key: err for key, err in errors.items() if not err < TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"
        assert len(errors) == len(STRATEGIES) * len(seeds) * 5


def _dtypes(rank, world):
    import torch
    import seqpar.torch as spt
    from reference import long_tail, sdpa

    lengths = long_tail(7, sequences=2, tokens=32)
    total = sum(sum(s) for s in lengths)
    attn = spt.DistributedAttention("zigzag-ring", 4, 2, 16, timeout_s=60)
    rows = attn.token_indices(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    ref, _ = sdpa(q, k, v, lengths)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        lq, lk, lv = (x[rows].to(dtype).requires_grad_(True) for x in (q, k, v))
        o = attn(lq, lk, lv, lengths)
        o.float().sum().backward()
        assert o.dtype == dtype and lq.grad.dtype == dtype
        out[str(dtype)] = (o.double() - ref[rows]).abs().max().item()
    return out


def test_float32_and_bfloat16():
    for errors in run(_dtypes, 2):
        assert errors["torch.float32"] < 1e-5, errors
        assert errors["torch.bfloat16"] < 5e-2, errors


def _gradcheck_and_compile(rank, world):
    import torch
    import seqpar.torch as spt

    lengths = [[3, 1, 2]]
    attn = spt.DistributedAttention("ulysses", 2, 1, 3, timeout_s=60)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, h, 3, generator=gen, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    ok = torch.autograd.gradcheck(lambda a, b, c: attn(a, b, c, lengths), (q, k, v), eps=1e-6, atol=1e-8)

    def layer(a, b, c):
        return (attn(a, b, c, lengths) * 2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager = layer(q, k, v)
    traced = compiled(q, k, v)
    g_eager = torch.autograd.grad(eager, (q, k, v))
    g_traced = torch.autograd.grad(traced, (q, k, v))
    same = torch.equal(eager, traced) and all(torch.equal(a, b) for a, b in zip(g_eager, g_traced))
    return ok, same


def test_gradcheck_and_torch_compile():
    ok, same = run(_gradcheck_and_compile, 1)[0]
    assert ok
    assert same
