"""blink.ring.control: the control block of a fresh ring, its checks against a geometry, the geometry read back from
an existing ring, the decoded words of a live ring and the shutdown word (offsets are pinned in test_layout.py)."""
import numpy as np
import pytest

from blink.errors import RingMismatch
from blink.ring import control
from blink.ring.control import CONTROL_DTYPE
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.transport import LocalMemory


def test_verify_accepts_its_own_control_block_and_names_mismatched_fields():
    layout = RingLayout(RingGeometry(n_slots=16))
    layout.verify(layout.control_bytes())
    other = RingLayout(RingGeometry(n_slots=32)).control_bytes()
    with pytest.raises(RingMismatch, match="'n_slots' is 32 in the region but 16"):
        layout.verify(other)
    with pytest.raises(RingMismatch, match="'flags'"):
        layout.verify(RingLayout(RingGeometry(n_slots=16, logprobs=False)).control_bytes())
    with pytest.raises(RingMismatch, match="'max_stop_ids'"):
        layout.verify(RingLayout(RingGeometry(n_slots=16, max_stop_ids=2)).control_bytes())
    with pytest.raises(RingMismatch, match="'magic'"):
        layout.verify(bytes(CONTROL_DTYPE.itemsize))
    wrong_version = np.frombuffer(layout.control_bytes(), CONTROL_DTYPE).copy()
    wrong_version["version"] = control.VERSION + 1
    with pytest.raises(RingMismatch, match="'version'"):
        layout.verify(wrong_version.tobytes())
    with pytest.raises(RingMismatch, match="bytes"):
        layout.verify(b"\0" * 10)


@pytest.mark.parametrize("geometry", [RingGeometry(), RingGeometry(n_slots=3, max_prompt_tokens=5, max_output_tokens=7,
                                                                   max_stop_ids=0, logprobs=False, max_logit_bias=0,
                                                                   max_top_logprobs=20)])
def test_the_geometry_read_back_from_a_ring_is_the_one_it_was_created_with(geometry):
    assert control.geometry_of(control.fresh(geometry)) == geometry
    with pytest.raises(RingMismatch, match="'magic'"):
        control.geometry_of(bytes(CONTROL_DTYPE.itemsize))


def test_read_decodes_every_word_and_request_shutdown_sets_only_the_shutdown_word():
    layout = RingLayout(RingGeometry(n_slots=4, max_prompt_tokens=4, max_output_tokens=4))
    with LocalMemory(layout.size) as memory:
        layout.initialise(memory)
        words = control.read(memory)
        assert set(words) == set(CONTROL_DTYPE.names) - {"secret_digest"} == set(control.WORDS)
        assert words["magic"] == control.MAGIC and words["n_slots"] == 4
        before = memory.read(0, CONTROL_DTYPE.itemsize)
        control.request_shutdown(memory)
        after = memory.read(0, CONTROL_DTYPE.itemsize)
        changed = [i for i in range(len(before)) if before[i] != after[i]]
        assert changed == [control.offset_of("shutdown")] and control.read(memory)["shutdown"] == 1
