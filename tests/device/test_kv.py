"""The device page allocator (under the CUDA simulator) against KVMirror on random workloads."""
from typing import NamedTuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.device import sim  # noqa: F401  (simulator first)
from blink.device.kv import KVMirror, allocate_pages, free_sequences
from blink.device.numba_compat import cuda
from blink.device.state import FREE_TOP, SCHED_WORDS


class KVArrays(NamedTuple):
    sched: np.ndarray
    free_pages: np.ndarray
    seq_pages: np.ndarray
    seq_npages: np.ndarray


@cuda.jit
def allocate_kernel(s, slots, need, n, partial):
    allocate_pages(s, slots, need, n[0], partial)


@cuda.jit
def free_kernel(s, slots, n, offsets, partial):
    free_sequences(s, slots, n[0], offsets, partial)


N_SLOTS, NUM_PAGES, MAX_PAGES = 6, 24, 10

operation = st.one_of(
    st.tuples(st.just("allocate"), st.lists(st.tuples(st.integers(0, N_SLOTS - 1), st.integers(0, 4)),
                                            max_size=4, unique_by=lambda p: p[0])),
    st.tuples(st.just("free"), st.lists(st.integers(0, N_SLOTS - 1), max_size=4, unique=True)),
)


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(operation, max_size=10), threads=st.sampled_from([1, 3, 4]))
def test_device_allocator_matches_the_mirror(ops, threads):
    sched = np.zeros(SCHED_WORDS, np.int32)
    sched[FREE_TOP] = NUM_PAGES
    s = KVArrays(sched, np.arange(NUM_PAGES, dtype=np.int32), np.full((N_SLOTS, MAX_PAGES), -1, np.int32),
                 np.zeros(N_SLOTS, np.int32))
    mirror = KVMirror(NUM_PAGES)
    partial = np.zeros(1024, np.int32)
    for kind, args in ops:
        if kind == "allocate":
            args = [(slot, count) for slot, count in args if int(s.seq_npages[slot]) + count <= MAX_PAGES]
            if sum(c for _, c in args) > int(sched[FREE_TOP]):
                continue                                  # the batcher never asks for more than is free
            slots = np.array([slot for slot, _ in args] + [0], np.int32)
            need = np.array([count for _, count in args] + [0], np.int32)
            allocate_kernel[1, threads](s, slots, need, np.array([len(args)], np.int32), partial)
            mirror.allocate([slot for slot, _ in args], [count for _, count in args])
        else:
            slots = np.array(args + [0], np.int32)
            free_kernel[1, threads](s, slots, np.array([len(args)], np.int32), np.zeros(8, np.int32), partial)
            mirror.free_sequences(args)
        top = int(sched[FREE_TOP])
        assert s.free_pages[:top].tolist() == mirror.free
        for slot in range(N_SLOTS):
            assert s.seq_pages[slot, :s.seq_npages[slot]].tolist() == mirror.tables.get(slot, [])
        held = [p for slot in range(N_SLOTS) for p in s.seq_pages[slot, :s.seq_npages[slot]]]
        assert sorted(held + s.free_pages[:top].tolist()) == list(range(NUM_PAGES)), "pages lost or duplicated"
