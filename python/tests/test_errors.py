# SPDX-License-Identifier: Apache-2.0
"""Bad input raises a Python exception naming the argument; a rank that disagrees, raises or dies
makes its peers raise within the timeout, never hang."""
import os
import signal
import time

from dist_util import run


def _bad_inputs(rank, world):
    import pytest
    import torch
    import seqpar.torch as spt

    lengths = [[5, 1, 2]]
    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=20)
    n = len(attn.token_indices(lengths))
    q, k, v = (torch.randn(n, h, 4, dtype=torch.float64) for h in (2, 1, 1))
    raised = []

    def expect(exc, words, fn):
        with pytest.raises(exc) as info:
            fn()
        for w in words:
            assert w in str(info.value), f"{w!r} not in {info.value}"
        raised.append(type(info.value).__name__)

    expect(ValueError, ["strategy", "'nope'", "ulysses"], lambda: spt.DistributedAttention("nope", 2, 1, 4))
    expect(ValueError, ["heads_kv = 3"], lambda: spt.DistributedAttention("ulysses", 2, 3, 4))
    # Local checks: every rank refuses before any message, so the ranks stay in step.
    expect(ValueError, ["q.dtype", "Int"], lambda: attn(q.int(), k, v, lengths))
    expect(ValueError, ["k.dtype"], lambda: attn(q, k.float(), v, lengths))
    expect(ValueError, ["q.dim()"], lambda: attn(q[:, 0], k, v, lengths))
    expect(ValueError, ["q.device", "meta"], lambda: attn(q.to("meta"), k, v, lengths))
    expect(ValueError, ["lengths[0][1] = 0"], lambda: attn(q, k, v, [[5, 0, 3]]))
    expect(ValueError, ["lengths[1] = 1.5"], lambda: attn(q, k, v, [2, 1.5]))
    expect(ValueError, ["stride(2)"], lambda: attn(q.transpose(1, 2), k, v, lengths))
    # Head sizes (issue 29): q and k have head_dim values per head, v head_dim_v; sinks are (heads_q,)
    # logits of the kernels' accumulation type (float64 here), finite or -inf.
    mla = spt.DistributedAttention("zigzag-ring", 2, 1, 4, head_dim_v=3, timeout_s=20)
    v3 = torch.randn(n, 1, 3, dtype=torch.float64)
    expect(ValueError, ["v.shape[2] = 4", "head_dim_v = 3"], lambda: mla(q, k, v, lengths))
    expect(ValueError, ["q.shape[2] = 3", "head_dim = 4"], lambda: mla(q[..., :3], k, v3, lengths))
    expect(ValueError, ["head_dim_v = 0"], lambda: spt.DistributedAttention("ulysses", 2, 1, 4, head_dim_v=0))
    f64 = dict(dtype=torch.float64)
    expect(ValueError, ["sinks.shape", "heads_q"], lambda: attn(q, k, v, lengths, sinks=torch.zeros(3, **f64)))
    expect(ValueError, ["sinks.dtype", "Float", "Double"], lambda: attn(q, k, v, lengths, sinks=torch.zeros(2)))
    expect(ValueError, ["sinks[1]", "finite"],
           lambda: attn(q, k, v, lengths, sinks=torch.tensor([0.0, float("nan")], **f64)))
    expect(ValueError, ["sinks[0]", "finite"],
           lambda: attn(q, k, v, lengths, sinks=torch.tensor([float("inf"), 0.0], **f64)))
    expect(TypeError, ["sinks", "list"], lambda: attn(q, k, v, lengths, sinks=[0.0, 0.0]))
    # Rows that do not match this rank's share of the batch (lengths that do not sum to the tokens):
    # refused on this rank, and every rank raises (the ranks compare their checks before any exchange).
    expect((ValueError, RuntimeError), ["q"], lambda: attn(q[:-1], k[:-1], v[:-1], lengths) if rank == 0
           else attn(q, k, v, lengths))
    # The layer still works afterwards.
    o = attn(q, k, v, lengths)
    assert o.shape == q.shape
    # Ranks that disagree on the batch: RuntimeError (Errc::kMismatch) on every rank, no hang.
    other = [[5, 1, 2]] if rank == 0 else [[4, 2, 2]]
    m = len(attn.token_indices(other))
    expect(RuntimeError, [], lambda: attn(*(torch.randn(m, h, 4, dtype=torch.float64) for h in (2, 1, 1)), other))
    return raised


def test_bad_inputs_raise():
    for raised in run(_bad_inputs, 2, timeout=120):
        assert len(raised) == 19


def _peer_dies(rank, world):
    import torch
    import seqpar.torch as spt

    lengths = [[9, 1, 6]]
    attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, timeout_s=8)
    n = len(attn.token_indices(lengths))
    q, k, v = (torch.randn(n, h, 4) for h in (2, 1, 1))
    attn(q, k, v, lengths)  # everyone alive: works
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        attn(q, k, v, lengths)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_dead_peer_makes_the_survivor_raise():
    what, took = run(_peer_dies, 2, expect_dead=(1,), timeout=90)[0]
    assert what != "no error"
    assert took < 10, (took, what)
