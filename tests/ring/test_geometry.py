"""blink.ring.geometry: every size is checked against its limit, by name."""
import pytest

from blink.ring.geometry import RingGeometry


@pytest.mark.parametrize("field,value", [("n_slots", 0), ("n_slots", 1 << 21), ("max_prompt_tokens", 0),
                                         ("max_output_tokens", -1), ("max_stop_ids", 65), ("n_slots", 2.0),
                                         ("n_slots", True), ("logprobs", 1)])
def test_geometry_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"RingGeometry.{field}"):
        RingGeometry(**{field: value})


def test_check_names_the_owner_and_the_limit():
    with pytest.raises(ValueError, match=r"EngineConfig.n_slots must be an int in \[1, 1048576\] \(got 0\)"):
        RingGeometry.check("n_slots", 0, "EngineConfig")
    RingGeometry.check("max_stop_ids", 0, "EngineConfig")
