# SPDX-License-Identifier: Apache-2.0
"""seqpar.torch.DistributedAttention against torch's SDPA over the whole packed batch (float64,
1e-10), forward and backward, on 1, 2 and 4 gloo processes; fp32; bf16 through the bf16 kernel
(bf16 tolerance, and no copy of q, k, v on the way); gradcheck; torch.compile."""
import pytest

from dist_util import run

# (strategy, ranks_per_node on 4 ranks): the hierarchical strategy runs 2 nodes of 2 ranks; "auto" is
# the planner's choice per batch (plan::SelectedAttention), on 2 nodes of 2 too.
STRATEGIES = [("ulysses", 0), ("zigzag-ring", 0), ("hybrid-aware", 0), ("basp", 0), ("hierarchical", 2), ("auto", 2)]
TOL = 1e-10


def _exact(rank, world, seeds):
    import torch
    import seqpar.torch as spt
    from reference import long_tail, relative_error, sdpa

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
                err = relative_error(a, b)
                errors[(name, seed, what)] = err
    return errors


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_sdpa_float64(world):
    seeds = [1, 2, 3] if world != 4 else [1, 2]
    for rank, errors in enumerate(run(_exact, world, seeds, timeout=240)):
        bad = {key: err for key, err in errors.items() if not err < TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"
        assert len(errors) == len(STRATEGIES) * len(seeds) * 5


def _float32(rank, world):
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
    lq, lk, lv = (x[rows].float().requires_grad_(True) for x in (q, k, v))
    o = attn(lq, lk, lv, lengths)
    o.sum().backward()
    assert o.dtype == torch.float32 and lq.grad.dtype == torch.float32
    return (o.double() - ref[rows]).abs().max().item()


def test_float32():
    for err in run(_float32, 2):
        assert err < 1e-5, err


# bf16 runs CpuFlash<bf16> on the tensors' own storage (fp32 accumulation, fp32 lse). bf16 keeps 8
# significant bits (2^-9 relative per rounding): o, dq, dk, dv are rounded once by the kernel, the
# backward reads the rounded o, and a gradient summed over ranks is rounded once per partial. The
# reference is fp64 SDPA on the same bf16-rounded q, k, v, dout; the errors are relative to
# max(1, largest reference value), the C++ bf16 tests' tolerances (tests/strategy/test_bf16.cpp).
BF16_FORWARD, BF16_BACKWARD = 1e-2, 2e-2
BF16_STRATEGIES = [("ulysses", 0), ("zigzag-ring", 0), ("hybrid-aware", 0), ("basp", 0), ("hierarchical", 1)]
# Ops that copy or convert a tensor: none may take a (tokens, heads, head_dim) tensor inside the op
# (the former fp32 detour ran q.to(float32) and back). gloo copies its own 1-d byte buffers.
COPIES = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous")


def _bfloat16(rank, world):
    import torch
    import seqpar.torch as spt
    from reference import long_tail, relative_error, sdpa

    hq, hkv, d = 4, 2, 16
    errors, copies = {}, {}
    for name, rpn in BF16_STRATEGIES:
        attn = spt.DistributedAttention(name, hq, hkv, d, ranks_per_node=rpn if world > 1 else 0, timeout_s=60)
        for seed in (1, 2):
            lengths = long_tail(seed, sequences=2, tokens=40)
            total = sum(sum(s) for s in lengths)
            gen = torch.Generator().manual_seed(seed)
            # bf16 values: the reference sees exactly what the kernel reads.
            q, k, v, do = (torch.randn(total, h, d, generator=gen).bfloat16().double() for h in (hq, hkv, hkv, hq))
            for x in (q, k, v):
                x.requires_grad_(True)
            o_ref, lse_ref = sdpa(q, k, v, lengths)
            dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q, k, v), do)

            rows = attn.token_indices(lengths)
            lq, lk, lv = (x.detach()[rows].bfloat16().requires_grad_(True) for x in (q, k, v))
            ldo = do[rows].bfloat16()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                o, lse = attn(lq, lk, lv, lengths, return_lse=True)
                o.backward(ldo)
            copies[(name, seed)] = sorted({f"{e.name}{e.input_shapes}" for e in prof.events()
                                           if e.name in COPIES and any(len(s) == 3 for s in e.input_shapes)})
            assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32, (o.dtype, lse.dtype)
            assert all(x.grad.dtype == torch.bfloat16 for x in (lq, lk, lv))
            got = {"o": (o, o_ref[rows]), "lse": (lse, lse_ref[:, rows]), "dq": (lq.grad, dq_ref[rows]),
                   "dk": (lk.grad, dk_ref[rows]), "dv": (lv.grad, dv_ref[rows])}
            for what, (a, b) in got.items():
                err = relative_error(a, b)
                errors[(name, seed, what)] = err
    return errors, copies


@pytest.mark.parametrize("world", [1, 2])
def test_bfloat16_native(world):
    for rank, (errors, copies) in enumerate(run(_bfloat16, world, timeout=240)):
        assert len(errors) == len(BF16_STRATEGIES) * 2 * 5
        bad = {key: err for key, err in errors.items()
               if not err < (BF16_FORWARD if key[2] in ("o", "lse") else BF16_BACKWARD)}
        assert not bad, f"rank {rank}: errors above bf16 tolerance: {bad}"
        copied = {key: ops for key, ops in copies.items() if ops}
        assert not copied, f"rank {rank}: the op copied tensors: {copied}"


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
