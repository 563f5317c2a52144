"""blink.outputs.OutputBuilder against the reference it must equal: the tokenizer's decode of all tokens, cut at the
first stop string, and the tokens up to the one that completed it."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.nic.agent import RequestOutput
from blink.outputs import OutputBuilder
from blink.ring.request import SamplingParams


def build(tokenizer, tokens, params, chunks, finish="length"):
    builder = OutputBuilder([1], params, tokenizer)
    deltas, i = [], 0
    for size in chunks:
        piece = tokens[i:i + size]
        i += size
        last = i >= len(tokens)
        top = [[(t, -0.5), (t + 1, -1.5)][:params.top_logprobs] for t in piece] if params.top_logprobs else None
        deltas.append(builder.push(RequestOutput(0, piece, [-0.5] * len(piece) if params.logprobs else None, last,
                                                 finish if last else None, top)))
        if builder.finished:
            break
    return builder, deltas


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.sampled_from(["Paris", " is", " the", " capital", ".", "\n", " of", " France", "é"]),
                      min_size=1, max_size=12), chunk=st.integers(1, 4), data=st.data())
def test_text_tokens_and_finish_equal_the_cut_decode(tokenizer, words, chunk, data):
    tokens = tokenizer.encode("".join(words), add_special_tokens=False)
    text = tokenizer.decode(tokens)
    stop = data.draw(st.sampled_from([" capital", ".", "\n\n", "x"]))
    builder, deltas = build(tokenizer, tokens, SamplingParams(stop=(stop,), logprobs=True, top_logprobs=2),
                            [chunk] * len(tokens))
    out = builder.output
    assert "".join(d.text for d in deltas) == out.text
    if stop in text:
        assert out.text == text[:text.index(stop)] and out.finish_reason == "stop" and builder.stopped
        assert stop in tokenizer.decode(out.token_ids) and stop not in tokenizer.decode(out.token_ids[:-1])
    else:
        assert out.text == text and out.finish_reason == "length" and out.token_ids == tokens
    assert out.logprobs == [-0.5] * len(out.token_ids)
    assert out.top_logprobs == [[(t, -0.5), (t + 1, -1.5)] for t in out.token_ids]  # cut where the tokens are
    assert [t for d in deltas for t in d.top_logprobs] == out.top_logprobs
    assert [t for d in deltas for t in d.token_ids] == out.token_ids


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        OutputBuilder([1], SamplingParams(stop=("x",)), None)
    builder = OutputBuilder([1], SamplingParams(), None)
    delta = builder.push(RequestOutput(0, [5, 6], None, True, "length"))
    assert (delta.text, builder.output.text, builder.output.token_ids) == (None, None, [5, 6])
