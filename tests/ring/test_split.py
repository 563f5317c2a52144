"""SplitMemory: one ring address space over segments in different memories (the request side in GPU memory, the
output side in host memory), with the in-order write guarantee kept across segments."""
import os

import numpy as np
import pytest

from blink.errors import RingFull
from blink.nic.agent import Agent
from blink.ring.control import CONTROL_DTYPE
from blink.ring.geometry import RingGeometry
from blink.ring.layout import HEADER_DTYPE, TOKEN_DTYPE, RingLayout, RingView
from blink.ring.reference import ReferenceConsumer, expected_output
from blink.ring.request import SamplingParams
from blink.ring.split import SplitMemory, Window
from blink.ring.transport import LocalMemory, RemoteMemory, SharedMemory

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=16, max_output_tokens=32, max_stop_ids=2)


def split_ring(layout: RingLayout):
    """The request side ``[0, offset("outputs"))`` and the output side of a fresh ring in two memories, and the
    consumer's view over both (what a GPU scheduler with the request side in device memory would address)."""
    split = layout.offset("outputs")
    device, host = LocalMemory(split), LocalMemory(layout.size - split)
    device.write(0, layout.control_bytes())
    g = layout.geometry

    def region(name, dtype, shape):
        offset = layout.offset(name)
        memory, base = (device, 0) if offset < split else (host, split)
        return np.frombuffer(memory.buffer, dtype, count=int(np.prod(shape)), offset=offset - base).reshape(shape)

    view = RingView(control=region("control", CONTROL_DTYPE, (1,)),
                    status=region("status", layout.status_dtype, (1,))[0],
                    headers=region("headers", HEADER_DTYPE, (g.n_slots,)),
                    stop_token_ids=region("stop_token_ids", TOKEN_DTYPE, (g.n_slots, g.max_stop_ids)),
                    prompts=region("prompts", np.dtype("<i4"), (g.n_slots, g.max_prompt_tokens)),
                    outputs=region("outputs", np.dtype("<i4"), (g.n_slots, g.max_output_tokens)),
                    logprobs=region("logprobs", np.dtype("<f4"), (g.n_slots, g.max_output_tokens)))
    return device, host, view


class FenceCounting(RemoteMemory):
    """A LocalMemory that logs every write and fence, to check where SplitMemory fences."""

    def __init__(self, name, size, log):
        self.name, self.size, self.log, self.inner = name, size, log, LocalMemory(size)

    def write(self, offset, data):
        self.log.append(("write", self.name, offset, bytes(data)))
        self.inner.write(offset, data)

    def read(self, offset, nbytes):
        return self.inner.read(offset, nbytes)

    def fence(self):
        self.log.append(("fence", self.name))

    def close(self):
        self.inner.close()


@pytest.fixture
def two():
    log = []
    a, b = FenceCounting("a", 8192, log), FenceCounting("b", 4096, log)
    memory = SplitMemory([(0, a), (8192, b)])
    yield memory, log
    memory.close()


def test_accesses_route_by_offset_and_split_at_the_segment_end(two):
    memory, log = two
    assert memory.size == 12288
    memory.write(8190, b"wxyz")
    assert log == [("write", "a", 8190, b"wx"), ("fence", "a"), ("write", "b", 0, b"yz")]
    assert memory.read(8188, 8) == b"\0\0wxyz\0\0"
    with pytest.raises(ValueError, match="outside the 12288-byte region"):
        memory.read(12287, 2)


def test_a_write_to_another_segment_first_fences_the_last_one_written(two):
    memory, log = two
    memory.write(0, b"1")
    memory.write(4, b"2")           # same segment: no fence
    memory.write(9000, b"3")        # a -> b: fence a
    memory.write(9004, b"4")
    memory.write(8, b"5")           # b -> a: fence b
    memory.fence()                  # only the last one written
    assert [entry[:2] for entry in log] == [("write", "a"), ("write", "a"), ("fence", "a"), ("write", "b"),
                                            ("write", "b"), ("fence", "b"), ("write", "a"), ("fence", "a")]


def test_a_window_addresses_its_part_of_a_memory_from_zero():
    with LocalMemory(3 * 4096) as whole:
        window = Window(whole, 4096, 4096)
        window.write(4094, b"ab")
        assert whole.read(2 * 4096 - 2, 2) == b"ab" and window.read(4094, 2) == b"ab"
        assert bytes(window.buffer[4094:]) == b"ab" and len(window.buffer) == 4096
        with pytest.raises(ValueError, match="outside the 4096-byte region"):
            window.write(4095, b"ab")
        with pytest.raises(ValueError, match=r"window \[8192, 16384\) is outside the 12288-byte memory"):
            Window(whole, 8192, 8192)
        window.close()
        assert whole.read(2 * 4096 - 2, 2) == b"ab", "a window that does not own its memory leaves it open"
    with pytest.raises(AttributeError, match="a window of a FenceCounting has no buffer"):
        Window(FenceCounting("a", 4096, []), 0, 4096).buffer


def test_a_window_that_owns_its_memory_closes_it():
    with SharedMemory.create(f"blink-test-window-{os.getpid()}", 8192) as shared:
        opened = SharedMemory.open(f"blink-test-window-{os.getpid()}")
        window = Window(opened, 4096, 4096, owns=True)
        window.write(0, b"x")
        assert shared.read(4096, 1) == b"x"
        window.close()
        with pytest.raises(ValueError, match="released"):
            opened.read(0, 1)


def test_segments_must_tile_the_ring():
    with pytest.raises(ValueError, match="should start at 4096"):
        SplitMemory([(0, LocalMemory(4096)), (8192, LocalMemory(4096))])
    with pytest.raises(ValueError, match="at least one segment"):
        SplitMemory([])


def test_an_agent_drives_a_ring_split_between_device_and_host_memory():
    layout = RingLayout(GEOMETRY)
    device, host, view = split_ring(layout)
    memory = SplitMemory([(0, device), (layout.offset("outputs"), host)])
    agent = Agent(memory, GEOMETRY)
    consumer = ReferenceConsumer(view)
    requests, tokens = {}, {}

    def step():
        consumer.step()
        for out in agent.poll():
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)

    for k in range(12):
        prompt, params = list(range(1, 2 + k % 7)), SamplingParams(max_tokens=1 + 3 * k % 32, seed=k, logprobs=True)
        while True:
            try:
                requests[agent.submit(prompt, params)] = (prompt, params)
                break
            except RingFull:
                step()
    for _ in range(200):
        step()
        if not agent.in_flight:
            break
    assert {rid: tokens.get(rid) for rid in requests} == {rid: expected_output(*r)[0] for rid, r in requests.items()}
    assert host.read(0, host.size) != bytes(host.size), "the outputs went to the host segment"
    memory.close()
