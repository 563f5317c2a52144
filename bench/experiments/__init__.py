"""One-off studies: each asks whether a kernel or launch technique could bring the model step closer to its floor,
answers on the H200, and is kept so the answer can be re-measured; none of them is a kernel blink runs.

Run one from the repository root as ``PYTHONPATH=src python -m bench.experiments.NAME``, or on the H200 as
``bash bench/gpu_suite.sh experiment:NAME``; the verdicts are in ``docs/benchmarks/experiments.md``.
"""
