"""The benchmark suite: the benchmarks ``bench/gpu_suite.sh`` runs, the GPU timing helpers they share
(``gpu_timing``), and one-off studies in ``experiments/``.

Every script runs from the repository root as a module, ``PYTHONPATH=src python -m bench.NAME``, so that one
script imports another's helpers as ``bench.gpu_timing`` instead of finding them through its own directory.
Raw results: ``bench/results/`` (the latest of each benchmark; older ones in git history); what they say:
``docs/benchmarks.md``.
"""
