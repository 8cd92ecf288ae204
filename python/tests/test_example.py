# SPDX-License-Identifier: Apache-2.0
"""examples/python/train_gpt.py as a test: 2 training steps on 2 gloo processes and on 1, losses equal
to 1e-5 at every step (the example's own check; it exits non-zero otherwise)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_gpt_two_processes_match_one():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "train_gpt.py"), "--procs", "2",
                           "--steps", "2", "--tolerance", "1e-5"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout.splitlines()[-1], done.stdout
    assert len([line for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]) == 2, done.stdout
