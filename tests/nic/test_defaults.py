"""blink.nic.defaults: the server's default sampling from generation_config.json, and the parser applying it to the
fields a request leaves out (and only to those)."""
import json

import pytest

from blink.nic.defaults import SamplingDefaults, sampling_defaults
from blink.nic.openai.requests import Parser
from blink.nic.text import Tokenizer
from blink.ring.geometry import RingGeometry


def test_defaults_come_from_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                 "max_new_tokens": 64, "eos_token_id": 2,
                                                                 "repetition_penalty": 1.05}))
    assert sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, max_tokens=64,
                                                           repetition_penalty=1.05)
    assert sampling_defaults(tmp_path, "vllm") == SamplingDefaults()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    assert sampling_defaults(tmp_path, str(other)) == SamplingDefaults(temperature=0.1)
    assert sampling_defaults(other / "absent") == SamplingDefaults()         # auto without a file: the API's
    with pytest.raises(FileNotFoundError, match="no generation_config.json there"):
        sampling_defaults(tmp_path, str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        SamplingDefaults(temperature=-1)
    with pytest.raises(ValueError, match="repetition_penalty must be a number > 0"):
        SamplingDefaults(repetition_penalty=0)


def test_the_embedded_model_carries_its_model_cards_sampling():
    from blink.models import default_model_path
    from blink.models.default import CARD_SAMPLING

    defaults = sampling_defaults(default_model_path())
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (
        CARD_SAMPLING["temperature"], CARD_SAMPLING["top_p"], CARD_SAMPLING["max_new_tokens"])


def test_the_parser_fills_in_only_what_a_request_leaves_out(local_ring):
    from blink.models import default_model_path

    _, agent, _ = local_ring(RingGeometry(n_slots=2, max_prompt_tokens=64, max_output_tokens=64))
    defaults = SamplingDefaults(temperature=0.3, top_p=0.8, top_k=7, max_tokens=20, repetition_penalty=1.2)
    parser = Parser(Tokenizer(default_model_path()), "m", agent, defaults)
    bare = parser.chat({"messages": [{"role": "user", "content": "hi"}]}).params
    assert (bare.temperature, bare.top_p, bare.top_k, bare.max_tokens) == (0.3, pytest.approx(0.8), 7, 20)
    assert (bare.presence_penalty, bare.frequency_penalty, bare.repetition_penalty) == (0, 0, 1.2)
    given = parser.completion({"prompt": "hi", "temperature": 1.5, "top_p": 1, "top_k": 0, "max_tokens": 5,
                               "presence_penalty": -1, "frequency_penalty": 0.5, "repetition_penalty": 1}).params
    assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (1.5, 1.0, 0, 5)
    assert (given.presence_penalty, given.frequency_penalty, given.repetition_penalty) == (-1, 0.5, 1)
