# SPDX-License-Identifier: Apache-2.0
# Builds seqpar's torch extension: `pip install --no-build-isolation ./python` (torch must already be
# installed: the extension is compiled against the torch it will run with).
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INCLUDE = [os.path.join(ROOT, "include"), os.path.join(ROOT, "tests")]
# seqpar is C++20; torch's default flags say C++17, and the later flag wins.
# -g0: no debug info (CI time). -march: the CMake build's SEQPAR_ARCH default, so that CpuFlash uses its
# AVX2/FMA tiles (without it, its portable path runs several times slower); SEQPAR_ARCH="" drops it.
ARCH = os.environ.get("SEQPAR_ARCH", "x86-64-v3")
CXX = ["-std=c++20", "-O2", "-g0", "-DNDEBUG", "-Wno-unused-parameter"] + ([f"-march={ARCH}"] if ARCH else [])


def ext(name, source):
    return CppExtension(name, [os.path.join("src", source)], include_dirs=INCLUDE, extra_compile_args=CXX)


MODULES = {"seqpar._C": "ops.cpp", "seqpar._transport_cases": "transport_cases.cpp"}
# SEQPAR_EXTENSIONS=seqpar._C builds one module (development: each takes minutes to compile).
only = [m for m in os.environ.get("SEQPAR_EXTENSIONS", "").split(",") if m]

setup(
    name="seqpar",
    version="0.1.0",
    description="seqpar: exact distributed attention over packed batches, as a torch op",
    packages=["seqpar"],
    ext_modules=[ext(n, s) for n, s in MODULES.items() if not only or n in only],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
