# SPDX-License-Identifier: Apache-2.0
"""The README's Python recipes, run as written (python/tests/readme/*.py hold them between markers that
docs.readme_recipes compares with the README byte for byte): on gloo processes, against one-process
references in float64."""
import os

import pytest

from dist_util import run

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "readme")


def _recipe(rank, world, name):
    import runpy

    return runpy.run_path(os.path.join(HERE, name), run_name="__recipe__")["result"]


@pytest.mark.parametrize("name,world,tol", [("torch_loop.py", 2, 1e-12), ("torch_ddp.py", 4, 1e-10),
                                            ("hf_drop_in.py", 2, 1e-10)])
def test_readme_recipe(name, world, tol):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    for rank, errors in enumerate(run(_recipe, world, name, timeout=300)):
        assert errors, name
        bad = {k: e for k, e in errors.items() if not e < tol}
        assert not bad, f"{name}, rank {rank}: {bad}"
