#!/usr/bin/env bash
# The test files (and test directories, for a conftest.py that marks tests) that hold GPU tests: what
# `bench/gpu_suite.sh tests` collects with `pytest -m gpu`, and what tests/test_gpu_suite.py collects with the GPU
# image's packages only. Run from the repository root.
grep -rlE "mark\.gpu|marks=pytest\.mark\.gpu" tests --include='test_*.py' --include=conftest.py \
  | sed 's#/conftest.py$##' | grep -vx tests | sort -u
