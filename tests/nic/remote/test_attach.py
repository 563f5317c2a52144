"""``blink agent --remote`` end to end without hardware: the engine's ring served by the reference consumer in
another process (``standin_engine``), the setup handshake over loopback TCP, and the agent in this process writing
into that ring over ipc (shared memory, CPU mode's foreign writer) or over RDMA on the recording verbs layer; the
ring offered whole, or split as an engine with its request side in GPU memory offers it (the request side's GPU
allocation stood in for by the shared ring's own first bytes)."""
import os
import time

import pytest

from blink.errors import HandshakeError, RdmaError, RingFull, RingMismatch
from blink.nic.agent import Agent
from blink.nic.remote import proof
from blink.nic.remote.attach import RingExport, RingListener, _map_region, boot_id, listen_on_ring, open_remote
from blink.nic.remote.rdma import RdmaConfig, RdmaMemory
from blink.nic.remote.recording import RecordingFabric
from blink.nic.remote.segments import DeviceSegment, HostSegment
from blink.nic.remote.wire import Challenge, CudaRegion, Hello, Reject, ShmRegion
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.reference import expected_output, standin_engine
from blink.ring.request import SamplingParams
from blink.ring.split import SplitMemory, Window, request_side_bytes
from blink.ring.transport import LocalMemory, SharedMemory

from .test_handshake import exchange
from .test_wire import ENDPOINT, NONCE, PROOF

GEOMETRY = RingGeometry(n_slots=16, max_prompt_tokens=16, max_output_tokens=24, max_stop_ids=2)
RDMA = RdmaConfig(send_queue_depth=16, cell_bytes=4096)
SECRET = "the secret in the engine's key file"


def address(listener) -> str:
    return "%s:%d" % listener.address


def attach(listener, transport: str, fabric: RecordingFabric, ring_secret: str | None = SECRET):
    """The ring ``listener`` offers, as an agent that knows ``ring_secret`` opens it over ``transport``."""
    return open_remote(address(listener), transport, ring_secret=ring_secret, rdma=RDMA, verbs_factory=fabric.initiator)


def serve_requests(memory, n=30, timeout_s=60.0):
    """An agent on ``memory`` runs ``n`` seeded requests to the end; {request_id: (tokens, reason)} and what each
    request was."""
    agent = Agent.attach(memory)
    results, submitted, k = {}, {}, 0
    deadline = time.monotonic() + timeout_s
    while len(submitted) < n or agent.in_flight:
        while len(submitted) < n:
            prompt, params = [k + 1, 2 * k + 1], SamplingParams(max_tokens=1 + k % 24, seed=k, ignore_eos=True)
            try:
                submitted[agent.submit(prompt, params)] = (prompt, params)
            except RingFull:
                break
            k += 1
        for out in agent.poll():
            tokens, _ = results.get(out.request_id, ([], None))
            results[out.request_id] = (tokens + out.new_tokens, out.finish_reason)
        assert time.monotonic() < deadline, "the requests did not finish"
    return results, submitted


@pytest.mark.parametrize("transport", ["ipc", "rdma"])
def test_an_agent_attached_over_the_handshake_gets_the_reference_outputs(transport):
    fabric = RecordingFabric()
    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", [HostSegment(0, ring)], GEOMETRY, ring_secret=SECRET,
                           target_factory=fabric.target) as listener:
        memory = attach(listener, transport, fabric)
        assert isinstance(memory, RdmaMemory if transport == "rdma" else SharedMemory)
        try:
            results, submitted = serve_requests(memory)
        finally:
            memory.close()
        assert listener.server.offers == 1
    assert {rid: results[rid] for rid in submitted} == {rid: expected_output(*r) for rid, r in submitted.items()}


@pytest.mark.parametrize("transport", ["ipc", "rdma"])
@pytest.mark.parametrize("ring_secret", ["a guess", None], ids=["wrong secret", "no secret"])
def test_an_agent_without_the_engines_secret_gets_nothing_of_the_ring(transport, ring_secret):
    """Rejected saying where the secret comes from; the engine opened no RDMA target and sent no region: what it
    sent such an agent is its challenge and the reject. The agent that knows the secret is served as before."""
    fabric, targets = RecordingFabric(), []

    def target():
        targets.append(fabric.target())
        return targets[-1]

    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", [HostSegment(0, ring)], GEOMETRY, ring_secret=SECRET,
                           target_factory=target) as listener:
        with pytest.raises(HandshakeError, match=r"rejected this agent: this agent showed (a wrong|no) proof of the "
                                                 r"ring's secret: set \$BLINK_RING_SECRET on the agent's side"):
            attach(listener, transport, fabric, ring_secret)
        forged = proof.prove("a guess", proof.AGENT, proof.nonce(), NONCE, b"") if ring_secret else None
        sent = exchange(address(listener), Hello("ipc", control.VERSION, NONCE, forged, host=boot_id()))
        assert [type(message) for message in sent] == [Challenge, Reject]
        assert targets == [] and listener.server.offers == 0 and listener.server.refused == 2
        attach(listener, transport, fabric).close()
        assert listener.server.offers == 1


SPLIT = request_side_bytes(RingLayout(GEOMETRY))
BUS_ID = "0000:1b:00.0"


def split_segments(ring) -> list[HostSegment]:
    """``ring``'s bytes as two segments split where an engine splits its ring between GPU and host memory: the
    request side (here a window of the shared ring itself), and the output side, a window of the shared ring."""
    return [HostSegment(0, Window(ring, 0, SPLIT)), HostSegment(SPLIT, Window(ring, SPLIT, ring.size - SPLIT))]


@pytest.mark.parametrize("transport", ["ipc", "rdma"])
def test_a_ring_offered_in_two_segments_serves_like_one(transport):
    """The ipc agent maps each shared-memory region at its offset of the object; the rdma agent gets an rkey each;
    both reach the ring as one address space and get the reference outputs."""
    fabric = RecordingFabric()
    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", split_segments(ring), GEOMETRY, ring_secret=SECRET,
                           target_factory=fabric.target) as listener:
        if transport == "ipc":
            offer = listener.export.answer(Hello("ipc", control.VERSION, NONCE, PROOF, host=boot_id()), PROOF)
            assert offer.regions == (ShmRegion(0, SPLIT, ring.name, 0),
                                     ShmRegion(SPLIT, ring.size - SPLIT, ring.name, SPLIT))
        memory = attach(listener, transport, fabric)
        try:
            assert isinstance(memory, SplitMemory if transport == "ipc" else RdmaMemory)
            assert len(memory.regions if transport == "rdma" else memory.segments) == 2
            results, submitted = serve_requests(memory)
        finally:
            memory.close()
    assert {rid: results[rid] for rid in submitted} == {rid: expected_output(*r) for rid, r in submitted.items()}


def test_an_offer_past_the_end_of_a_shared_memory_object_is_refused():
    with standin_engine(GEOMETRY) as (ring, _):
        region = ShmRegion(SPLIT, ring.size - SPLIT, ring.name, offset=SPLIT + 4096)
        with pytest.raises(RingMismatch, match=f"of /dev/shm/{ring.name}, which holds {ring.size} bytes"):
            _map_region(region)


class GpuStandIn:
    """A recording target whose NIC also reaches GPU memory: a ``DeviceSegment`` registers as the host window that
    stands in for its allocation (checking that its dma-buf fd is open while it registers)."""

    def __init__(self, fabric: RecordingFabric, device_bytes):
        self.target, self.device_bytes, self.registered_fds = fabric.target(), device_bytes, []

    def register(self, segment):
        if isinstance(segment, DeviceSegment):
            os.fstat(segment.dmabuf_fd)
            self.registered_fds.append(segment.dmabuf_fd)
            segment = HostSegment(segment.start, self.device_bytes)
        return self.target.register(segment)

    def accept(self, endpoint):
        return self.target.accept(endpoint)

    def close(self):
        self.target.close()


def device_segment(dmabuf_fd: int) -> DeviceSegment:
    return DeviceSegment(0, SPLIT, address=1 << 40, ipc_handle=bytes(range(64)), pci_bus_id=BUS_ID,
                         dmabuf_fd=dmabuf_fd)


def test_the_gpu_memory_ring_is_offered_by_ipc_handle_and_by_dmabuf_whose_fd_is_closed_once_registered():
    fabric = RecordingFabric()
    dmabuf, unused = os.pipe()          # stands in for the dma-buf fd export_device_segment returns
    os.close(unused)
    with standin_engine(GEOMETRY) as (ring, _):
        device, output = device_segment(dmabuf), HostSegment(SPLIT, Window(ring, SPLIT, ring.size - SPLIT))
        target = GpuStandIn(fabric, Window(ring, 0, SPLIT))
        with RingListener("127.0.0.1:0", RingExport(GEOMETRY, [device, output], target_factory=lambda: target),
                          SECRET) as listener:
            offer = listener.export.answer(Hello("ipc", control.VERSION, NONCE, PROOF, host=boot_id()), PROOF)
            assert offer.regions == (CudaRegion(0, SPLIT, bytes(range(64)), BUS_ID),
                                     ShmRegion(SPLIT, ring.size - SPLIT, ring.name, SPLIT))
            os.fstat(dmabuf)                # an ipc offer leaves it open: an rdma agent may still come
            memory = attach(listener, "rdma", fabric)
            assert target.registered_fds == [dmabuf]
            with pytest.raises(OSError):
                os.fstat(dmabuf)            # the MR holds the dma-buf now
            try:
                results, submitted = serve_requests(memory)
            finally:
                memory.close()
    assert {rid: results[rid] for rid in submitted} == {rid: expected_output(*r) for rid, r in submitted.items()}


def test_an_export_that_no_rdma_agent_used_closes_its_dmabuf_fd():
    dmabuf, unused = os.pipe()
    os.close(unused)
    with LocalMemory(RingLayout(GEOMETRY).size) as ring:
        export = RingExport(GEOMETRY, [device_segment(dmabuf), HostSegment(SPLIT, Window(ring, SPLIT,
                                                                                          ring.size - SPLIT))])
        os.fstat(dmabuf)
        export.close()
    with pytest.raises(OSError):
        os.fstat(dmabuf)


def test_several_rdma_agents_get_a_qp_each_over_one_registration():
    fabric = RecordingFabric()
    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", [HostSegment(0, ring)], GEOMETRY, ring_secret=SECRET,
                           target_factory=fabric.target) as listener:
        first = attach(listener, "rdma", fabric)
        second = attach(listener, "rdma", fabric)
        assert first.regions == second.regions
        assert first.verbs.remote.qp_num != second.verbs.remote.qp_num
        control.request_shutdown(second)
        second.close()
        first.close()


def test_an_engine_without_rdma_says_so_and_still_serves_ipc():
    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", [HostSegment(0, ring)], GEOMETRY, ring_secret=SECRET) as listener:
        with pytest.raises(HandshakeError, match="rejected this agent: this engine was started without RDMA"):
            open_remote(address(listener), "rdma", ring_secret=SECRET, verbs_factory=RecordingFabric().initiator)
        open_remote(address(listener), "ipc", ring_secret=SECRET).close()


def test_an_engine_whose_rdma_device_fails_sends_the_reason():
    def no_device():
        raise RdmaError("no RDMA device here (ibv_devices lists none)")

    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", [HostSegment(0, ring)], GEOMETRY, ring_secret=SECRET,
                           target_factory=no_device) as listener:
        with pytest.raises(HandshakeError, match="cannot serve RDMA: no RDMA device here"):
            open_remote(address(listener), "rdma", ring_secret=SECRET, verbs_factory=RecordingFabric().initiator)


def test_ipc_from_another_host_is_refused():
    with LocalMemory(RingLayout(GEOMETRY).size) as ring:
        export = RingExport(GEOMETRY, [HostSegment(0, ring)])
        elsewhere = Hello("ipc", control.VERSION, NONCE, PROOF, host="00000000-0000-0000-0000-000000000000")
        with pytest.raises(HandshakeError, match="another host.*use --transport rdma"):
            export.answer(elsewhere, PROOF)


def test_a_private_ring_cannot_be_offered_over_ipc():
    layout = RingLayout(GEOMETRY)
    with LocalMemory(layout.size) as ring:
        layout.initialise(ring)
        export = RingExport(GEOMETRY, [HostSegment(0, ring)])
        with pytest.raises(HandshakeError, match="private memory"):
            export.answer(Hello("ipc", control.VERSION, NONCE, PROOF, host=boot_id()), PROOF)


def test_an_agent_of_another_ring_protocol_version_is_refused():
    layout = RingLayout(GEOMETRY)
    with LocalMemory(layout.size) as ring:
        export = RingExport(GEOMETRY, [HostSegment(0, ring)], target_factory=RecordingFabric().target)
        with pytest.raises(HandshakeError, match=f"ring protocol version 99, this engine {control.VERSION}"):
            export.answer(Hello("rdma", 99, NONCE, PROOF, endpoint=ENDPOINT), PROOF)


def test_an_offer_that_does_not_describe_the_ring_reached_is_caught():
    """An engine that offers a geometry its ring was not created with: the agent reads the real control block
    through the new transport and refuses it."""
    other = RingGeometry(n_slots=GEOMETRY.n_slots, max_prompt_tokens=GEOMETRY.max_prompt_tokens,
                         max_output_tokens=GEOMETRY.max_output_tokens, max_stop_ids=GEOMETRY.max_stop_ids + 1)
    assert RingLayout(other).size == RingLayout(GEOMETRY).size
    fabric = RecordingFabric()
    with standin_engine(GEOMETRY) as (ring, _):
        export = RingExport(other, [HostSegment(0, ring)], target_factory=fabric.target)
        with RingListener("127.0.0.1:0", export, SECRET) as listener:
            with pytest.raises(RingMismatch, match="ring field 'max_stop_ids' is 2 in the region but 3"):
                attach(listener, "rdma", fabric)


def test_the_export_checks_its_segments_and_the_agent_its_transport():
    with LocalMemory(4096) as small:
        with pytest.raises(ValueError, match="cover \\[0, 4096\\) but the ring is"):
            RingExport(GEOMETRY, [HostSegment(0, small)])
    with pytest.raises(ValueError, match="--transport must be one of \\('rdma', 'ipc'\\)"):
        open_remote("127.0.0.1:1", "tcp", ring_secret=SECRET)


def test_without_pyverbs_both_sides_say_what_to_install():
    try:
        import pyverbs  # noqa: F401
        pytest.skip("pyverbs is installed here")
    except ImportError:
        pass
    from blink.nic.remote.ibverbs import DeviceConfig, PyverbsTarget

    with pytest.raises(RdmaError, match="needs pyverbs.*python3-pyverbs"):
        open_remote("127.0.0.1:1", "rdma", ring_secret=SECRET)
    with LocalMemory(RingLayout(GEOMETRY).size) as ring:
        export = RingExport(GEOMETRY, [HostSegment(0, ring)], target_factory=lambda: PyverbsTarget(DeviceConfig()))
        with pytest.raises(HandshakeError, match="the engine cannot serve RDMA: the RDMA transport needs pyverbs"):
            export.answer(Hello("rdma", control.VERSION, NONCE, PROOF, endpoint=ENDPOINT), PROOF)

