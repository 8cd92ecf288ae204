#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch's attention on the shapes of bench/attention_cuda.cpp, in the same conventions.

bf16, 16 query and 16 KV heads, head dim 64 and 128, 16K tokens as 1 x 16K, 4 x 4K and 32 x 512
causal sequences, and one packed sequence of lognormal documents (document-causal). FLOPs are
4 * d * Hq * (visible pairs) forward and 2.5x that backward, as in attention_cuda, so the TFLOP/s
compare directly.

Peers:
  - torch.nn.functional.scaled_dot_product_attention(is_causal=True) under
    sdpa_kernel(SDPBackend.FLASH_ATTENTION) and sdpa_kernel(SDPBackend.CUDNN_ATTENTION).
    Equal-length mixes run as one batched call, (B, H, L, d) views of (B, L, H, d) tensors (the
    layout FlashAttention reads without a copy). The packed mix runs per document: a Python loop of
    one call per document, each document its own leaf tensor (no gather or scatter is counted).
  - torch.nn.attention.varlen.varlen_attn on the packed mix, when this torch has it (FlashAttention's
    varlen kernel over cu_seqlens: the packed route torch offers itself).
  A backend this torch or this GPU lacks is recorded with its error, not fatal.

Timing (the same as attention_cuda): CUDA events around `inner` back-to-back calls, inner chosen so
that a sample lasts a few milliseconds, after warm-up; the median over the samples, per call.
  forward:  the training forward (autograd records the graph and the kernel saves its LSE).
  backward: torch.autograd.grad over a graph built once and retained (retain_graph=True), so that
            each timed call is the backward alone; grads are returned, not accumulated into .grad.

  torch_peers.py [--mixes FILE] [--json FILE] [--compare attention_cuda.json] [--smoke] [--dry-run]
--mixes reads the token mixes attention_cuda wrote (--mixes-out); without it the same generator runs
here (splitmix64 + Box-Muller, bit for bit the C++ one). --dry-run prints the shapes and checks the
mixes file against the generator, without torch. Without torch or a CUDA device it says so and exits 77.
--device cpu runs the same code on torch's CPU kernels (cuDNN and varlen then record their errors): a
way to try the script where there is no GPU, not a measurement.
"""

import argparse
import json
import math
import sys
import time

HEADS = 16
HEAD_DIMS = ((64, 64), (128, 128))  # (q/k, v) head sizes
MLA_HEAD_DIMS = ((192, 128),)  # --mla: DeepSeek's q/k 192, v 128 (beside attention_cuda --compare's 192/128)
TOKENS = 16384
# The packed mix: must match attention_cuda.cpp (LognormalSpec in main).
LOGNORMAL = {"median": 256.0, "sigma": 1.0, "seed": 20240607}
SMOKE_TOKENS, SMOKE_HEADS, SMOKE_MEDIAN = 256, 2, 16.0
MASK64 = (1 << 64) - 1


# ---- the token mixes (bench/attention_cuda.cpp, the same integers) ---------------------------------
class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):  # in (0, 1)
        return (float(self.next() >> 11) + 0.5) * 2.0**-53


def lognormal_docs(tokens, median, sigma, seed):
    rng = SplitMix64(seed)
    docs, left = [], tokens
    while left > 0:
        u1, u2 = rng.uniform(), rng.uniform()
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(6.283185307179586 * u2)
        x = median * math.exp(sigma * z)
        length = min(max(int(x), 1), left)
        docs.append(length)
        left -= length
    return docs


def make_mixes(tokens, median, sigma, seed):
    mixes = []
    for seqs in (1, 4, 32):
        if tokens % seqs == 0:
            mixes.append({"name": "%dx%d" % (seqs, tokens // seqs), "sequences": [[tokens // seqs]] * seqs})
    mixes.append({"name": "lognormal", "sequences": [lognormal_docs(tokens, median, sigma, seed)]})
    return mixes


def documents(mix):
    return [n for seq in mix["sequences"] for n in seq]


def visible_pairs(mix):  # document-causal: every document sees its own prefix
    return sum(n * (n + 1) // 2 for n in documents(mix))


def uniform(mix):  # one document per sequence, all of one length: a batched SDPA call
    return all(len(s) == 1 for s in mix["sequences"]) and len(set(documents(mix))) == 1


def resolve_mixes(args):
    tokens = SMOKE_TOKENS if args.smoke else TOKENS
    median = SMOKE_MEDIAN if args.smoke else LOGNORMAL["median"]
    generated = make_mixes(tokens, median, LOGNORMAL["sigma"], LOGNORMAL["seed"])
    if not args.mixes:
        return generated, "generated here (no --mixes)", None
    try:
        with open(args.mixes) as f:
            loaded = json.load(f)["mixes"]
    except (OSError, ValueError, KeyError) as e:
        return generated, "generated here (--mixes %s unreadable: %s)" % (args.mixes, e), None
    agree = [m["sequences"] for m in loaded] == [m["sequences"] for m in generated]
    return loaded, "read from %s" % args.mixes, agree


# ---- timing ---------------------------------------------------------------------------------------
class Timer:
    """Milliseconds of device time: CUDA events on the current stream (a host clock with --device cpu)."""

    def __init__(self, torch, device):
        self.cuda = device == "cuda"
        if self.cuda:
            self.start, self.stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def time(self, body):
        if not self.cuda:
            t0 = time.perf_counter()
            body()
            return (time.perf_counter() - t0) * 1e3
        self.start.record()
        body()
        self.stop.record()
        self.stop.synchronize()
        return self.start.elapsed_time(self.stop)


def time_calls(timer, call, warmup, samples, sample_ms, max_inner):
    for _ in range(warmup):
        call()
    one = timer.time(call)
    inner = min(max(int(math.ceil(sample_ms / max(one, 1e-3))), 1), max_inner)

    def sample():
        for _ in range(inner):
            call()

    per_call = sorted(timer.time(sample) / inner for _ in range(samples))
    return {"ms": per_call[len(per_call) // 2], "min_ms": per_call[0], "inner": inner, "samples": samples}


# ---- the peers ------------------------------------------------------------------------------------
def sdpa_route(torch, device, backend, mix, heads, d, dv):
    """(forward, backward) closures of SDPA under one backend: batched or per document."""
    from torch.nn.attention import sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator(device=device).manual_seed(1)

    def leaf(b, n, width):  # (B, L, H, width) storage, used as its (B, H, L, width) view
        return torch.randn(b, n, heads, width, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()

    if uniform(mix):
        n, b = documents(mix)[0], len(mix["sequences"])
        groups = [[leaf(b, n, d), leaf(b, n, d), leaf(b, n, dv)]]
    else:
        groups = [[leaf(1, n, d), leaf(1, n, d), leaf(1, n, dv)] for n in documents(mix)]

    def forward():
        with sdpa_kernel(backend):
            return [sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True) for q, k, v in groups]

    outs = forward()  # the graph every timed backward walks again
    douts = [torch.randn_like(o) for o in outs]  # the strides of the output: no copy inside the backward
    inputs = [t for g in groups for t in g]

    def backward():
        with sdpa_kernel(backend):
            return torch.autograd.grad(outs, inputs, grad_outputs=douts, retain_graph=True)

    return forward, backward


def varlen_route(torch, device, mix, heads, d, dv):
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    docs = documents(mix)
    n = sum(docs)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(n, heads, width, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
        for width in (d, d, dv)
    )
    cu = torch.tensor([0] + [sum(docs[: i + 1]) for i in range(len(docs))], device=device, dtype=torch.int32)
    params = inspect.signature(varlen_attn).parameters
    # torch 2.9/2.10 take is_causal; later releases express causal as window_size=(-1, 0).
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    m = max(docs)

    def forward():
        return varlen_attn(q, k, v, cu, cu, m, m, **causal)

    out = forward()
    dout = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad_outputs=dout, retain_graph=True)

    return forward, backward


def first_line(e):
    text = str(e).strip()
    return "%s: %s" % (type(e).__name__, text.splitlines()[0][:160] if text else "")


def run_peers(args, mixes):
    try:
        import torch
    except ImportError as e:
        print("torch_peers: no torch on this machine (%s): skipped" % e)
        return 77, []
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_peers: torch %s sees no CUDA device: skipped" % torch.__version__)
        return 77, []
    dev = args.device
    from torch.nn.attention import SDPBackend

    heads = SMOKE_HEADS if args.smoke else HEADS
    plan = dict(warmup=0, samples=1, sample_ms=0.0, max_inner=1) if args.smoke else dict(
        warmup=3, samples=args.reps, sample_ms=4.0, max_inner=100)
    props = torch.cuda.get_device_properties(0) if dev == "cuda" else None
    env = {"kind": "env", "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "device": props.name if props else dev,
           "multiprocessors": props.multi_processor_count if props else 0, "smoke": args.smoke,
           "timing": "CUDA events around inner back-to-back calls; median of samples, per call",
           "forward": "training forward (autograd on)", "backward": "torch.autograd.grad on a retained graph"}
    print("torch %s, CUDA %s, cuDNN %s, %s (%d SMs)" % (env["torch"], env["cuda"], env["cudnn"], env["device"],
                                                        env["multiprocessors"]))
    timer = Timer(torch, dev)
    records = [env]
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    chosen = [b for b in args.backends.split(",") if b]
    print("%-4s %-10s %5s %4s %-16s %9s %9s" % ("pass", "mix", "docs", "d", "peer", "ms", "TFLOP/s"))
    for d, dv in (MLA_HEAD_DIMS if args.mla else HEAD_DIMS):
        if args.head_dim and d != args.head_dim:
            continue
        for mix in mixes:
            peers = []
            for name in chosen:
                if name == "varlen":
                    if not uniform(mix):
                        peers.append(("varlen", "varlen", lambda mix=mix: varlen_route(torch, dev, mix, heads, d, dv)))
                elif name in backends:
                    route = "batched" if uniform(mix) else "per-document"
                    peers.append((name, route, lambda b=backends[name], mix=mix: sdpa_route(torch, dev, b, mix, heads, d, dv)))
                else:
                    print("torch_peers: unknown backend %r (flash, cudnn, varlen)" % name, file=sys.stderr)
            fwd_flops = 2.0 * (d + dv) * heads * visible_pairs(mix)  # 4 d Hq pairs where dv == d
            for name, route, make in peers:
                base = {"kind": "attention", "impl": "torch", "backend": name, "route": route, "dtype": "bf16",
                        "mix": mix["name"], "sequences": len(mix["sequences"]), "documents": len(documents(mix)),
                        "tokens": sum(documents(mix)), "head_dim": d, "head_dim_v": dv, "heads_q": heads, "heads_kv": heads,
                        "mask": "document-causal", "visible_pairs": visible_pairs(mix)}
                label = "%s/%s" % (name, route)
                try:
                    forward, backward = make()
                except Exception as e:  # a backend this torch or GPU lacks: recorded, not fatal
                    for p in ("fwd", "bwd"):
                        records.append(dict(base, **{"pass": p, "error": "%s: %s" % (type(e).__name__, e)}))
                    print("%-4s %-10s %5d %4d %-16s  error: %s" % ("both", mix["name"], len(documents(mix)), d, label,
                                                                  first_line(e)))
                    continue
                for p, call, flops in (("fwd", forward, fwd_flops), ("bwd", backward, 2.5 * fwd_flops)):
                    try:
                        t = time_calls(timer, call, **plan)
                        rec = dict(base, **{"pass": p, "flops": flops, "tflops": flops / t["ms"] * 1e-9}, **t)
                        print("%-4s %-10s %5d %4d %-16s %9.3f %9.1f" % (p, mix["name"], len(documents(mix)), d, label,
                                                                       t["ms"], rec["tflops"]))
                    except Exception as e:
                        rec = dict(base, **{"pass": p, "error": "%s: %s" % (type(e).__name__, e)})
                        print("%-4s %-10s %5d %4d %-16s  error: %s" % (p, mix["name"], len(documents(mix)), d, label,
                                                                      first_line(e)))
                    records.append(rec)
                    sys.stdout.flush()
                del forward, backward
                if dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
    return 0, records


# ---- seqpar beside the best peer --------------------------------------------------------------------
def compare(path, records):
    """Records of seqpar's figure over the best torch peer per (mix, d, pass), printed as a table."""
    try:
        with open(path) as f:
            ours = [r for r in json.load(f) if r.get("kind") == "attention"]
    except (OSError, ValueError) as e:
        print("compare: cannot read %s: %s" % (path, e))
        return []
    out = []
    print("\nTFLOP/s, seqpar beside torch (ratio: seqpar / best peer; per-doc: seqpar / torch's per-document route)")
    print("%-9s %-4s %-10s %4s %9s %9s %-22s %7s %7s" % ("kernel", "pass", "mix", "d", "seqpar", "torch", "best peer",
                                                       "ratio", "per-doc"))
    for r in ours:
        peers = [p for p in records if p.get("kind") == "attention" and "tflops" in p and p["mix"] == r["mix"]
                 and p["head_dim"] == r["head_dim"] and p["pass"] == r["pass"]]
        best = max(peers, key=lambda p: p["tflops"], default=None)
        per_doc = max((p for p in peers if p["route"] == "per-document"), key=lambda p: p["tflops"], default=None)
        rec = {"kind": "comparison", "kernel": r.get("kernel", "CudaFlash"), "mix": r["mix"],
               "head_dim": r["head_dim"], "pass": r["pass"],
               "seqpar_tflops": r.get("tflops"), "best_peer": None, "best_peer_tflops": None, "ratio": None}
        if best is not None:
            rec.update(best_peer="%s/%s" % (best["backend"], best["route"]), best_peer_tflops=best["tflops"])
            if r.get("tflops"):
                rec["ratio"] = r["tflops"] / best["tflops"]
        if per_doc is not None and r.get("tflops"):
            rec["ratio_vs_per_document"] = r["tflops"] / per_doc["tflops"]
        out.append(rec)

        def fmt(x, spec):
            return spec % x if x is not None else "n/a"

        print("%-9s %-4s %-10s %4d %9s %9s %-22s %7s %7s" % (
            rec["kernel"], r["pass"], r["mix"], r["head_dim"], fmt(r.get("tflops"), "%.1f"), fmt(rec["best_peer_tflops"], "%.1f"),
            rec["best_peer"] or "none", fmt(rec["ratio"], "%.2fx"), fmt(rec.get("ratio_vs_per_document"), "%.2fx")))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", help="the token mixes attention_cuda wrote (--mixes-out)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--compare", help="attention_cuda's --json: print seqpar beside the best peer")
    ap.add_argument("--backends", default="flash,cudnn,varlen", help="comma list of flash, cudnn, varlen")
    ap.add_argument("--head-dim", type=int, default=0, choices=(0, 64, 128, 192))
    ap.add_argument("--mla", action="store_true", help="head sizes 192/128 (q/k, v) instead of 64 and 128")
    ap.add_argument("--reps", type=int, default=15, help="timed samples per case")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one sample")
    ap.add_argument("--dry-run", action="store_true", help="print the shapes (and check --mixes), no torch")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: to try this script where there is no GPU (torch's CPU flash; no cuDNN, no varlen)")
    args = ap.parse_args()

    mixes, source, agree = resolve_mixes(args)
    heads = SMOKE_HEADS if args.smoke else HEADS
    print("torch_peers: mixes %s%s" % (source, "" if agree is None else
                                        "; the generator here %s it" % ("agrees with" if agree else "DIFFERS from")))
    for mix in mixes:
        docs = documents(mix)
        print("  %-10s %3d sequences %4d documents %6d tokens (longest %d), %d visible pairs, fwd %.3g FLOP at d 128"
              % (mix["name"], len(mix["sequences"]), len(docs), sum(docs), max(docs), visible_pairs(mix),
                 4.0 * 128 * heads * visible_pairs(mix)))
    if args.dry_run:
        print("torch_peers: dry run: heads %d, head dims %s, backends %s"
              % (heads, MLA_HEAD_DIMS if args.mla else HEAD_DIMS, args.backends))
        return 1 if agree is False else 0

    rc, records = run_peers(args, mixes)
    if rc != 0:
        return rc
    if args.compare:
        records += compare(args.compare, records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
