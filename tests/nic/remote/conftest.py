"""``@pytest.mark.rdma`` tests need pyverbs and an RDMA device with an active port; elsewhere they skip, saying which
of the two is missing."""
import pytest


def _rdma_missing() -> str | None:
    """Why the RDMA tests cannot run here, or None when they can."""
    try:
        from blink.nic.remote.ibverbs import require_pyverbs
        require_pyverbs()
        from pyverbs.device import get_device_list
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError:
        return "needs pyverbs (apt install python3-pyverbs) and an RDMA device"
    try:
        if get_device_list():
            return None
    except PyverbsError:
        pass
    return "needs an RDMA device (ibv_devices lists none here; no soft-RoCE either)"


def pytest_configure(config):
    config.addinivalue_line("markers", "rdma: needs pyverbs and an RDMA device (skipped elsewhere, saying why)")


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("rdma")]
    reason = _rdma_missing() if marked else None
    for item in marked if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))
