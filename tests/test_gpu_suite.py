"""The GPU suite (``bash bench/gpu_suite.sh tests``) collects on the GPU machine: every module it collects, and what
they import, needs only the GPU image's packages. Regression (issue 38): ``tests/test_ranks.py`` imported a helper
from the server tests, which import ``openai``; collection failed with one error and no GPU test ran.

Here the packages the test environment has and the GPU image lacks are made unimportable, and the suite's files are
collected as the suite collects them (``NUMBA_ENABLE_CUDASIM=0``, ``-m gpu``)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# In blink's test extra (pyproject.toml) but not on the GPU image (torch, triton, numba, numba-cuda, cuda-python,
# transformers, aiohttp, pynvml, numpy, pytest, prometheus-client).
NOT_ON_THE_GPU_IMAGE = ("openai", "hypothesis", "yaml", "accelerate", "matplotlib", "xdist")
COLLECT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU image)", name=name)
sys.meta_path.insert(0, Missing())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def test_the_gpu_suite_collects_with_the_gpu_images_packages_only():
    files = subprocess.run(["bash", "bench/gpu_test_files.sh"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert "tests/test_ranks.py" in files
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NUMBA_ENABLE_CUDASIM": "0",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-c", COLLECT.format(blocked=NOT_ON_THE_GPU_IMAGE), *files], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
