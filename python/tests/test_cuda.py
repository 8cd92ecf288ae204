# SPDX-License-Identifier: Apache-2.0
"""The CUDA path (an extension built with SEQPAR_TORCH_CUDA=1: attention::CudaFlash, and cuDNN's SDPA or
torch's FlashAttention ops behind seqpar's kernel protocol for float16 / bfloat16 with kernel="auto", over the
group's NCCL backend) against fp64 SDPA, forward and backward, on 1 process and on 2 where there are 2 GPUs.
Skipped without the CUDA build or a GPU: it has never run (the CI machines have no GPU)."""
import pytest
import torch

import seqpar.torch as spt
from dist_util import run

pytestmark = pytest.mark.skipif(not (spt.CUDA and torch.cuda.is_available()),
                                reason="needs the CUDA build (SEQPAR_TORCH_CUDA=1) and a GPU")
# bf16 and fp16: 8 and 11 significant bits, the bf16 tolerances of the CPU tests (test_attention.py);
# fp32: CudaFlash's fp32 path is exact FMAs, accumulated in another order than SDPA's.
TOL = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (1e-2, 2e-2), torch.float32: (1e-4, 1e-4)}
STRATEGIES = ["ulysses", "zigzag-ring", "hybrid-aware", "basp"]


def _cuda(rank, world, kernel):
    import torch
    import seqpar.torch as spt
    from reference import long_tail, sdpa

    hq, hkv, d = 4, 2, 64
    errors = {}
    for name in STRATEGIES:
        attn = spt.DistributedAttention(name, hq, hkv, d, timeout_s=60, kernel=kernel)
        for dtype in TOL:
            lengths = long_tail(3, sequences=2, tokens=96)
            total = sum(sum(s) for s in lengths)
            gen = torch.Generator().manual_seed(5)
            q, k, v, do = (torch.randn(total, h, d, generator=gen).to(dtype).double() for h in (hq, hkv, hkv, hq))
            for x in (q, k, v):
                x.requires_grad_(True)
            o_ref, lse_ref = sdpa(q, k, v, lengths)
            refs = (o_ref, lse_ref) + torch.autograd.grad(o_ref, (q, k, v), do)
            rows = attn.token_indices(lengths)
            lq, lk, lv = (x.detach()[rows].to("cuda", dtype).requires_grad_(True) for x in (q, k, v))
            o, lse = attn(lq, lk, lv, lengths, return_lse=True)
            o.backward(do[rows].to("cuda", dtype))
            got = (o, lse, lq.grad, lk.grad, lv.grad)
            # auto: cuDNN (where built) or torch's FlashAttention for the 16-bit types (d 64 is both's), CudaFlash
            # for float32.
            want = "seqpar"
            if dtype != torch.float32 and kernel != "seqpar":
                want = "cudnn" if kernel == "auto" and spt.CUDNN else "flash"
            assert attn.kernel == want, f"{name} {dtype} kernel={kernel}: ran {attn.kernel}, expected {want}"
            for what, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, refs):
                b = b[:, rows] if what == "lse" else b[rows]
                err = (a.double().cpu() - b).abs().max().item() / max(1.0, b.abs().max().item()) if a.numel() else 0.0
                errors[(name, str(dtype), what)] = err
    return errors


@pytest.mark.parametrize("kernel", ["auto", "flash", "seqpar"])
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_matches_sdpa(world, kernel):
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs")
    for rank, errors in enumerate(run(_cuda, world, kernel, backend="nccl", timeout=300)):
        assert len(errors) == len(STRATEGIES) * len(TOL) * 5
        bad = {}
        for (name, dtype, what), err in errors.items():
            forward, backward = TOL[getattr(torch, dtype.replace("torch.", ""))]
            if not err < (forward if what in ("o", "lse") else backward):
                bad[(name, dtype, what)] = err
        assert not bad, f"rank {rank}: errors above tolerance: {bad}"
