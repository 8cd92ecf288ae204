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
# -g0: no debug info (CI time). -march: the CMake build's SEQPAR_ARCH default, for the code around CpuFlash's
# micro-kernels (those are chosen at run time for the CPU: AVX-512, AVX2 or portable, whatever -march says);
# SEQPAR_ARCH="" drops it.
ARCH = os.environ.get("SEQPAR_ARCH", "x86-64-v3")
CXX = ["-std=c++20", "-O2", "-g0", "-DNDEBUG", "-Wno-unused-parameter"] + ([f"-march={ARCH}"] if ARCH else [])


# SEQPAR_TORCH_CUDA=1: seqpar._C also runs CUDA tensors (attention::CudaFlash over the process group's
# NCCL backend, python/src/cuda_attention.cpp), built with nvcc (CUDA_HOME) for SEQPAR_CUDA_ARCHS
# (default "80;90a", the CMake build's). Compiled in CI; it has never run on a GPU.
CUDA = os.environ.get("SEQPAR_TORCH_CUDA", "0") == "1"
CUDA_ARCHS = [a for a in os.environ.get("SEQPAR_CUDA_ARCHS", "80;90a").split(";") if a]
# kernels/instances: CudaFlash<float, __half, __nv_bfloat16> and DataOps<CudaExec>, compiled once.
CUDA_SOURCES = ["cuda_attention.cpp"] + [os.path.join("..", "..", "kernels", "instances", f)
                                         for f in ("flash_fp32.cu", "flash_fp16.cu", "flash_bf16.cu", "data_ops.cu")]
# torch's nvcc flags turn off __half / __nv_bfloat16 operators and conversions, which the kernels use.
NVCC = ["-std=c++20", "-O3", "-DNDEBUG", "-DSEQPAR_ENABLE_CUDA=1", "--extended-lambda", "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__"] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]


def ext(name, source):
    sources = [os.path.join("src", source)]
    if CUDA and name == "seqpar._C":
        from torch.utils.cpp_extension import CUDAExtension

        return CUDAExtension(name, sources + [os.path.join("src", s) for s in CUDA_SOURCES],
                             include_dirs=INCLUDE + [os.path.join(ROOT, "kernels")],
                             extra_compile_args={"cxx": CXX + ["-DSEQPAR_TORCH_CUDA=1", "-DSEQPAR_ENABLE_CUDA=1"],
                                                 "nvcc": NVCC})
    return CppExtension(name, sources, include_dirs=INCLUDE, extra_compile_args=CXX)


MODULES = {"seqpar._C": "ops.cpp", "seqpar._transport_cases": "transport_cases.cpp"}
# SEQPAR_EXTENSIONS=seqpar._C builds one module (development: each takes minutes to compile).
only = [m for m in os.environ.get("SEQPAR_EXTENSIONS", "").split(",") if m]

setup(
    name="seqpar",
    version="0.1.0",
    description="seqpar: exact distributed attention over packed batches, as a torch op",
    packages=["seqpar", "seqpar.integrations"],
    ext_modules=[ext(n, s) for n, s in MODULES.items() if not only or n in only],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
