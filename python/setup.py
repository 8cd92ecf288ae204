# SPDX-License-Identifier: Apache-2.0
# Builds seqpar's torch extension: `pip install --no-build-isolation ./python` (torch must already be installed:
# the extension is compiled against the torch it will run with; seqpar_build.py says why). The package's
# metadata is pyproject.toml's; what needs torch or the repository is here.
import glob
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # seqpar_build, also for `python setup.py ...`
import seqpar_build  # noqa: E402

torch = seqpar_build.require_torch()
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

seqpar_build.copy_from_repository()  # the repository's headers into seqpar/include, from_repo/ (not in an sdist)
FLAGS = seqpar_build.build_flags()  # cmake/build_flags.json, the CMake build's settings
INCLUDE = [seqpar_build.INCLUDE]
# seqpar is C++20; torch's default flags say C++17, and the later flag wins.
# -g0: no debug info (CI time). -march: the CMake build's SEQPAR_ARCH default, for the code around CpuFlash's
# micro-kernels (those are chosen at run time for the CPU: AVX-512, AVX2 or portable, whatever -march says);
# SEQPAR_ARCH="" drops it.
ARCH = os.environ.get("SEQPAR_ARCH", FLAGS["arch"])
STD = f"-std=c++{FLAGS['cxx_standard']}"
CXX = [STD, "-O2", "-g0", "-DNDEBUG", "-Wno-unused-parameter"] + ([f"-march={ARCH}"] if ARCH else [])

# SEQPAR_TORCH_CUDA=1: seqpar._C also runs CUDA tensors (attention::CudaFlash over the process group's
# NCCL backend, python/src/cuda_attention.cpp), built with nvcc (CUDA_HOME) for SEQPAR_CUDA_ARCHS
# (default: the CMake build's CUDA architectures). Compiled in CI; it has never run on a GPU.
CUDA = os.environ.get("SEQPAR_TORCH_CUDA", "0") == "1"
CUDA_ARCHS = [a for a in os.environ.get("SEQPAR_CUDA_ARCHS", ";".join(FLAGS["cuda_architectures"])).split(";") if a]
# kernels/instances: CudaFlash<float, __half, __nv_bfloat16> and DataOps<CudaExec>, compiled once.
CUDA_SOURCES = [os.path.join("src", "cuda_attention.cpp")] + [
    os.path.join("from_repo", "kernels", "instances", f) for f in FLAGS["torch_cuda_instances"]]
CUDA_DEFINES = [f"-D{d}" for d in FLAGS["cuda_definitions"]]
# torch's nvcc flags turn off __half / __nv_bfloat16 operators and conversions, which the kernels use.
NVCC = [STD, "-O3", "-DNDEBUG"] + CUDA_DEFINES + FLAGS["cuda_flags"] + [
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__"] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]


# With CUDA, attention::CudnnSdpa (cuDNN's fused attention, the torch op's default 16-bit kernel) where cuDNN and
# cudnn-frontend are found (seqpar_build.cudnn_paths: the nvidia-cudnn wheel of a CUDA torch, CUDNN_ROOT,
# CUDNN_FRONTEND_ROOT or build/cudnn_frontend; SEQPAR_TORCH_CUDNN=0: without). Compiled, never run on a GPU.
CUDNN = seqpar_build.cudnn_paths() if CUDA else None


def extension():
    sources = [os.path.join("src", "ops.cpp")]
    if CUDA:
        include = INCLUDE + [os.path.join(seqpar_build.FROM_REPO, "kernels")]
        cxx = CXX + ["-DSEQPAR_TORCH_CUDA=1"] + CUDA_DEFINES
        link, libraries, library_dirs = [], [], []
        if CUDNN:
            cudnn_include, cudnn_lib, frontend_include = CUDNN
            sources = sources + [os.path.join("from_repo", "kernels", "instances_cudnn", "cudnn_sdpa.cpp")]
            include = include + [cudnn_include, frontend_include]
            cxx = cxx + ["-DSEQPAR_TORCH_CUDNN=1"]
            # The wheel ships libcudnn.so.9 only (no unversioned link); cudnn-frontend compiles some engines
            # at run time (NVRTC).
            link = [f"-L{cudnn_lib}", "-l:libcudnn.so.9", f"-Wl,-rpath,{cudnn_lib}"]
            libraries = ["nvrtc"]
        return CUDAExtension("seqpar._C", sources + CUDA_SOURCES, include_dirs=include, libraries=libraries,
                             library_dirs=library_dirs, extra_link_args=link,
                             extra_compile_args={"cxx": cxx, "nvcc": NVCC})
    return CppExtension("seqpar._C", sources, include_dirs=INCLUDE, extra_compile_args=CXX)


def test_extension():
    """seqpar._transport_cases: the C++ transport test cases (tests/support/transport_cases.hpp) over a
    process group, for python/tests only: built in place by python/run_tests.sh (SEQPAR_BUILD_TEST_MODULES=1),
    never part of the installed package or the sdist."""
    root = seqpar_build.repository()
    if root is None:
        sys.exit("SEQPAR_BUILD_TEST_MODULES=1 builds seqpar._transport_cases, which needs the repository's tests/")
    return CppExtension("seqpar._transport_cases", [os.path.join("src", "transport_cases.cpp")],
                        include_dirs=INCLUDE + [os.path.join(root, "tests")], extra_compile_args=CXX)


MODULES = [extension()]
if os.environ.get("SEQPAR_BUILD_TEST_MODULES", "0") == "1":
    MODULES.append(test_extension())
# SEQPAR_EXTENSIONS=seqpar._C builds one module (development: each takes minutes to compile).
only = [m for m in os.environ.get("SEQPAR_EXTENSIONS", "").split(",") if m]
seqpar_build.write_build_info(torch, CUDA)


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    def run(self):
        # setuptools' build/lib keeps every module ever built there (run_tests.sh's in-place build of the test
        # module goes through it too), and a wheel takes all of build/lib: drop the modules this build does not make.
        wanted = {self.get_ext_filename(e.name) for e in self.extensions}
        for path in glob.glob(os.path.join(self.build_lib, "seqpar", "*.so")):
            if os.path.relpath(path, self.build_lib) not in wanted:
                os.remove(path)
        super().run()


setup(
    ext_modules=[m for m in MODULES if not only or m.name in only],
    install_requires=[seqpar_build.torch_requirement(torch)],
    cmdclass={"build_ext": BuildExt},
)
