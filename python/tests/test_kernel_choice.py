# SPDX-License-Identifier: Apache-2.0
"""The layer's kernel argument (issue 38): the names it takes, refusals by name (an unknown kernel, "cudnn" or
"flash" in a build without them, either on CPU tensors), which kernel
ran (the `kernel` property and repr), and the argument kept through deepcopy, pickling and the ranks'
agreement. On CPU: the CUDA kernels' own checks need a GPU (compiled only)."""
import copy
import io

from dist_util import run


def _kernel_argument(rank, world):
    import pytest
    import torch
    import seqpar.torch as spt

    lengths = [[5, 1, 2]]

    def expect(exc, words, fn):
        with pytest.raises(exc) as info:
            fn()
        for w in words:
            assert w in str(info.value), f"{w!r} not in {info.value}"

    expect(ValueError, ["kernel", "'fast'", "auto, flash, cudnn, seqpar"],
           lambda: spt.DistributedAttention("ulysses", 2, 1, 4, kernel="fast"))
    if not spt.CUDNN:
        expect(ValueError, ["kernel", "'cudnn'", "not in this build"],
               lambda: spt.DistributedAttention("ulysses", 2, 1, 4, kernel="cudnn"))
    expect(TypeError, ["kernel", "must be a str"], lambda: spt.DistributedAttention("ulysses", 2, 1, 4, kernel=1))
    if spt.CUDA:  # the layer takes "flash" (and "cudnn" with cuDNN) and refuses CPU tensors by name
        for kernel in ("flash", "cudnn") if spt.CUDNN else ("flash",):
            vendor = spt.DistributedAttention("ulysses", 2, 1, 4, kernel=kernel)
            n = len(vendor.token_indices(lengths))
            q, k, v = (torch.randn(n, h, 4, dtype=torch.float64) for h in (2, 1, 1))
            expect(ValueError, ["kernel", f"'{kernel}'", "CUDA tensors only", "'seqpar'"],
                   lambda: vendor(q, k, v, lengths))
    else:
        expect(ValueError, ["kernel", "'flash'", "SEQPAR_TORCH_CUDA=1"],
               lambda: spt.DistributedAttention("ulysses", 2, 1, 4, kernel="flash"))

    for kernel in ("auto", "seqpar"):
        attn = spt.DistributedAttention("zigzag-ring", 2, 1, 4, kernel=kernel)
        assert attn.kernel == kernel  # before a call: the argument
        assert f"kernel={kernel!r}" in repr(attn) and "(ran" not in repr(attn)
        n = len(attn.token_indices(lengths))
        torch.manual_seed(rank)
        q, k, v = (torch.randn(n, h, 4, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
        attn(q, k, v, lengths).sum().backward()
        assert attn.kernel == "seqpar"  # CPU tensors: CpuFlash ran
        assert f"kernel={kernel!r} (ran 'seqpar')" in repr(attn)
        # A constructor argument: kept by deepcopy and by pickling (torch.save of a model).
        twin = copy.deepcopy(attn)
        assert twin._args["kernel"] == kernel and f"kernel={kernel!r}" in repr(twin)
        buf = io.BytesIO()
        torch.save(attn, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded._args["kernel"] == kernel
        assert loaded.kernel == kernel  # a fresh layer: nothing ran yet
    # Layers pickled before the argument existed load as "auto".
    attn = spt.DistributedAttention("ulysses", 2, 1, 4)
    state = attn.__getstate__()
    del state["_args"]["kernel"]
    old = spt.DistributedAttention.__new__(spt.DistributedAttention)
    old.__setstate__(state)
    assert old.kernel == "auto"

    # The ranks agree on the kernel: a rank that asks for another one raises, naming both values.
    with pytest.raises(ValueError) as info:
        spt.DistributedAttention("ulysses", 2, 1, 4, kernel="seqpar" if rank == 0 else "auto")
    assert "kernel" in str(info.value) and "'seqpar'" in str(info.value) and "'auto'" in str(info.value)
    return "ok"


def test_kernel_argument():
    assert run(_kernel_argument, 2) == ["ok", "ok"]
