"""blink.ring.request: SamplingParams' validation, and the header encoding that checks every number against the type
of the field that stores it (reference: numpy's own integer limits and float32 rounding)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blink.ring.layout import FLAG_IGNORE_EOS, FLAG_LOGPROBS, HEADER_DTYPE, PAIR_DTYPE, TOKEN_DTYPE
from blink.ring.request import (GREEDY_BELOW, SamplingParams, encode_header, encode_logit_bias,
                                encode_stop_token_ids)

HEADER = HEADER_DTYPE
FIELDS = dict(request_id=7, arrival_ns=123, seed=2**64 - 1, prompt_len=5, priority=-3)


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -1), ("max_tokens", 0), ("seed", -1),
                                         ("seed", 2**64), ("stop_token_ids", (-3,)), ("ignore_eos", 1),
                                         ("temperature", float("inf")), ("temperature", 1e308), ("top_k", 2**31),
                                         ("max_tokens", 2**31), ("stop_token_ids", (2**31,)), ("stop", ("",)),
                                         ("stop", (3,)), ("top_p", 1e-46), ("logprobs", "yes"),
                                         ("presence_penalty", 2.01), ("presence_penalty", float("nan")),
                                         ("frequency_penalty", -2.5), ("frequency_penalty", True),
                                         ("repetition_penalty", 0), ("repetition_penalty", -1.0),
                                         ("repetition_penalty", float("inf")), ("repetition_penalty", 1e-46),
                                         ("min_p", -0.01), ("min_p", 1.01), ("min_p", float("nan")), ("min_p", True),
                                         ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101}),
                                         ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
                                         ("logit_bias", {5: float("nan")}), ("logit_bias", [(5, 1.0)]),
                                         ("top_logprobs", 21), ("top_logprobs", -1), ("top_logprobs", 3)])
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_a_huge_value_is_cut_short_in_the_message():
    with pytest.raises(ValueError) as refused:
        SamplingParams(top_k=10**4000)
    message = str(refused.value)
    assert message.startswith("SamplingParams.top_k must be") and message.endswith(f"(got {'1' + '0' * 76}...)")


@pytest.mark.parametrize("temperature", [1e-39, 1e-38, 1e-20, GREEDY_BELOW / 2])
def test_temperatures_below_the_floor_are_greedy(temperature):
    """Regression (denormal temperatures gave wrong tokens): below GREEDY_BELOW a request is greedy."""
    assert SamplingParams(temperature=temperature).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW


def test_a_stop_string_alone_is_a_one_element_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop == ("a", "b")


@given(params=st.builds(SamplingParams, max_tokens=st.integers(1, 2**31 - 1),
                        temperature=st.floats(0, 3.4e38, allow_nan=False), top_p=st.floats(1e-6, 1.0),
                        top_k=st.integers(0, 2**31 - 1), seed=st.integers(0, 2**64 - 1),
                        stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4).map(tuple),
                        ignore_eos=st.booleans(), logprobs=st.booleans(),
                        presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
                        repetition_penalty=st.floats(1e-6, 3.4e38), min_p=st.floats(0, 1),
                        logit_bias=st.dictionaries(st.integers(0, 2**31 - 1), st.floats(-100, 100), max_size=5)))
def test_every_valid_request_encodes_to_exactly_its_values(params):
    header = np.frombuffer(encode_header(params=params, **FIELDS), HEADER)[0]
    for name, value in FIELDS.items():
        assert int(header[name]) == value
    assert int(header["max_tokens"]) == params.max_tokens and int(header["top_k"]) == params.top_k
    assert header["temperature"] == np.float32(params.temperature) and header["top_p"] == np.float32(params.top_p)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        assert header[name] == np.float32(getattr(params, name)), name
    assert int(header["n_logit_bias"]) == len(params.logit_bias) and int(header["top_logprobs"]) == 0
    pairs = np.frombuffer(encode_logit_bias(params), PAIR_DTYPE)
    assert pairs["token"].tolist() == list(params.logit_bias)
    assert pairs["value"].tolist() == [float(np.float32(b)) for b in params.logit_bias.values()]
    assert int(header["n_stop"]) == len(params.stop_token_ids)
    assert np.frombuffer(encode_stop_token_ids(params), TOKEN_DTYPE).tolist() == list(params.stop_token_ids)
    flags = (FLAG_IGNORE_EOS if params.ignore_eos else 0) | (FLAG_LOGPROBS if params.logprobs else 0)
    assert int(header["request_flags"]) == flags


@pytest.mark.parametrize("field,value", [("request_id", -1), ("request_id", 2**64), ("arrival_ns", 2**64),
                                         ("prompt_len", 2**32), ("priority", 2**31), ("priority", -2**31 - 1),
                                         ("priority", 0.5), ("seed", 2**64)])
def test_a_value_outside_its_header_field_is_refused_by_name(field, value):
    fields = {**FIELDS, field: value}
    dtype = HEADER.fields[field][0]
    with pytest.raises(ValueError, match=f"request field '{field}' must be an int in "
                                         rf"\[{np.iinfo(dtype).min}, {np.iinfo(dtype).max}\]"):
        encode_header(params=SamplingParams(), **fields)


def test_penalties_are_neutral_by_default_and_say_when_they_are_not():
    assert not SamplingParams().has_penalties
    assert all(SamplingParams(**{name: value}).has_penalties
               for name, value in [("presence_penalty", -0.5), ("frequency_penalty", 2), ("repetition_penalty", 1.1)])


def test_top_logprobs_need_logprobs_and_are_encoded():
    """OpenAI's rule: top_logprobs only with logprobs (the error names top_logprobs)."""
    with pytest.raises(ValueError, match="SamplingParams.top_logprobs must be 0 unless logprobs is True"):
        SamplingParams(top_logprobs=2)
    header = np.frombuffer(encode_header(params=SamplingParams(logprobs=True, top_logprobs=20), **FIELDS),
                           HEADER)[0]
    assert int(header["top_logprobs"]) == 20 and int(header["request_flags"]) == FLAG_LOGPROBS
    assert encode_logit_bias(SamplingParams()) == b""
