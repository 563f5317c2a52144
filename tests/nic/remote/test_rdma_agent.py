"""The agent over RdmaMemory on the recording verbs layer, against the reference consumer playing the GPU: the
ring protocol's write order as posted work requests, and whole request lifecycles with their expected outputs."""
import numpy as np
import pytest

from blink.errors import RingFull
from blink.nic.agent import Agent
from blink.nic.remote.rdma import RdmaConfig
from blink.nic.remote.segments import HostSegment
from blink.nic.remote.verbs import WRITE
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import HEADER_DTYPE, READY, RingLayout
from blink.ring.reference import ReferenceConsumer, expected_output
from blink.ring.request import SamplingParams
from blink.ring.transport import LocalMemory

from ...ring.test_split import split_ring
from .test_rdma import connect

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=16, max_output_tokens=32, max_stop_ids=2)
LAYOUT = RingLayout(GEOMETRY)


def whole_ring():
    ring = LocalMemory(LAYOUT.size)
    LAYOUT.initialise(ring)
    return [HostSegment(0, ring)], ReferenceConsumer(LAYOUT.view(ring.buffer), eos_token_ids=(7,))


def split_placement():
    """The request side registered as one region (it stands for the dma-buf MR of GPU memory), the output side as
    another (the pinned host MR)."""
    device, host, view = split_ring(LAYOUT)
    return [HostSegment(0, device), HostSegment(LAYOUT.offset("outputs"), host)], ReferenceConsumer(view,
                                                                                                    eos_token_ids=(7,))


def ring_offset(request, regions):
    region = next(r for r in regions if r.rkey == request.rkey)
    return region.start + request.remote_addr - region.addr


def test_a_submit_posts_header_prompt_epoch_then_the_state_word_then_the_doorbell():
    segments, _ = whole_ring()
    memory, verbs, regions = connect(segments, RdmaConfig(send_queue_depth=8, cell_bytes=4096))
    agent = Agent(memory, GEOMETRY)
    first = len(verbs.posted)
    agent.submit([1, 2, 3], SamplingParams(max_tokens=4, seed=1))
    writes = [(ring_offset(r, regions), r.length) for r in verbs.posted[first:] if r.opcode == WRITE]
    slot = 0
    assert writes == [(LAYOUT.header_at(slot), HEADER_DTYPE.itemsize), (LAYOUT.prompt_at(slot), 12),
                      (LAYOUT.status_at("epoch", slot), 4), (LAYOUT.status_at("state", slot), 4),
                      (control.offset_of("submitted"), 8)]
    memory.fence()
    executed = [ring_offset(r, regions) for r, _ in verbs.executed[-6:-1]]
    assert executed == [offset for offset, _ in writes], "and the NIC executed them in that order"
    state = next(data for r, data in verbs.executed
                 if r.opcode == WRITE and ring_offset(r, regions) == LAYOUT.status_at("state", slot))
    assert np.frombuffer(state, "<u4")[0] == READY


def run(agent, consumer, submissions, max_steps=500):
    """Submit ``(prompt, params)`` pairs as slots allow, step the consumer, poll; {request_id: (tokens, logprobs,
    reason)} plus {request_id: (prompt, params)}."""
    results, submitted, pending = {}, {}, list(submissions)

    def poll():
        for out in agent.poll():
            tokens, logprobs, _ = results.get(out.request_id, ([], [], None))
            results[out.request_id] = (tokens + out.new_tokens, logprobs + (out.new_logprobs or []),
                                       out.finish_reason)

    for _ in range(max_steps):
        while pending:
            try:
                submitted[agent.submit(*pending[0])] = pending[0]
            except RingFull:
                break
            pending.pop(0)
        consumer.step()
        poll()
        if not pending and not agent.in_flight:
            return results, submitted
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("placement", [whole_ring, split_placement], ids=["host ring", "request side apart"])
def test_requests_over_rdma_get_exactly_the_reference_outputs(placement):
    segments, consumer = placement()
    memory, verbs, _ = connect(segments, RdmaConfig(send_queue_depth=4, cell_bytes=256))
    agent = Agent(memory, GEOMETRY)
    rng = np.random.default_rng(0)
    submissions = []
    for k in range(40):
        prompt = rng.integers(0, 32000, rng.integers(1, 17)).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 33)), seed=k, logprobs=bool(k % 2),
                                ignore_eos=bool(k % 3), stop_token_ids=[int(rng.integers(0, 32000))])
        submissions.append((prompt, params))
    results, submitted = run(agent, consumer, submissions)
    for rid, (prompt, params) in submitted.items():
        tokens, logprobs, reason = results[rid]
        assert (tokens, reason) == expected_output(prompt, params, eos_token_ids=(7,))
        assert len(logprobs) == (len(tokens) if params.logprobs else 0)
    assert agent.tracker.n_free == GEOMETRY.n_slots
    assert consumer.view.control[0]["finished"] == 40
    memory.close()


def test_a_cancel_over_rdma_aborts_the_request():
    segments, consumer = whole_ring()
    memory, *_ = connect(segments)
    agent = Agent(memory, GEOMETRY)
    rid = agent.submit([5, 6], SamplingParams(max_tokens=32, seed=3, ignore_eos=True))
    consumer.step()
    agent.poll()
    assert agent.cancel(rid)
    results, _ = run(agent, consumer, [])
    assert results[rid][2] == "abort"
    assert agent.stats()["cancelled"] == 1
