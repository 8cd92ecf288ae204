# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face transformers model (a tiny random-weight gpt-oss: attention sinks, alternating
sliding-window and full layers) trained on packed synthetic documents through seqpar's registered
attention, wrapped in DistributedDataParallel: N gloo processes, then 1, losses side by side.

    python examples/python/train_hf.py [--procs 2] [--steps 10] [--strategy hybrid-aware] [--model gpt-oss]

The model is transformers' own code; only attn_implementation="seqpar" differs. Each rank runs its
rows of the packed batch (seqpar.integrations.transformers.shard), the model passes the batch's
cu_seqlens to every attention call, and the loss is the rank's share of the batch's mean token loss,
scaled for DDP's average (seqpar.torch.data_parallel_loss_scale). The result is the single-process
training run, step for step.
"""
import argparse
import copy
import multiprocessing as mp
import os
import random
import sys
import tempfile

import torch
import torch.distributed as dist

VOCAB = 97


def config(name):
    from transformers import GptOssConfig, LlamaConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, attention_dropout=0.0)
    if name == "llama":
        return LlamaConfig(**common)
    return GptOssConfig(**common, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                        num_local_experts=2, num_experts_per_tok=1)


def synthetic_batch(step, tokens=192):
    """One packed sequence of long-tail documents (some of one token), each counting upward from a random
    start modulo VOCAB, so that the next token is learnable; the first 3 tokens of each document are a
    prompt whose labels are masked (-100), as in supervised fine-tuning."""
    rng = random.Random(1000 + step)
    lengths, ids, labels, left = [], [], [], tokens
    while left > 0:
        n = min(left, 1 if rng.random() < 0.2 else max(2, int(rng.lognormvariate(2.5, 1.0))))
        start, stride = rng.randrange(VOCAB), rng.choice((1, 2, 3))
        doc = [(start + stride * i) % VOCAB for i in range(n)]
        ids += doc
        labels += [-100 if i < 3 else t for i, t in enumerate(doc)]
        lengths.append(n)
        left -= n
    return lengths, torch.tensor(ids), torch.tensor(labels)


def train(rank, world, args, init_file, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM

    import seqpar.integrations.transformers as sphf
    import seqpar.torch as spt

    sphf.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config(args.model)), attn_implementation="seqpar",
                                             experts_implementation="eager")
    sphf.configure(model, args.strategy)             # one seqpar layer for every attention module
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(args.steps):
        lengths, ids, labels = synthetic_batch(step)
        local = sphf.shard(model, ids, lengths, labels=labels)   # this rank's rows, positions, labels
        logits = ddp(**local.model_inputs()).logits
        loss = sphf.loss(logits, local)              # this rank's share of the batch's mean token loss
        opt.zero_grad()
        (loss * spt.data_parallel_loss_scale()).backward()   # DDP averages; the scale makes it the sum
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
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
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--strategy", default="hybrid-aware")
    parser.add_argument("--model", choices=("gpt-oss", "llama"), default="gpt-oss")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    many, one = run(args.procs, args), run(1, args)
    print(f"{args.model} through transformers, strategy {args.strategy}: {args.procs} gloo processes (DDP) vs 1")
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
