#!/usr/bin/env bash
# The Python package's tests, as CI runs them (ctest's python.pytest, `make test`):
#  1. build/venv: a virtual environment, made once and reused (SEQPAR_VENV overrides the path);
#  2. torch and pytest from PyPI into it, when missing (torch's wheel brings its C++ headers);
#  3. the extension (python/setup.py: seqpar._C, and the test module seqpar._transport_cases, which only this
#     build makes: SEQPAR_BUILD_TEST_MODULES=1), built in place against that torch;
#  4. pytest over python/tests (real processes, gloo; test_packaging.py checks the sdist, the metadata and
#     the wheel, which reuses the objects of step 3: no compile). Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SEQPAR_VENV:-$root/build/venv}
python=${SEQPAR_PYTHON:-python3}
start=$(date +%s)
stamp() { echo "== python [$(( $(date +%s) - start ))s] $*"; }

if [[ ! -x "$venv/bin/python" ]]; then
  stamp "creating $venv"
  "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, pytest, transformers" 2>/dev/null; then
  stamp "installing torch, pytest and transformers from PyPI"
  "$venv/bin/pip" install --quiet --disable-pip-version-check torch pytest numpy transformers
fi
stamp "building the extension (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
# In place: setuptools' build/ under python/ keeps the objects, so an unchanged source is not recompiled.
# MAX_JOBS=2: the two modules (seqpar._C, the test module) compile side by side; this test starts first.
(cd "$root/python" && MAX_JOBS=${MAX_JOBS:-2} SEQPAR_BUILD_TEST_MODULES=1 "$venv/bin/python" setup.py --quiet build_ext --inplace)
stamp "pytest"
cd "$root/python/tests"
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
stamp "done"
