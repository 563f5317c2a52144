"""Block-wide primitives under the CUDA simulator, against numpy, for several block sizes."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.device import sim  # noqa: F401  (turns the simulator on before numba is imported)
from blink.device.block import exclusive_scan, locate, next_power_of_two, sort_pairs
from blink.device.numba_compat import cuda


@cuda.jit
def scan_kernel(values, n, total, partial):
    total[0] = exclusive_scan(values, n[0], partial)


@cuda.jit
def locate_kernel(offsets, n, queries, out):
    for i in range(cuda.threadIdx.x, queries.shape[0], cuda.blockDim.x):
        out[i] = locate(offsets, n[0], queries[i])


@cuda.jit
def sort_kernel(keys, values, count, size):
    sort_pairs(keys, values, count[0], size[0])


@cuda.jit
def power_kernel(n, out):
    out[0] = next_power_of_two(n[0])


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.integers(0, 1000), max_size=40), threads=st.sampled_from([1, 3, 4, 8]))
def test_exclusive_scan_matches_numpy(values, threads):
    data = np.array(values + [77], np.int32)           # one element past n that must not be touched
    n = len(values)
    total = np.zeros(1, np.int32)
    scan_kernel[1, threads](data, np.array([n], np.int32), total, np.zeros(1024, np.int32))
    expected = np.concatenate([[0], np.cumsum(values)[:-1]]) if values else np.zeros(0)
    np.testing.assert_array_equal(data[:n], expected)
    assert total[0] == sum(values) and data[n] == 77


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=20), threads=st.sampled_from([1, 4]))
def test_locate_finds_the_owning_segment(counts, threads):
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    total = int(sum(counts))
    queries = np.arange(total, dtype=np.int32)
    out = np.full(total, -1, np.int32)
    locate_kernel[1, threads](offsets, np.array([len(counts)], np.int32), queries, out)
    owners = np.repeat(np.arange(len(counts)), counts)
    np.testing.assert_array_equal(out, owners)


@settings(max_examples=25, deadline=None)
@given(keys=st.lists(st.integers(-2**62, 2**62), max_size=33), threads=st.sampled_from([1, 4, 8]))
def test_sort_pairs_orders_by_key_then_value(keys, threads):
    count = len(keys)
    size = 1 << max(count - 1, 0).bit_length()
    k = np.zeros(64, np.int64)
    v = np.full(64, -5, np.int32)
    k[:count] = keys
    v[:count] = np.random.default_rng(count).permutation(count)
    pairs = sorted(zip(k[:count].tolist(), v[:count].tolist()))
    sort_kernel[1, threads](k, v, np.array([count], np.int32), np.array([size], np.int32))
    assert list(zip(k[:count].tolist(), v[:count].tolist())) == pairs
    assert (v[size:] == -5).all(), "wrote past the sort's size"


@pytest.mark.parametrize("n,expected", [(0, 1), (1, 1), (2, 2), (3, 4), (1000, 1024)])
def test_next_power_of_two(n, expected):
    out = np.zeros(1, np.int32)
    power_kernel[1, 1](np.array([n], np.int32), out)
    assert out[0] == expected
