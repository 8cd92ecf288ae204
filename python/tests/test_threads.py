# SPDX-License-Identifier: Apache-2.0
"""The CPU kernels' threads follow the caller (torch.get_num_threads() when the layer is made, or an
explicit threads=), give the same bits on 1 and 2 threads, are refused by name when out of range, and a
host whose ranks x threads exceed its cores gets a warning; the layer says which instruction set its
kernels run."""
import os

from dist_util import run


def _threads(rank, world):
    import os
    import warnings

    import torch
    import seqpar.torch as spt
    from reference import long_tail

    out = {}
    hq, hkv, d = 4, 2, 16
    torch.set_num_threads(2)
    follows = spt.DistributedAttention("zigzag-ring", hq, hkv, d, timeout_s=60)
    out["default"] = follows.threads
    one = spt.DistributedAttention("zigzag-ring", hq, hkv, d, timeout_s=60, threads=1)
    out["explicit"] = one.threads
    out["isa"] = one.cpu_isa
    out["isas"] = {str(k): v for k, v in one.cpu_isas.items()}
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    out["bf16_cpu"] = all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"))
    try:
        spt.DistributedAttention("zigzag-ring", hq, hkv, d, timeout_s=60, threads=0)
        out["zero"] = "accepted"
    except ValueError as e:
        out["zero"] = str(e)

    # 1 and 2 threads: the same bits (the backward's lanes do not depend on the thread count up to 4)
    lengths = long_tail(3, sequences=2, tokens=300)
    total = sum(sum(s) for s in lengths)
    g = torch.Generator().manual_seed(5)
    q0 = torch.randn(total, hq, d, generator=g)
    k0 = torch.randn(total, hkv, d, generator=g)
    v0 = torch.randn(total, hkv, d, generator=g)
    results = []
    for layer in (one, follows):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        o = layer(q, k, v, lengths)
        o.square().sum().backward()
        results.append([o.detach(), q.grad, k.grad, v.grad])
    out["same_bits"] = all(torch.equal(a, b) for a, b in zip(*results))

    os.environ["LOCAL_WORLD_SIZE"] = "64"  # 64 ranks on this host: any threads >= 1 oversubscribe it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spt.DistributedAttention("zigzag-ring", hq, hkv, d, timeout_s=60, threads=1)
    del os.environ["LOCAL_WORLD_SIZE"]
    out["warning"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def test_threads_follow_torch_and_oversubscription_is_said():
    out = run(_threads, 1)[0]
    assert out["default"] == 2  # torch.get_num_threads() when the layer was made
    assert out["explicit"] == 1
    assert out["isa"] in ("avx512", "avx2", "portable")
    assert out["isas"]["torch.float32"] == out["isa"] and out["isas"]["torch.float64"] == "portable"
    # bfloat16 runs the bf16 dot products where the CPU has them (unless SEQPAR_CPU_ISA forces a path).
    if "SEQPAR_CPU_ISA" not in os.environ:
        assert out["isas"]["torch.bfloat16"] == ("avx512bf16" if out["bf16_cpu"] else out["isa"]), out
    assert "threads = 0" in out["zero"] and "must be in [1, 1024]" in out["zero"], out["zero"]
    assert out["same_bits"]
    assert len(out["warning"]) == 1 and "64 ranks on this host" in out["warning"][0], out["warning"]
