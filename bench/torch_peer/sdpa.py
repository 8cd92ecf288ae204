# SPDX-License-Identifier: Apache-2.0
"""PyTorch's CPU scaled_dot_product_attention on one shape of bench/attention_cpu (its --peer torch).

Same problem: seq tokens, Hq query heads, Hkv KV heads (GQA by repeat_interleave outside the timing:
SDPA's enable_gqa is used when this torch has it), head_dim d, fp32 or bf16, documents causal each (one
SDPA call per document with is_causal=True, which is what selects torch's fused CPU flash kernel; an
explicit block mask would send it to the unfused math path). FLOPs are counted as in the C++ bench:
4 * d * Hq * visible pairs forward, 2.5x that backward. Prints one line: "fwd GFLOPS bwd GFLOPS".
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--hq", type=int, required=True)
    ap.add_argument("--hkv", type=int, required=True)
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--docs", type=str, required=True, help="comma-separated document lengths")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--budget", type=float, default=2.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    docs = [int(x) for x in a.docs.split(",")]
    area = sum(n * (n + 1) // 2 for n in docs)
    g = torch.Generator().manual_seed(1)
    qs, ks, vs, dos = [], [], [], []
    for n in docs:  # (1, H, n, d) per document
        qs.append(torch.randn(1, a.hq, n, a.d, generator=g).to(dt).requires_grad_())
        ks.append(torch.randn(1, a.hkv, n, a.d, generator=g).to(dt).requires_grad_())
        vs.append(torch.randn(1, a.hkv, n, a.d, generator=g).to(dt).requires_grad_())
        dos.append(torch.randn(1, a.hq, n, a.d, generator=g).to(dt))
    gqa = a.hq != a.hkv
    kw = {}
    if gqa:
        try:
            F.scaled_dot_product_attention(qs[0][:, :, :1], ks[0][:, :, :1], vs[0][:, :, :1], enable_gqa=True)
            kw["enable_gqa"] = True
        except TypeError:
            rep = a.hq // a.hkv
            ks = [k.detach().repeat_interleave(rep, dim=1).requires_grad_() for k in ks]
            vs = [v.detach().repeat_interleave(rep, dim=1).requires_grad_() for v in vs]

    def fwd():
        with torch.no_grad():
            for q, k, v in zip(qs, ks, vs):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)

    def fwd_bwd():
        for q, k, v, do in zip(qs, ks, vs, dos):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            o.backward(do)

    def best(f, reps):
        # The warm-up is timed too: when it alone exceeds the budget it is the one sample (torch's bf16
        # backward runs at a few GFLOP/s on CPUs without AVX-512 BF16 / AMX: minutes per run at 16K).
        t0 = time.perf_counter()
        f()
        warm = time.perf_counter() - t0
        if warm > a.budget:
            return warm
        b, total, r = 1e300, 0.0, 0
        while r < 2 or (r < reps and total < a.budget):
            t0 = time.perf_counter()
            f()
            s = time.perf_counter() - t0
            b, total, r = min(b, s), total + s, r + 1
        return b

    tf = best(fwd, 5)
    tfb = best(fwd_bwd, 3)
    flops = 4.0 * a.d * a.hq * area
    tb = max(tfb - tf, 1e-9)  # backward alone: forward+backward minus the forward (autograd reruns nothing)
    print(f"{flops / tf * 1e-9:.3f} {2.5 * flops / tb * 1e-9:.3f} torch={torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
