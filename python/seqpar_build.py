# SPDX-License-Identifier: Apache-2.0
"""seqpar's PEP 517 build backend (pyproject.toml: build-backend = "seqpar_build") and what python/setup.py
shares with it.

The backend is setuptools' own with one check in front. seqpar's extension is compiled against torch's C++ API,
so it works only with the torch it was built against: torch is a build requirement, but it is deliberately not
in pyproject.toml's `build-system.requires`. With build isolation (pip's default) a frontend would install
whatever torch PyPI has into a throw-away environment, compile against it, and pin the installed package to it,
replacing or contradicting the user's torch. So the build requires the torch already installed
(`pip install --no-build-isolation ./python`, as FlashAttention and other torch extensions do): the
`get_requires_for_build_*` hooks say "torch" (which `python -m build --no-isolation` checks), and where torch
cannot be imported (an isolated build, or none installed) the build stops with NEEDS_TORCH, one line.
"""
import glob
import json
import os
import re
import shutil
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (build_editable, build_sdist, build_wheel,  # noqa: F401 (the hooks)
                                   prepare_metadata_for_build_editable, prepare_metadata_for_build_wheel)

NEEDS_TORCH = ("seqpar's extension is compiled against the torch it will run with: install torch first, then "
               "pip install --no-build-isolation ./python (seqpar's python/ folder, or its sdist)")

HERE = os.path.dirname(os.path.abspath(__file__))
# Files of the repository the build needs, copied next to this file (from_repo/, seqpar/include/) when building
# from the repository, and shipped in the sdist, which has no repository around it.
FROM_REPO = os.path.join(HERE, "from_repo")
INCLUDE = os.path.join(HERE, "seqpar", "include")  # package data: the C++ headers, installed with the package


def require_torch():
    """torch, or the build stops with NEEDS_TORCH (one line on stderr, exit status 1)."""
    try:
        import torch
    except ImportError:
        sys.exit(NEEDS_TORCH)
    return torch


def get_requires_for_build_wheel(config_settings=None):
    require_torch()
    return _setuptools.get_requires_for_build_wheel(config_settings) + ["torch"]


def get_requires_for_build_editable(config_settings=None):
    require_torch()
    return _setuptools.get_requires_for_build_editable(config_settings) + ["torch"]


def get_requires_for_build_sdist(config_settings=None):
    require_torch()
    return _setuptools.get_requires_for_build_sdist(config_settings) + ["torch"]


def repository():
    """The seqpar repository this python/ folder is in, or None (an unpacked sdist)."""
    root = os.path.dirname(HERE)
    if os.path.isfile(os.path.join(root, "include", "seqpar", "seqpar.hpp")) and \
            os.path.isfile(os.path.join(root, "cmake", "build_flags.json")):
        return root
    return None


def _sync(source, destination, keep=lambda name: True):
    """Makes destination a copy of source (files that keep() accepts), copying only what changed, with the
    sources' times (so that ninja recompiles what includes a changed header, and nothing else)."""
    wanted = set()
    for folder, _, files in os.walk(source):
        for name in files:
            if not keep(name):
                continue
            src = os.path.join(folder, name)
            dst = os.path.join(destination, os.path.relpath(src, source))
            wanted.add(dst)
            s = os.stat(src)
            if os.path.isfile(dst):
                d = os.stat(dst)
                if d.st_size == s.st_size and int(d.st_mtime) == int(s.st_mtime):
                    continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
    for folder, _, files in os.walk(destination, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if path not in wanted:
                os.remove(path)
        if not os.listdir(folder):
            os.rmdir(folder)


def copy_from_repository():
    """From the repository: include/seqpar -> seqpar/include/seqpar (package data); the CUDA build's kernel
    headers (kernels/seqpar/gpu) and instances, and cmake/build_flags.json -> from_repo/. Nothing from tests/.
    In an unpacked sdist there is no repository: the copies it ships are used."""
    root = repository()
    if root is None:
        return
    _sync(os.path.join(root, "include", "seqpar"), os.path.join(INCLUDE, "seqpar"), lambda n: n.endswith(".hpp"))
    text = _read(os.path.join(root, "cmake", "build_flags.json"))
    _write(os.path.join(FROM_REPO, "cmake", "build_flags.json"), text)
    instances = set(json.loads(text)["torch_cuda_instances"])
    # cudnn_sdpa_impl.hpp and instances_cudnn/ need cudnn-frontend: compiled only where setup.py finds it
    # (cudnn_paths) beside cuDNN.
    _sync(os.path.join(root, "kernels", "seqpar", "gpu"), os.path.join(FROM_REPO, "kernels", "seqpar", "gpu"),
          lambda n: n.endswith((".hpp", ".cuh")))
    _sync(os.path.join(root, "kernels", "instances"), os.path.join(FROM_REPO, "kernels", "instances"),
          lambda n: n in instances)
    _sync(os.path.join(root, "kernels", "instances_cudnn"), os.path.join(FROM_REPO, "kernels", "instances_cudnn"),
          lambda n: n == "cudnn_sdpa.cpp")


def cudnn_paths():
    """(cuDNN's include and library folders, cudnn-frontend's include folder) for the torch extension's
    CUDA build to compile attention::CudnnSdpa, or None where one is missing. cuDNN: CUDNN_ROOT, else the
    nvidia-cudnn wheel that a CUDA build of torch installs (nvidia/cudnn/{include,lib}); cudnn-frontend
    (header-only): CUDNN_FRONTEND_ROOT, else the repository's build/cudnn_frontend
    (cmake/install_cudnn_frontend.sh). SEQPAR_TORCH_CUDNN=0 turns it off."""
    if os.environ.get("SEQPAR_TORCH_CUDNN", "1") == "0":
        return None
    roots = [os.environ["CUDNN_ROOT"]] if os.environ.get("CUDNN_ROOT") else []
    try:
        import nvidia.cudnn

        roots += [os.path.dirname(f) for f in (getattr(nvidia.cudnn, "__file__", None),) if f]
        roots += list(getattr(nvidia.cudnn, "__path__", []))
    except ImportError:
        pass
    cudnn = None
    for r in roots:
        inc, lib = os.path.join(r, "include"), os.path.join(r, "lib")
        if os.path.isfile(os.path.join(inc, "cudnn.h")) and glob.glob(os.path.join(lib, "libcudnn.so*")):
            cudnn = (inc, lib)
            break
    fronts = [os.environ["CUDNN_FRONTEND_ROOT"]] if os.environ.get("CUDNN_FRONTEND_ROOT") else []
    root = repository()
    if root is not None:
        fronts.append(os.path.join(root, "build", "cudnn_frontend"))
    front = next((os.path.join(f, "include") for f in fronts
                  if os.path.isfile(os.path.join(f, "include", "cudnn_frontend.h"))), None)
    if cudnn is None or front is None:
        return None
    return cudnn[0], cudnn[1], front


def build_flags():
    """cmake/build_flags.json: the compile settings shared with the CMake build."""
    with open(os.path.join(FROM_REPO, "cmake", "build_flags.json")) as f:
        return json.load(f)


def _read(path):
    with open(path) as f:
        return f.read()


def _write(path, text):
    """Writes text to path unless it already holds it (an unchanged time recompiles nothing)."""
    if not os.path.isfile(path) or _read(path) != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def version():
    """pyproject.toml's version (one place for Python; tomllib is Python 3.11+)."""
    return re.search(r'^version = "([^"]+)"', _read(os.path.join(HERE, "pyproject.toml")), re.M).group(1)


def write_build_info(torch, cuda):
    """seqpar/_build_info.py: the torch this build compiles against, which seqpar/__init__.py checks at import."""
    _write(os.path.join(HERE, "seqpar", "_build_info.py"),
           "# Generated by python/setup.py (not in git): the torch seqpar's extension was compiled against,\n"
           "# checked by seqpar/__init__.py at import.\n"
           f"SEQPAR_VERSION = {version()!r}\nTORCH_VERSION = {torch.__version__!r}\nCUDA = {cuda!r}\n")


def torch_requirement(torch):
    """The installed package's requirement on torch: the major.minor it was built against (torch's C++ ABI
    changes between minor releases)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"
