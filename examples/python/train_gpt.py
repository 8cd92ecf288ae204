# SPDX-License-Identifier: Apache-2.0
"""A small decoder-only transformer in plain PyTorch (RoPE, GQA, AdamW) whose attention is seqpar,
trained for 20 steps on packed synthetic documents: 4 gloo processes, then 1, losses side by side.

    python examples/python/train_gpt.py [--procs 4] [--steps 20] [--strategy zigzag-ring]

Each rank embeds only its own tokens of the packed batch (attn.token_indices), rotates them by their
position within their document (attn.positions), predicts next tokens whose labels may live on
another rank (attn.labels), and divides its summed loss by the whole batch's label count
(seqpar.torch.label_count); gradients of the replicated parameters are then summed over the ranks.
The result is the single-process training run, step for step.
"""
import argparse
import math
import multiprocessing as mp
import os
import random
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS_Q, HEADS_KV, LAYERS = 97, 64, 8, 2, 2
HEAD_DIM = DIM // HEADS_Q


def rope(x, positions):
    """Rotates (tokens, heads, head_dim) by each token's position within its document."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    angle = (positions.to(torch.float64)[:, None] * freq[None, :]).to(x.dtype)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, HEADS_Q * HEAD_DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * HEADS_KV * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS_Q * HEAD_DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.attention = attention  # seqpar.torch.DistributedAttention: exact, over the ranks

    def forward(self, x, positions, lengths):
        h = self.norm1(x)
        q = rope(self.q(h).view(-1, HEADS_Q, HEAD_DIM), positions)
        k, v = self.kv(h).view(-1, 2, HEADS_KV, HEAD_DIM).unbind(1)
        k = rope(k, positions)
        x = x + self.out(self.attention(q, k.contiguous(), v.contiguous(), lengths).reshape(-1, DIM))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, positions, lengths):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, positions, lengths)
        return self.head(self.norm(x))


def synthetic_batch(step, sequences=2, tokens=96):
    """Packed sequences of long-tail documents (some of one token); each document counts upward from
    a random start modulo VOCAB, so the next token is learnable."""
    rng = random.Random(1000 + step)
    lengths, ids = [], []
    for _ in range(sequences):
        docs, left = [], tokens
        while left > 0:
            n = min(left, 1 if rng.random() < 0.2 else max(2, int(rng.lognormvariate(2.5, 1.0))))
            start, stride = rng.randrange(VOCAB), rng.choice((1, 2, 3))
            ids += [(start + stride * i) % VOCAB for i in range(n)]
            docs.append(n)
            left -= n
        lengths.append(docs)
    return lengths, torch.tensor(ids)


def train(rank, world, args, init_file, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    import seqpar.torch as spt

    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    attn = spt.DistributedAttention(args.strategy, HEADS_Q, HEADS_KV, HEAD_DIM)
    model = GPT(attn)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(args.steps):
        lengths, ids = synthetic_batch(step)
        rows = attn.token_indices(lengths)          # this rank's tokens of the packed batch
        positions = attn.positions(lengths)         # RoPE positions within each document
        labels = attn.labels(ids, lengths)          # next tokens, across cuts; -100 at document ends
        count = spt.label_count(lengths)            # the loss normaliser, the same on every rank
        logits = model(ids[rows], positions, lengths)
        local = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        opt.zero_grad()
        (local / count).backward()
        for p in model.parameters():                # replicated parameters: sum, not average
            dist.all_reduce(p.grad)
        opt.step()
        total = local.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / count)
    if rank == 0:
        queue.put(losses)
    dist.destroy_process_group()


def run(world, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=train, args=(r, world, args, os.path.join(tmp, "init"), queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        losses = queue.get(timeout=600)
        for p in procs:
            p.join()
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="zigzag-ring")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    many, one = run(args.procs, args), run(1, args)
    print(f"strategy {args.strategy}: {args.procs} gloo processes vs 1 process")
    print(f"{'step':>4}  {f'{args.procs} procs':>12}  {'1 proc':>12}  {'|diff|':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(many, one)):
        worst = max(worst, abs(a - b))
        print(f"{step:>4}  {a:12.7f}  {b:12.7f}  {abs(a - b):9.2e}")
    ok = worst <= args.tolerance and many[-1] < many[0]
    print(f"largest difference {worst:.2e} (tolerance {args.tolerance:g}); loss {many[0]:.4f} -> {many[-1]:.4f}: "
          + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
