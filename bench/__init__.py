"""The benchmark suite: the benchmarks ``bench/gpu_suite.sh`` runs, the GPU timing helpers they share
(``gpu_timing``), and one-off studies in ``experiments/``.

Every script runs from the repository root as a module, ``PYTHONPATH=src python -m bench.NAME``, so that one
script imports another's helpers as ``bench.gpu_timing`` instead of finding them through its own directory.
Raw results: ``bench/results/`` (the latest of each benchmark; older ones in git history); what they say:
``docs/benchmarks.md`` (the results page) and ``docs/benchmarks/`` (a page per study).
"""

import os
import subprocess


def tree_commit(given: str | None = None) -> str:
    """The commit of the tree being measured: ``given`` (a script's ``--commit``), else ``$BLINK_COMMIT``, else this
    checkout's HEAD, else "?". The caller's word comes first: a copied tree's .git may not be its own."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return given or os.environ.get("BLINK_COMMIT") or head or "?"
