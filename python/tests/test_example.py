# SPDX-License-Identifier: Apache-2.0
"""examples/python/train_gpt.py and train_hf.py as tests: training steps on 2 gloo processes and on 1,
losses equal to 1e-5 at every step (the examples' own check; they exit non-zero otherwise)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_gpt_two_processes_match_one():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "train_gpt.py"), "--procs", "2",
                           "--steps", "2", "--tolerance", "1e-5"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout.splitlines()[-1], done.stdout
    assert len([line for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]) == 2, done.stdout


def test_train_hf_two_processes_match_one():
    # examples/python/train_hf.py: transformers' gpt-oss through seqpar under DDP, 2 processes vs 1.
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "train_hf.py"), "--procs", "2",
                           "--steps", "3", "--tolerance", "1e-5"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout.splitlines()[-1], done.stdout
    assert len([line for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]) == 3, done.stdout
