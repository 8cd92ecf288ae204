# SPDX-License-Identifier: Apache-2.0
"""bench/torch_overhead.py --smoke as a test, so that the benchmark does not rot: it runs (one gloo
process, a tiny batch, seconds) and its --json holds every row: each case x dtype x pass x
implementation, with the peers' outputs equal to the op's, and a torch.compile row per batch."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_overhead_smoke(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "torch_overhead.py"), "--smoke", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["threads"] == data["environment"]["seqpar_threads"]
    rows = {(r["case"], r["dtype"], r["pass"], r["impl"]): r for r in data["records"]}
    impls = {"dense": ("seqpar", "seqpar C++", "sdpa is_causal"),
             "mix": ("seqpar", "seqpar C++", "sdpa per-doc loop", "sdpa masked")}
    expected = {(case, dtype, what, impl) for case, names in impls.items() for impl in names
                for dtype in ("float32", "bfloat16") for what in ("fwd", "fwd+bwd")}
    assert set(rows) == expected, sorted(set(rows) ^ expected)
    for key, r in rows.items():
        assert r["best_s"] > 0 and r["best_s"] <= r["median_s"] and r["gflops"] > 0, (key, r)
        if r["max_abs_diff_vs_seqpar"] is not None:  # the peers compute what the op does
            assert r["max_abs_diff_vs_seqpar"] < (1e-4 if key[1] == "float32" else 5e-2), (key, r)
    compiled = data["compile"]
    assert [r["documents"] for r in compiled] == [5, 3, 7]
    assert compiled[-1]["compilations"] <= 2 and compiled[-1]["new_compilations"] == 0, compiled
