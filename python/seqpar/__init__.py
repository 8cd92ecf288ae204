# SPDX-License-Identifier: Apache-2.0
"""seqpar: exact distributed attention over packed long-context batches, from PyTorch."""


def _major_minor(version):
    return ".".join(version.split("+")[0].split(".")[:2])


def _check_torch():
    """The extension runs only with the torch (major.minor) it was compiled against: say so here, by name,
    rather than as an undefined symbol when seqpar.torch loads it."""
    try:
        from seqpar import _build_info  # written by setup.py when it builds the extension
    except ImportError:
        return None  # a source folder never built: seqpar.torch fails to load the extension and says that
    import torch

    built, running = _build_info.TORCH_VERSION, torch.__version__
    if _major_minor(built) != _major_minor(running):
        raise ImportError(
            f"seqpar's extension was built against torch {built} but this environment has torch {running}: "
            f"rebuild it against this torch with `pip install --no-build-isolation --no-deps --force-reinstall "
            f"./python` (seqpar's python/ folder, or its sdist), or install torch {_major_minor(built)}")
    return _build_info


_build = _check_torch()
__version__ = _build.SEQPAR_VERSION if _build is not None else "0.1.0"
