# SPDX-License-Identifier: Apache-2.0
"""The package as pip builds it, without compiling again (the wheel reuses the objects of run_tests.sh's build): the sdist
is self-contained (the repository's headers, the CUDA build's kernel files and the shared compile settings;
nothing from tests/, no test module), the wheel's metadata pins the torch it is built against, a build
without torch says in one line what to run, and the package refuses at import a torch it was not built for.
The PEP 517 hooks are called as a frontend calls them (`python -m build --no-isolation`, pip)."""
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import torch

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(PYTHON_DIR)
# The build of run_tests.sh sets it for itself; the package is built without it.
ENV = {k: v for k, v in os.environ.items() if k not in ("SEQPAR_BUILD_TEST_MODULES", "SEQPAR_EXTENSIONS")}


def hook(name, *args, env=ENV):
    """Runs the backend's PEP 517 hook `name` in python/, as a frontend does (a fresh process)."""
    code = f"import sys, seqpar_build; print(seqpar_build.{name}(*sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=PYTHON_DIR, env=env, capture_output=True,
                          text=True, timeout=300)


def repo_files(folder, suffixes):
    out = set()
    for d, _, files in os.walk(os.path.join(ROOT, folder)):
        out.update(os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(suffixes))
    return out


def test_sdist_is_self_contained(tmp_path):
    done = hook("build_sdist", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    with tarfile.open(tmp_path / done.stdout.strip().splitlines()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    # Every public header, as package data.
    headers = {os.path.join("seqpar", h) for h in repo_files(os.path.join("include", "seqpar"), (".hpp",))}
    assert headers and headers <= names, sorted(headers - names)[:5]
    for needed in ("pyproject.toml", "setup.py", "seqpar_build.py", "from_repo/cmake/build_flags.json",
                   "from_repo/kernels/instances/flash_fp32.cu", "from_repo/kernels/seqpar/gpu/flash.cuh"):
        assert needed in names, needed
    # Every source of the extension, the CUDA path's headers included (only a CUDA build of the sdist reads
    # them, so no CPU build would notice one missing); the test module's source is not shipped.
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    sources = {"src/" + f for f in os.listdir(src) if f.endswith((".cpp", ".hpp")) and "transport_cases" not in f}
    assert {"src/ops.cpp", "src/cuda_attention.cpp", "src/torch_flash.hpp"} <= sources
    assert sources <= names, sorted(sources - names)
    bad = sorted(n for n in names if "transport_cases" in n or n.startswith(("tests/", "build/")) or "/tests/" in n
                 or n.endswith((".so", ".o", "_build_info.py")))
    assert not bad, bad
    # The test module is not among the extensions (the sdist holds every extension's sources).
    with tarfile.open(tmp_path / done.stdout.strip().splitlines()[-1]) as sdist:
        sources = next(m for m in sdist.getmembers() if m.name.endswith("egg-info/SOURCES.txt"))
        assert "transport_cases" not in sdist.extractfile(sources).read().decode()


def test_wheel_metadata_requires_the_torch_it_is_built_against(tmp_path):
    done = hook("prepare_metadata_for_build_wheel", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    metadata = (tmp_path / done.stdout.strip().splitlines()[-1] / "METADATA").read_text().splitlines()
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert f"Requires-Dist: torch=={major}.{minor}.*" in metadata, metadata
    assert "Name: seqpar" in metadata and any(line.startswith("Requires-Python: ") for line in metadata), metadata
    done = hook("get_requires_for_build_wheel")
    assert done.returncode == 0 and "'torch'" in done.stdout, done.stdout + done.stderr


def test_wheel_holds_the_extension_and_headers_not_the_test_module(tmp_path):
    # pip's in-tree build reuses the objects of run_tests.sh's build (same flags): no compile, seconds.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                           "--disable-pip-version-check", "-w", str(tmp_path), PYTHON_DIR], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = tmp_path.glob("seqpar-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode().splitlines()
    assert any(n.startswith("seqpar/_C.") and n.endswith(".so") for n in names), names
    assert "seqpar/include/seqpar/seqpar.hpp" in names and "seqpar/_build_info.py" in names, names
    assert not [n for n in names if "transport_cases" in n or "/tests/" in n], names
    assert any(line.startswith("Requires-Dist: torch==") for line in metadata), metadata


def test_build_without_torch_says_what_to_run(tmp_path):
    # What pip's isolated build environment looks like to the backend: no torch.
    (tmp_path / "torch.py").write_text("raise ImportError('No module named torch')\n")
    env = dict(ENV, PYTHONPATH=str(tmp_path))
    for done in (hook("get_requires_for_build_wheel", env=env),
                 subprocess.run([sys.executable, "setup.py", "--version"], cwd=PYTHON_DIR, env=env,
                                capture_output=True, text=True, timeout=120)):
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install --no-build-isolation ./python" in lines[0], done.stderr


def test_import_refuses_a_torch_it_was_not_built_for():
    import seqpar

    built = seqpar._build.TORCH_VERSION
    code = "import torch; torch.__version__ = '1.0.0'; import seqpar"
    done = subprocess.run([sys.executable, "-c", code], env=dict(ENV, PYTHONPATH=PYTHON_DIR), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and built in last and "1.0.0" in last, done.stderr
    assert "pip install --no-build-isolation" in last, last


def test_readme_install_command_is_the_one_the_build_names():
    sys.path.insert(0, PYTHON_DIR)
    import seqpar_build

    command = "pip install --no-build-isolation ./python"
    assert command in seqpar_build.NEEDS_TORCH
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"\n{command}  " in f.read()


def test_version_is_the_cmake_projects():
    with open(os.path.join(PYTHON_DIR, "pyproject.toml")) as f:
        python = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = re.search(r"project\(seqpar VERSION ([0-9.]+)", f.read()).group(1)
    assert python == cmake, (python, cmake)
