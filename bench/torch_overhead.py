# SPDX-License-Identifier: Apache-2.0
"""What going through torch costs: seqpar's torch op (seqpar.torch.DistributedAttention, through
torch.library dispatch and autograd) against the same C++ DistributedAttention called directly
(the extension's layer object: pybind, no torch dispatch, no autograd), on gloo with 2 and 4
processes, fp32 and bf16, forward and forward+backward; and, on 1 process, the op against PyTorch's
own CPU scaled_dot_product_attention over the whole batch with a block-diagonal causal mask.

    PYTHONPATH=python build/venv/bin/python bench/torch_overhead.py [--json FILE] [--tokens 2048]

Prints a table (median of --reps runs after a warm-up); a ratio near 1 means the binding adds
nothing (no copies of q, k, v, o; bf16 runs CpuFlash<bf16> on the tensors' storage in both columns).
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

HQ, HKV, D = 8, 2, 64


def lengths_for(tokens):
    out, left, n = [], tokens, 7
    while left > 0:
        out.append(min(left, n))
        left -= out[-1]
        n = n * 3 % 1031 + 1  # a deterministic long-tail mix
    return [out]


def bench_rank(rank, world, args, init_file, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    import seqpar.torch as spt

    lengths = lengths_for(args.tokens)
    attn = spt.DistributedAttention(args.strategy, HQ, HKV, D)
    rows = attn.token_indices(lengths)
    n = len(rows)
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(rank)
        q, k, v, do = (torch.randn(n, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV, HQ))

        def op_fwd():
            attn(q, k, v, lengths)

        def op_fwd_bwd():
            a, b, c = (x.detach().requires_grad_(True) for x in (q, k, v))
            attn(a, b, c, lengths).backward(do)

        def cxx_fwd():
            attn._layer.forward(q, k, v, lengths)

        def cxx_fwd_bwd():
            o, lse = attn._layer.forward(q, k, v, lengths)
            attn._layer.backward(q, k, v, o, lse, do, lengths)

        for what, op, cxx in (("fwd", op_fwd, cxx_fwd), ("fwd+bwd", op_fwd_bwd, cxx_fwd_bwd)):
            times = {}
            for name, fn in (("op", op), ("cxx", cxx)):
                fn()
                samples = []
                for _ in range(args.reps):
                    dist.barrier()
                    t = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t)
                times[name] = statistics.median(samples)
            records.append({"procs": world, "dtype": str(dtype).replace("torch.", ""), "pass": what,
                            "op_s": times["op"], "cxx_s": times["cxx"], "ratio": times["op"] / times["cxx"]})
    if world == 1:  # the op against torch's own SDPA on the whole batch, with the document mask
        import torch.nn.functional as F
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
        from reference import doc_mask

        mask = doc_mask(lengths)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(n, h, D).to(dtype) for h in (HQ, HKV, HKV))
            kk, vv = (x.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1) for x in (k, v))

            def sdpa():
                F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)

            def op():
                attn(q, k, v, lengths)

            times = {}
            for name, fn in (("op", op), ("sdpa", sdpa)):
                fn()
                samples = []
                for _ in range(args.reps):
                    t = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t)
                times[name] = statistics.median(samples)
            records.append({"procs": 1, "dtype": str(dtype).replace("torch.", ""), "pass": "fwd vs torch SDPA",
                            "op_s": times["op"], "sdpa_s": times["sdpa"], "ratio": times["op"] / times["sdpa"]})
    if rank == 0:
        queue.put(records)
    dist.destroy_process_group()


def run(world, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=bench_rank, args=(r, world, args, os.path.join(tmp, "init"), queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        records = queue.get(timeout=900)
        for p in procs:
            p.join()
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--strategy", default="zigzag-ring")
    args = parser.parse_args()
    records = []
    for world in (1, 2, 4):
        records += run(world, args)
    print(f"{args.tokens} tokens, Hq {HQ}, Hkv {HKV}, d {D}, strategy {args.strategy}, median of {args.reps}")
    print(f"{'procs':>5} {'dtype':>9} {'pass':>18} {'op ms':>9} {'other ms':>9} {'ratio':>6}  other")
    for r in records:
        other = r.get("cxx_s", r.get("sdpa_s"))
        kind = "C++ DistributedAttention" if "cxx_s" in r else "torch SDPA (masked)"
        print(f"{r['procs']:>5} {r['dtype']:>9} {r['pass']:>18} {1e3 * r['op_s']:9.2f} {1e3 * other:9.2f} "
              f"{r['ratio']:6.3f}  {kind}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "strategy": args.strategy, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
