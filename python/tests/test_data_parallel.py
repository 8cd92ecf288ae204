# SPDX-License-Identifier: Apache-2.0
"""seqpar.torch under DistributedDataParallel and FSDP2, with the context-parallel group taken from a
DeviceMesh beside a data-parallel dimension: 2 data-parallel x 2 context-parallel gloo processes give,
for every parameter, the gradient one process computes as the mean over the data-parallel replicas of
their whole batches' gradients (float64, 1e-10), when the loss is scaled by data_parallel_loss_scale.
Without the scale DDP's average is 1/cp of it (checked too: the scale is what makes it right)."""
import pytest
import torch

from dist_util import run

VOCAB, WIDTH, HQ, HKV, D = 32, 16, 2, 1, 8
TOL = 1e-10


class TinyLM(torch.nn.Module):
    """Embedding, one attention block (sinks and a window, as gpt-oss), a head: attention is `attend(q, k,
    v)`, seqpar's on the ranks, the definition over the whole batch for the reference."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        self.qkv = torch.nn.Linear(WIDTH, (HQ + 2 * HKV) * D, dtype=torch.float64)
        self.out = torch.nn.Linear(HQ * D, WIDTH, dtype=torch.float64)
        self.head = torch.nn.Linear(WIDTH, VOCAB, dtype=torch.float64)
        self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, HQ, dtype=torch.float64))

    def forward(self, ids, attend):
        x = self.embed(ids)
        qkv = self.qkv(x).view(ids.shape[0], HQ + 2 * HKV, D)
        q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
        x = x + self.out(attend(q, k, v, self.sinks).reshape(ids.shape[0], HQ * D))
        return self.head(x)


def _batches(dp):
    gen = torch.Generator().manual_seed(7)
    out = []
    for d in range(dp):
        lengths = [[9, 1, 14, 4], [20, 3, 5]] if d == 0 else [[6, 6, 6, 6, 4], [2, 26]]
        total = sum(sum(s) for s in lengths)
        out.append((lengths, torch.randint(0, VOCAB, (total,), generator=gen)))
    return out


def _reference(model, batches, scale):
    """One process: the mean over the replicas of each whole batch's mean next-token loss's gradient."""
    import torch.nn.functional as F
    from reference import explicit

    model.zero_grad()
    for lengths, ids in batches:
        logits = model(ids, lambda q, k, v, s: explicit(q, k, v, lengths, sinks=s, window=6, scale=scale)[0])
        labels = torch.full_like(ids, -100)
        at = 0
        for n in (d for seq in lengths for d in seq):
            labels[at:at + n - 1] = ids[at + 1:at + n]
            at += n
        count = int((labels != -100).sum())
        (F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100) / count / len(batches)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _data_parallel(rank, world, wrapper, scaled):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import seqpar.torch as spt

    dp, cp = 2, 2
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group = mesh["cp"].get_group()
    torch.manual_seed(0)
    model = TinyLM()
    batches = _batches(dp)
    scale = 0.3
    want = _reference(model, batches, scale)
    model.zero_grad(set_to_none=True)

    lengths, ids = batches[mesh.get_local_rank("dp")]
    attn = spt.DistributedAttention("hybrid-aware", HQ, HKV, D, group=cp_group, timeout_s=60,
                                    mask_mix=[((5, 0), 1)])
    rows = attn.token_indices(lengths)
    labels = attn.labels(ids, lengths)
    if wrapper == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        # Parameters sharded over every rank (dp x cp), gradients reduce-scattered and averaged over them.
        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    logits = wrapped(ids[rows], lambda q, k, v, s: attn(q, k, v, lengths, sinks=s, window_size=(5, 0),
                                                        softmax_scale=scale))
    loss = F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100) / spt.label_count(lengths)
    if scaled:
        loss = loss * spt.data_parallel_loss_scale(cp_group)
    loss.backward()
    errors = {}
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = ((got - want[name]).abs().max() / want[name].abs().max().clamp(min=1.0)).item()
        errors[name + " (x cp)"] = ((got * cp - want[name]).abs().max() / want[name].abs().max()).item()
    return errors


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_x_context_parallel_equals_one_process(wrapper):
    for rank, errors in enumerate(run(_data_parallel, 4, wrapper, True, timeout=240)):
        exact = {k: e for k, e in errors.items() if "(x cp)" not in k}
        assert len(exact) == 8
        bad = {k: e for k, e in exact.items() if not e < TOL}
        assert not bad, f"rank {rank} ({wrapper}): gradients off the one-process run: {bad}"


def test_ddp_without_the_scale_is_one_cp_th():
    # The failure the scale fixes: DDP's average over dp x cp ranks is the right gradient / cp.
    for rank, errors in enumerate(run(_data_parallel, 4, "ddp", False, timeout=240)):
        off = {k: e for k, e in errors.items() if "(x cp)" in k and not e < TOL}
        assert not off, f"rank {rank}: {off}"
