#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The torch op's CUDA path on one process (NCCL world of 1), each kernel choice against float64.

seqpar.torch.DistributedAttention(strategy, heads_q, heads_kv, head_dim, kernel=...) with kernel "auto",
"flash" (torch's own flash-attention ops), "cudnn" (attention::CudnnSdpa) and "seqpar"
(attention::CudaFlash): forward and backward of a packed batch of documents (a one-row document among
long ones), GQA 8:2, head size 128, bf16 and fp16, causal and a sliding window, against a float64 CPU
reference computed here (per document: softmax(q k^T * scale) v, causal within the document, and the
natural-log LSE of the scaled scores). A choice the layer refuses (a kernel this build or this GPU does
not have, or a layer without the `kernel` argument) is printed with its message and skipped, not failed.

Then the op's refusals on CUDA tensors (issue 40): a bad dtype and a bad window raise ValueError by name on
the layer's NCCL transport, and the layer's next good call runs.

Tolerances (max |error| / max(1, max |reference|)): forward 1e-2, backward 2e-2, those of
python/tests/test_cuda.py for 16-bit types.

  torch_op_cuda.py [--json FILE]
Exit: 0 every choice that ran is within tolerance; 1 one is not (or raised); 77 no CUDA build of the
extension (SEQPAR_TORCH_CUDA=1), no torch or no GPU. Written on a machine without a GPU (2026-12-07):
never run; bench/device/run.sh runs it after building the extension.
"""

import argparse
import json
import math
import os
import socket
import sys

KERNELS = ("auto", "flash", "cudnn", "seqpar")
LENGTHS = [[300, 1, 77, 150, 500], [256, 64]]  # a one-row document; two sequences
HEADS_Q, HEADS_KV, HEAD_DIM = 8, 2, 128
TOL_FORWARD, TOL_BACKWARD = 1e-2, 2e-2


def reference(torch, q, k, v, lengths, window):
    """float64 O (tokens, Hq, d), LSE (Hq, tokens) and a closure for dq, dk, dv given dO, per document."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[2])
    outs, lses, at = [], [], 0
    for n in (n for seq in lengths for n in seq):
        qs = q[at:at + n].transpose(0, 1)  # (H, n, d)
        ks = k[at:at + n].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[at:at + n].repeat_interleave(group, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        i = torch.arange(n).view(n, 1)
        j = torch.arange(n).view(1, n)
        visible = j <= i
        if window > 0:
            visible &= j > i - window
        s = s.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # (H, n)
        outs.append((torch.softmax(s, dim=-1) @ vs).transpose(0, 1))
        lses.append(lse)
        at += n
    o, lse = torch.cat(outs, 0), torch.cat(lses, 1)

    def grads(dout):
        return torch.autograd.grad(o, (q, k, v), dout.double())

    return o.detach(), lse.detach(), grads


def error(torch, got, want):
    got = got.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item()) if want.numel() else 0.0


def run_choice(torch, spt, kernel, dtype, window, records):
    label = "%s %s window %s" % (kernel, str(dtype).replace("torch.", ""), window or "none")
    try:
        attn = spt.DistributedAttention("zigzag-ring", HEADS_Q, HEADS_KV, HEAD_DIM, timeout_s=60, kernel=kernel)
    except (TypeError, ValueError, RuntimeError) as e:  # a choice the layer (or this build) refuses
        print("%-34s refused: %s" % (label, str(e).splitlines()[0][:200]))
        records.append({"kernel": kernel, "dtype": str(dtype), "window": window, "refused": str(e)})
        return True
    total = sum(sum(s) for s in LENGTHS)
    gen = torch.Generator().manual_seed(38)
    q, k, v, do = (torch.randn(total, h, HEAD_DIM, generator=gen).to(dtype).double()
                   for h in (HEADS_Q, HEADS_KV, HEADS_KV, HEADS_Q))
    o_ref, lse_ref, grads = reference(torch, q, k, v, LENGTHS, window)
    dq_ref, dk_ref, dv_ref = grads(do)
    rows = attn.token_indices(LENGTHS)
    lq, lk, lv = (x[rows].to("cuda", dtype).requires_grad_(True) for x in (q, k, v))
    window_size = (window - 1, 0) if window > 0 else (-1, 0)
    rec = {"kernel": kernel, "dtype": str(dtype), "window": window}
    try:
        o, lse = attn(lq, lk, lv, LENGTHS, return_lse=True, window_size=window_size)
        o.backward(do[rows].to("cuda", dtype))
        torch.cuda.synchronize()
        errs = {"o": error(torch, o, o_ref[rows]), "lse": error(torch, lse, lse_ref[:, rows]),
                "dq": error(torch, lq.grad, dq_ref[rows]), "dk": error(torch, lk.grad, dk_ref[rows]),
                "dv": error(torch, lv.grad, dv_ref[rows])}
    except Exception as e:  # noqa: BLE001: a failure of a choice the layer accepted is a failure
        print("%-34s FAILED: %s: %s" % (label, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else ""))
        records.append(dict(rec, error="%s: %s" % (type(e).__name__, e)))
        return False
    ran = getattr(attn, "kernel", None)  # the layer's report of the kernel that ran, where it gives one
    ok = all(err < (TOL_FORWARD if what in ("o", "lse") else TOL_BACKWARD) for what, err in errs.items())
    print("%-34s ran %-10s %s  %s" % (label, ran if ran is not None else "?",
                                      " ".join("%s %.1e" % kv for kv in errs.items()), "ok" if ok else "WRONG"))
    records.append(dict(rec, ran=str(ran), errors=errs, ok=ok))
    return ok


def run_refusals(torch, spt, records):
    """Issue 40, item 4 on the CUDA path (one rank: no peer to strand, but the refusal's agreement runs on the
    layer's own NCCL transport, made by the refused first call): the op's own checks (q.dtype in C++, the
    window in Python) raise ValueError naming the argument, and the layer's next good call still runs and
    agrees (a refusal that left the transport out of step would hang or fail it)."""
    attn = spt.DistributedAttention("zigzag-ring", HEADS_Q, HEADS_KV, HEAD_DIM, timeout_s=60)
    n = len(attn.token_indices(LENGTHS))
    q, k, v = (torch.randn(n, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for h in (HEADS_Q, HEADS_KV, HEADS_KV))
    cases = [("q.dtype", dict(q=q.int()), "q.dtype"), ("window", dict(window_size=(3, 1)), "window_size")]
    ok = True
    for name, bad, word in cases:
        args = dict(dict(q=q, k=k, v=v), **{key: val for key, val in bad.items() if key in ("q", "k", "v")})
        try:
            attn(args["q"], args["k"], args["v"], LENGTHS, window_size=bad.get("window_size", (-1, 0)))
            what = "no error"
        except (TypeError, ValueError, RuntimeError) as e:
            what = "%s: %s" % (type(e).__name__, e)
        good = what.startswith("ValueError") and word in what
        print("%-34s %s" % ("refusal " + name, ("refused by name" if good else "WRONG: " + what[:200])))
        records.append({"refusal": name, "message": what, "ok": good})
        ok = ok and good
    try:
        o = attn(q, k, v, LENGTHS)
        torch.cuda.synchronize()
        good = bool(torch.isfinite(o.float()).all())
        what = "ran" if good else "non-finite output"
    except Exception as e:  # noqa: BLE001
        good, what = False, "%s: %s" % (type(e).__name__, e)
    print("%-34s %s" % ("refusal then a good call", what[:200]))
    records.append({"refusal": "then a good call", "message": what, "ok": good})
    return ok and good


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args()
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print("torch_op_cuda: no torch (%s): skipped" % e)
        return 77
    try:
        import seqpar.torch as spt
    except ImportError as e:
        print("torch_op_cuda: seqpar's extension is not importable (%s): skipped" % e)
        return 77
    if not spt.CUDA:
        print("torch_op_cuda: seqpar._C was built without SEQPAR_TORCH_CUDA=1: skipped")
        return 77
    if not torch.cuda.is_available():
        print("torch_op_cuda: torch %s sees no CUDA device: skipped" % torch.__version__)
        return 77
    with socket.socket() as s:  # a free port for the world of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    print("torch %s, CUDA %s, cuDNN %s, %s" % (torch.__version__, torch.version.cuda, torch.backends.cudnn.version(),
                                               torch.cuda.get_device_name(0)))
    records, ok = [], True
    try:
        for kernel in KERNELS:
            for dtype in (torch.bfloat16, torch.float16):
                for window in (0, 64):
                    ok = run_choice(torch, spt, kernel, dtype, window, records) and ok
        ok = run_refusals(torch, spt, records) and ok
    finally:
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
