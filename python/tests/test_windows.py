# SPDX-License-Identifier: Apache-2.0
"""The mask per call through seqpar.torch (FlashAttention's window_size=(left, 0)): a model alternating
sliding-window and full layers (gpt-oss's pattern, with sinks) runs every layer on the same rows of each
rank, and each layer matches the definition written out in fp64 under its own window (reference.explicit
with the window), on 1 and 2 gloo processes and five strategies; bad windows are refused by name; and
torch.compile(fullgraph=True) traces a window layer."""
import pytest

from dist_util import run

STRATEGIES = ["zigzag-ring", "per-doc-aware", "hybrid-aware", "basp", "ulysses"]
WINDOW = 5  # keys a window layer's query sees (window_size = (4, 0))


def _model(rank, world):
    import torch
    import torch.distributed as dist
    import seqpar.torch as spt
    from reference import explicit, long_tail, relative_error

    hq, hkv, d = 4, 2, 8
    mix = [((-1, 0), 2), ((WINDOW - 1, 0), 2)]
    errors = {}
    for name in STRATEGIES:
        attn = spt.DistributedAttention(name, hq, hkv, d, timeout_s=60, mask_mix=mix)
        for seed in (1, 2):
            lengths = long_tail(seed, sequences=2, tokens=30 + 6 * seed)
            total = sum(sum(s) for s in lengths)
            rows = attn.token_indices(lengths)  # the model's rows: every layer's
            for layer in range(4):
                window_size = (WINDOW - 1, 0) if layer % 2 else (-1, 0)
                gen = torch.Generator().manual_seed(10 * seed + layer)
                q, k, v, do = (torch.randn(total, h, d, generator=gen, dtype=torch.float64)
                               for h in (hq, hkv, hkv, hq))
                sinks = torch.randn(hq, generator=gen, dtype=torch.float64)
                ins = [x.requires_grad_(True) for x in (q, k, v, sinks)]
                o_ref, lse_ref = explicit(q, k, v, lengths, sinks, window=WINDOW if layer % 2 else 0)
                grads = torch.autograd.grad(o_ref, ins, do)
                lq, lk, lv = (x.detach()[rows].requires_grad_(True) for x in (q, k, v))
                ls = sinks.detach().clone().requires_grad_(True)
                o, lse = attn(lq, lk, lv, lengths, return_lse=True, sinks=ls, window_size=window_size)
                o.backward(do[rows])
                summed = ls.grad.clone()
                dist.all_reduce(summed)
                got = {"o": (o, o_ref[rows]), "lse": (lse, lse_ref[:, rows]), "dq": (lq.grad, grads[0][rows]),
                       "dk": (lk.grad, grads[1][rows]), "dv": (lv.grad, grads[2][rows]), "dsinks": (summed, grads[3])}
                for what, (a, b) in got.items():
                    err = relative_error(a, b)
                    errors[(name, seed, layer, what)] = err
                assert torch.equal(attn.token_indices(lengths), rows), "the rows moved between layers"
    return errors


@pytest.mark.parametrize("world", [1, 2])
def test_alternating_window_and_full_layers_match_the_definition(world):
    for rank, errors in enumerate(run(_model, world, timeout=300)):
        assert len(errors) == len(STRATEGIES) * 2 * 4 * 6
        bad = {key: err for key, err in errors.items() if not err < 1e-10}
        assert not bad, f"rank {rank}: errors above 1e-10: {bad}"
        print(f"rank {rank} of {world}: largest relative error {max(errors.values()):.2e}")


def _refusals(rank, world):
    import torch
    import seqpar.torch as spt

    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=60)
    q, k, v = torch.zeros(6, 2, 4), torch.zeros(6, 1, 4), torch.zeros(6, 1, 4)
    messages = []
    for bad in ((3, 1), (-2, 0), "wide", (1, 2, 3)):
        try:
            attn(q, k, v, [[6]], window_size=bad)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    try:
        spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=60, mask_mix=[((127, 0), 0)])
        messages.append(None)
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_bad_windows_are_refused_by_name():
    messages = run(_refusals, 1)[0]
    assert all(m is not None and "window_size" in m or (m is not None and "mask_mix" in m) for m in messages), messages
    assert "right must be 0" in messages[0]
    assert "layers" in messages[-1]


def _compile(rank, world):
    import torch
    import seqpar.torch as spt

    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=60)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, h, 4, generator=gen, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))

    def layer(a, b, c):
        return (attn(a, b, c, [[5, 4]], window_size=(1, 0)) * 2).sum()

    eager = layer(q, k, v)
    traced = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v)
    g_eager = torch.autograd.grad(eager, (q, k, v))
    g_traced = torch.autograd.grad(traced, (q, k, v))
    return torch.equal(eager, traced) and all(torch.equal(a, b) for a, b in zip(g_eager, g_traced))


def test_torch_compile_traces_a_window_layer():
    assert run(_compile, 1)[0]
