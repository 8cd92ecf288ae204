# SPDX-License-Identifier: Apache-2.0
"""examples/python/train_gpt.py and train_hf.py as tests: training steps on 2 gloo processes and on 1,
losses equal to 1e-5 at every step (the examples' own check; they exit non-zero otherwise). train_hf.py
is transformers' gpt-oss through seqpar's registered attention under DDP."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("script,steps", [("train_gpt.py", 2), ("train_hf.py", 3)])
def test_two_processes_match_one(script, steps):
    if script == "train_hf.py":
        pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", script), "--procs", "2",
                           "--steps", str(steps), "--tolerance", "1e-5"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout.splitlines()[-1], done.stdout
    assert len([line for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]) == steps, done.stdout
