# SPDX-License-Identifier: Apache-2.0
"""seqpar's torch op against torch's own CPU attention on one process (issue 39, "Measure").

    PYTHONPATH=python build/venv/bin/python bench/torch_overhead.py [--json FILE] [--tokens 8192] [--smoke]

One gloo process (world 1, a file:// store made by the script), one packed sequence of --tokens tokens,
two batches:
  dense  one document: seqpar.torch.varlen_attention against F.scaled_dot_product_attention(is_causal=True)
         on (1, H, T, d);
  mix    a long-tail mix of --docs documents: against SDPA with a dense boolean block-diagonal causal
         mask (what a user without varlen support writes) and against a loop of SDPA is_causal calls,
         one per document (the fair peer).
fp32 and bf16, forward and forward+backward, for each head configuration (q heads / kv heads / head_dim;
kv heads < q heads is GQA: SDPA gets enable_gqa=True). Also "seqpar C++": the extension's layer called
directly (pybind, no torch dispatch, no autograd), which separates the op's binding cost from the kernels.

Each input lives in its implementation's natural layout, made before timing: seqpar (T, H, d), SDPA
(1, H, T, d) contiguous. Both run torch.get_num_threads() threads (seqpar's layer takes it by default).
Timing: --warmup calls, then --reps rounds that call every implementation of a case in turn (so that a
load change on a shared machine hits them alike); the table shows the best of the rounds, the JSON also
the median. GFLOP/s counts only the causal pairs: P = sum over documents of n(n+1)/2, forward 4 d P Hq
FLOPs (q.k and p.v, 2 d each), forward+backward 3.5x that (backward = 2.5x forward, FlashAttention's
convention); a masked dense call does more work for the same count.

Then torch.compile(fullgraph=True) of a small function calling varlen_attention on q, k, v, cu_seqlens,
fed batches of different document counts (one sequence, --tokens tokens): compilations counted by a
backend wrapping aot_eager, the first call's and a second call's time (forward+backward) per batch.
The op's goal (issue 39): no compilation after the first two batches.
"""
import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

DEFAULT_HEADS = ("8/8/64", "8/2/128")


def mix_lengths(tokens, docs, seed):
    """A long-tail mix: `docs` lognormal document lengths summing to `tokens` (each >= 1)."""
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0.0, 1.3) for _ in range(docs)]
    scale = (tokens - docs) / sum(weights)
    out = [1 + int(w * scale) for w in weights]
    out[out.index(max(out))] += tokens - sum(out)  # the rounding's remainder to the longest
    return out


def causal_pairs(lengths):
    return sum(n * (n + 1) // 2 for n in lengths)


def timed(fns, warmup, reps):
    """{name: (best s, median s)}: warm-up calls, then `reps` rounds calling each fn in turn."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {name: (min(s), statistics.median(s)) for name, s in samples.items()}


def measure(args, torch, spt):
    import torch.nn.functional as F

    records = []
    for heads in args.heads:
        hq, hkv, d = (int(x) for x in heads.split("/"))
        gqa = {"enable_gqa": True} if hkv != hq else {}
        attn = spt.DistributedAttention(args.strategy, hq, hkv, d)
        batches = (("dense", [args.tokens]), ("mix", mix_lengths(args.tokens, args.docs, seed=39)))
        for case, lengths in (b for b in batches if b[0] in args.cases):
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
            cu[1:] = torch.tensor(lengths).cumsum(0)
            spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
            rows = attn.token_indices(cu_seqlens=cu)  # world 1: every token, in the plan's order
            mask = None
            if case == "mix":
                doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                mask = (doc[:, None] == doc[None, :]).tril()  # (T, T) bool, block-diagonal causal
            pairs = causal_pairs(lengths)
            for dtype in (getattr(torch, name) for name in args.dtypes):
                gen = torch.Generator().manual_seed(1)
                q, k, v, do = (torch.randn(args.tokens, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
                # seqpar's rows (T, H, d) in the plan's order; SDPA's (1, H, T, d) in the packed order.
                sq, sk, sv, sdo = (x[rows].contiguous() for x in (q, k, v, do))
                tq, tk, tv, tdo = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do))

                def seqpar_fn(a, b, c):
                    return spt.varlen_attention(a, b, c, cu, layer=attn)

                def cxx_fwd():
                    return attn._layer.forward(sq, sk, sv, cu, None, None, 0, 0.0)

                def cxx_fwd_bwd():
                    o, lse = attn._layer.forward(sq, sk, sv, cu, None, None, 0, 0.0)
                    attn._layer.backward(sq, sk, sv, o, lse, sdo, cu, None, None, 0, 0.0)

                peers = {}
                if case == "dense":
                    peers["sdpa is_causal"] = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                                             **gqa)
                else:
                    peers["sdpa per-doc loop"] = lambda a, b, c: torch.cat(
                        [F.scaled_dot_product_attention(a[:, :, s:e], b[:, :, s:e], c[:, :, s:e], is_causal=True,
                                                        **gqa) for s, e in spans], dim=2)
                    if not args.no_masked:
                        peers["sdpa masked"] = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask,
                                                                                              **gqa)
                # The outputs agree (the same work is timed): seqpar's rows against each peer's, fp32 scale.
                with torch.no_grad():
                    ref = seqpar_fn(sq, sk, sv).float()
                    errs = {name: (fn(tq, tk, tv)[0].transpose(0, 1)[rows].float() - ref).abs().max().item()
                            for name, fn in peers.items()}
                for what in ("fwd", "fwd+bwd"):
                    fns = {}
                    if what == "fwd":
                        fns["seqpar"] = lambda: seqpar_fn(sq, sk, sv)
                        fns["seqpar C++"] = cxx_fwd
                        for name, fn in peers.items():
                            fns[name] = (lambda fn: lambda: fn(tq, tk, tv))(fn)
                    else:
                        lq, lk, lv = (x.clone().requires_grad_(True) for x in (sq, sk, sv))
                        pq, pk, pv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

                        def seqpar_train():
                            lq.grad = lk.grad = lv.grad = None
                            seqpar_fn(lq, lk, lv).backward(sdo)

                        fns["seqpar"] = seqpar_train
                        fns["seqpar C++"] = cxx_fwd_bwd
                        for name, fn in peers.items():
                            def peer_train(fn=fn):
                                pq.grad = pk.grad = pv.grad = None
                                fn(pq, pk, pv).backward(tdo)

                            fns[name] = peer_train
                    times = timed(fns, args.warmup, args.reps)
                    flops = 4 * d * pairs * hq * (1.0 if what == "fwd" else 3.5)
                    for name, (best, median) in times.items():
                        records.append({
                            "heads_q": hq, "heads_kv": hkv, "head_dim": d, "case": case, "documents": len(lengths),
                            "tokens": args.tokens, "causal_pairs": pairs, "dtype": str(dtype).replace("torch.", ""),
                            "pass": what, "impl": name, "best_s": best, "median_s": median,
                            "gflops": flops / best / 1e9, "seqpar_over_this": times["seqpar"][0] / best,
                            "max_abs_diff_vs_seqpar": errs.get(name)})
                    print(f"  measured {heads} {case} {dtype} {what}", file=sys.stderr, flush=True)
    return records


def measure_compile(args, torch, spt):
    """Compilations and first-call seconds per new document count under torch.compile(fullgraph=True)."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    hq, hkv, d = (int(x) for x in args.heads[0].split("/"))
    attn = spt.DistributedAttention(args.strategy, hq, hkv, d)
    torch._dynamo.reset()
    compilations = [0]

    def counting(gm, example_inputs):
        compilations[0] += 1
        return aot_eager(gm, example_inputs)

    def step(q, k, v, cu_seqlens):
        return spt.varlen_attention(q, k, v, cu_seqlens, layer=attn)

    compiled = torch.compile(step, fullgraph=True, backend=counting)
    records = []
    for i, docs in enumerate(args.compile_docs):
        lengths = mix_lengths(args.tokens, docs, seed=100 + i)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        gen = torch.Generator().manual_seed(i)
        q, k, v, do = (torch.randn(args.tokens, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        before = compilations[0]
        seconds = []
        for _ in range(2):
            t = time.perf_counter()
            compiled(q, k, v, cu).backward(do)
            seconds.append(time.perf_counter() - t)
        records.append({"batch": i, "documents": docs, "tokens": args.tokens, "heads_q": hq, "heads_kv": hkv,
                        "head_dim": d, "new_compilations": compilations[0] - before,
                        "compilations": compilations[0], "first_call_s": seconds[0], "second_call_s": seconds[1]})
        print(f"  compiled batch {i} ({docs} documents)", file=sys.stderr, flush=True)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the environment and every row here")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=30, help="documents in the mix")
    parser.add_argument("--heads", nargs="+", default=list(DEFAULT_HEADS), help="q heads/kv heads/head_dim")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (the table: the best)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--strategy", default="zigzag-ring")
    parser.add_argument("--compile-docs", type=int, nargs="+", default=[30, 17, 45, 8, 60, 23],
                        help="the document counts of the torch.compile batches")
    parser.add_argument("--no-masked", action="store_true", help="skip SDPA with the dense mask (slow)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--cases", nargs="+", choices=("dense", "mix"), default=["dense", "mix"])
    parser.add_argument("--threads", type=int, help="torch.set_num_threads first (both sides; default: torch's)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--smoke", action="store_true", help="a tiny size that runs in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.docs, args.heads, args.reps, args.warmup = 256, 6, ["4/2/64"], 1, 1
        args.compile_docs = [5, 3, 7]

    import torch
    import torch.distributed as dist

    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1)
        try:
            import seqpar.torch as spt

            env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "nproc": os.cpu_count(),
                   "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "load_average": os.getloadavg(), "machine": platform.machine(), "strategy": args.strategy,
                   "tokens": args.tokens, "reps": args.reps, "warmup": args.warmup,
                   "timing": "best of reps", "argv": sys.argv[1:]}
            probe = spt.DistributedAttention(args.strategy, 1, 1, 64)
            env["seqpar_threads"], env["seqpar_cpu_isa"] = probe.threads, probe.cpu_isa
            del probe
            print(f"torch {env['torch']}, threads {env['threads']} (seqpar {env['seqpar_threads']}), nproc "
                  f"{env['nproc']}, torch cpu capability {env['cpu_capability']}, seqpar cpu_isa "
                  f"{env['seqpar_cpu_isa']}, load average {' '.join(f'{x:.2f}' for x in env['load_average'])}",
                  flush=True)
            records = measure(args, torch, spt)
            compile_records = [] if args.no_compile else measure_compile(args, torch, spt)
        finally:
            dist.destroy_process_group()
    env["load_average_after"] = os.getloadavg()

    print(f"\n{args.tokens} tokens, one sequence; strategy {args.strategy} on 1 gloo process; best of {args.reps} "
          f"after {args.warmup} warm-up; GFLOP/s by causal pairs (fwd 4dP per head, fwd+bwd 3.5x)")
    print(f"{'heads':>8} {'case':>5} {'docs':>4} {'dtype':>8} {'pass':>7}  {'impl':<18} {'best ms':>9} "
          f"{'median ms':>9} {'GFLOP/s':>8} {'seqpar/this':>11}")
    for r in records:
        heads = f"{r['heads_q']}/{r['heads_kv']}/{r['head_dim']}"
        print(f"{heads:>8} {r['case']:>5} {r['documents']:>4} {r['dtype']:>8} {r['pass']:>7}  {r['impl']:<18} "
              f"{1e3 * r['best_s']:9.2f} {1e3 * r['median_s']:9.2f} {r['gflops']:8.1f} {r['seqpar_over_this']:11.3f}")
    for r0 in compile_records[:1]:
        print(f"\ntorch.compile(fullgraph=True, aot_eager) of varlen_attention, {args.tokens} tokens, "
              f"{r0['heads_q']}/{r0['heads_kv']}/{r0['head_dim']} fp32, forward+backward per call")
        print(f"{'batch':>5} {'docs':>5} {'new compilations':>16} {'total':>5} {'first call s':>12} "
              f"{'second call s':>13}")
    for r in compile_records:
        print(f"{r['batch']:>5} {r['documents']:>5} {r['new_compilations']:>16} {r['compilations']:>5} "
              f"{r['first_call_s']:12.3f} {r['second_call_s']:13.3f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in env['load_average_after'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "records": records, "compile": compile_records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
