"""blink.ring.secret: an agent attaches by name (``blink agent --ring NAME``, ``blink.host.process.open_ring``) only to
a ring its engine made with the secret the agent was given: the key file beside the ring (this user's, mode 0600), or
``$BLINK_RING_SECRET``. Issue 38 #2: the ring's owner and mode alone told the agent it was its user's, not its
engine's."""
import os
import stat
import uuid

import pytest

from blink.core import create_ring
from blink.host.process import open_ring
from blink.ring import control, secret
from blink.ring.errors import RingRefused
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.transport import SharedMemory
from tests.privileges import run_as, second_user_reason, unused_uid

GEOMETRY = RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=8)


def _name():
    return f"blink-test-secret-{uuid.uuid4().hex[:12]}"


def test_an_engines_ring_comes_with_a_private_key_file_that_lets_its_agent_attach_and_goes_with_it(monkeypatch):
    monkeypatch.delenv(secret.ENV, raising=False)
    name = _name()
    with create_ring(name, GEOMETRY) as ring:
        key = secret.key_path(name)
        info = os.lstat(key)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        block = control.decode(ring.read(0, control.CONTROL_DTYPE.itemsize))
        with open(key) as f:
            assert int(block["secret_digest"]) == secret.digest(f.read()) != 0
        with open_ring(name) as attached:
            assert attached.size == ring.size
        assert "secret_digest" not in control.read(ring), "the digest is no stat"
    assert not os.path.exists(key) and not os.path.exists(ring.path)


def test_the_secret_can_come_from_the_environment_and_a_wrong_one_is_refused(monkeypatch):
    name = _name()
    monkeypatch.setenv(secret.ENV, "the team's secret")
    with create_ring(name, GEOMETRY):
        os.unlink(secret.key_path(name))        # an agent that cannot see the engine's /dev/shm: the variable alone
        open_ring(name).close()
        monkeypatch.setenv(secret.ENV, "a guess")
        with pytest.raises(RingRefused, match="not made with this agent's secret"):
            open_ring(name)


def test_a_ring_made_without_the_agents_secret_is_refused(monkeypatch):
    """A ring of this user that no engine of this blink made with a key (another engine's under that name, say)."""
    monkeypatch.delenv(secret.ENV, raising=False)
    name = _name()
    layout = RingLayout(GEOMETRY)
    with SharedMemory.create(name, layout.size) as ring:
        layout.initialise(ring)
        with pytest.raises(RingRefused, match="no key file .* beside the ring"):
            open_ring(name)
        with open(secret.key_path(name), "x") as f:
            f.write("some other engine's")
        try:
            os.chmod(secret.key_path(name), 0o600)
            with pytest.raises(RingRefused, match="not made with this agent's secret"):
                open_ring(name)
            os.chmod(secret.key_path(name), 0o644)
            with pytest.raises(RingRefused, match="open to other users"):
                open_ring(name)
        finally:
            secret.remove(name)


def test_a_key_file_another_user_planted_is_never_used(monkeypatch):
    """Planted before the engine starts, the engine refuses the name; planted beside a ring, the agent refuses it."""
    if reason := second_user_reason():
        pytest.skip(reason)
    monkeypatch.delenv(secret.ENV, raising=False)
    name = _name()
    planted = run_as(unused_uid(), f"""
import os
fd = os.open({secret.key_path(name)!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
os.write(fd, b"the other user's")
""")
    assert planted.returncode == 0, planted.stderr
    try:
        with pytest.raises(FileExistsError, match="key file .* exists already"):
            create_ring(name, GEOMETRY)
        assert not os.path.exists(os.path.join(SharedMemory.SHM_DIR, name))
        layout = RingLayout(GEOMETRY)
        with SharedMemory.create(name, layout.size) as ring:
            layout.initialise(ring)
            with pytest.raises(RingRefused, match="belongs to uid"):
                open_ring(name)
    finally:
        secret.remove(name)


def test_the_secret_given_to_an_agent_of_the_listener_is_the_variable_else_the_named_rings_key_file(monkeypatch):
    """``given``: what ``blink agent --remote`` proves (``--ring-key NAME`` or none) and the engine's listener
    checks (its ring's name, or none for an in-process ring)."""
    monkeypatch.delenv(secret.ENV, raising=False)
    assert secret.given(None) is None
    name = _name()
    with create_ring(name, GEOMETRY):
        with open(secret.key_path(name)) as f:
            assert secret.given(name) == f.read()
        os.chmod(secret.key_path(name), 0o644)
        with pytest.raises(RingRefused, match="open to other users"):
            secret.given(name)
        monkeypatch.setenv(secret.ENV, "the team's secret")
        assert secret.given(name) == secret.given(None) == "the team's secret"
    monkeypatch.delenv(secret.ENV)
    with pytest.raises(RingRefused, match="no key file"):
        secret.given(name)          # the ring is gone, and its key file with it
