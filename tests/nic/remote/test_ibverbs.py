"""The pyverbs verbs layer: what it says when pyverbs, rdma-core or a device is missing (here), and the transport on
a real device (``@pytest.mark.rdma``: skipped, saying why, where there is none)."""
import pytest

from blink.errors import RdmaError
from blink.nic.remote import verbs
from blink.nic.remote.ibverbs import DeviceConfig, PyverbsVerbs, require_pyverbs



def pyverbs_or_skip():
    try:
        return require_pyverbs()
    except ImportError:
        pytest.skip("needs pyverbs (apt install python3-pyverbs)")


def test_a_missing_pyverbs_names_what_to_install():
    try:
        import pyverbs  # noqa: F401
        pytest.skip("pyverbs is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pyverbs.*rdma-core.*python3-pyverbs"):
        require_pyverbs()


def test_our_completion_codes_are_ibverbs_abi_values():
    pyverbs_or_skip()
    import pyverbs.enums as e

    for code, (name, _) in verbs.WC_STATUS.items():
        assert getattr(e, name) == code, name


def test_no_device_is_an_rdma_error_that_says_what_to_do():
    pyverbs_or_skip()
    from pyverbs.device import get_device_list
    from pyverbs.pyverbs_error import PyverbsError

    try:
        if get_device_list():
            pytest.skip("this host has an RDMA device")
    except PyverbsError:
        pass
    with pytest.raises(RdmaError, match="no RDMA device here.*mlx5_ib.*python3-pyverbs"):
        PyverbsVerbs(DeviceConfig(), 4096, 4)


def test_the_connection_attributes_are_built_with_the_real_pyverbs_api():
    """No device needed: the QPAttr and SendWR objects that connect and post hand to rdma-core."""
    pyverbs_or_skip()
    import pyverbs.enums as e

    from blink.nic.remote.ibverbs import QP_RETRY_CNT, QP_TIMEOUT, rts_attributes, send_request
    from blink.nic.remote.verbs import WRITE, WorkRequest
    from blink.nic.remote.wire import Endpoint

    local = Endpoint(qp_num=0x11, psn=5, gid="fe80:0000:0000:0000:0000:0000:0000:0001", lid=0, mtu=4096,
                     max_rd_atomic=16)
    remote = Endpoint(qp_num=0x22, psn=9, gid="0000:0000:0000:0000:0000:ffff:c0a8:6401", lid=3, mtu=1024,
                      max_rd_atomic=8)
    attr = rts_attributes(DeviceConfig(port=1, gid_index=3), local, remote)
    assert (attr.path_mtu, attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (e.IBV_MTU_1024, 0x22, 9, 5)
    assert (attr.max_rd_atomic, attr.max_dest_rd_atomic, attr.timeout, attr.retry_cnt) == (8, 8, QP_TIMEOUT,
                                                                                            QP_RETRY_CNT)
    assert (attr.ah_attr.dgid, attr.ah_attr.sgid_index, attr.ah_attr.dlid, attr.ah_attr.is_global) == (remote.gid, 3,
                                                                                                        3, 1)
    wr = send_request(WorkRequest(7, WRITE, 64, 96, 0x7F0000001000, 0xABCD, True), 0x10000, 0x55)
    assert (wr.wr_id, wr.opcode, wr.num_sge, wr.send_flags) == (7, e.IBV_WR_RDMA_WRITE, 1, e.IBV_SEND_SIGNALED)
    unsignaled = send_request(WorkRequest(8, WRITE, 0, 4, 0x7F0000001000, 0xABCD, False), 0x10000, 0x55)
    assert unsignaled.send_flags == 0


@pytest.mark.parametrize("field,value", [("device", ""), ("port", 0), ("port", 256), ("gid_index", -1),
                                         ("gid_index", True)])
def test_device_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"DeviceConfig.{field}"):
        DeviceConfig(**{field: value})


# -- on a real device -------------------------------------------------------------------------------------------

@pytest.mark.rdma
def test_the_transport_over_a_real_loopback_qp():
    """The agent's QP and the engine's QP on this host's device, connected to each other."""
    from blink.nic.remote.ibverbs import PyverbsTarget
    from blink.nic.remote.rdma import RdmaConfig, RdmaMemory
    from blink.nic.remote.segments import HostSegment
    from blink.ring.transport import LocalMemory

    config = RdmaConfig(send_queue_depth=8, cell_bytes=4096)
    ring = LocalMemory(1 << 16)
    target = PyverbsTarget(DeviceConfig())
    region = target.register(HostSegment(0, ring))
    agent_qp = PyverbsVerbs(DeviceConfig(), config.staging_bytes, config.send_queue_depth)
    agent_qp.connect(target.accept(agent_qp.endpoint))
    memory = RdmaMemory(agent_qp, (region,), ring.size, config)
    payload = bytes(range(256)) * 100
    memory.write(100, payload)
    memory.fence()
    assert ring.read(100, len(payload)) == payload
    ring.write(40000, b"from the engine")
    assert memory.read(40000, 15) == b"from the engine"
    memory.close()
    target.close()


@pytest.mark.rdma
def test_an_agent_attached_over_real_rdma_gets_the_reference_outputs():
    from blink.nic.remote.attach import listen_on_ring, open_remote
    from blink.nic.remote.segments import HostSegment
    from blink.ring.reference import standin_engine

    from .test_attach import GEOMETRY, RDMA, SECRET, expected_output, serve_requests

    with standin_engine(GEOMETRY) as (ring, _), \
            listen_on_ring("127.0.0.1:0", [HostSegment(0, ring)], GEOMETRY, ring_secret=SECRET,
                           rdma_device=DeviceConfig()) as listener:
        memory = open_remote("%s:%d" % listener.address, "rdma", ring_secret=SECRET, rdma=RDMA, device=DeviceConfig())
        try:
            results, submitted = serve_requests(memory)
        finally:
            memory.close()
    assert {rid: results[rid] for rid in submitted} == {rid: expected_output(*r) for rid, r in submitted.items()}
