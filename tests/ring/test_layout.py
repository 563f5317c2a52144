import itertools

import numpy as np
import pytest

from blink.errors import IllegalTransition
from blink.ring.control import CONTROL_DTYPE
from blink.ring.geometry import RingGeometry
from blink.ring.layout import (AGENT, FINISHED, FREE, GPU, HEADER_DTYPE, PAIR_DTYPE, READY, RUNNING, STATUS_COLUMNS,
                               RingLayout, check_transition)

# The contract, written out by hand: (field, byte offset, byte size). A change here is a protocol change.
CONTROL_SPEC = [("magic", 0, 4), ("version", 4, 4), ("n_slots", 8, 4), ("max_prompt_tokens", 12, 4),
                ("max_output_tokens", 16, 4), ("max_stop_ids", 20, 4), ("flags", 24, 4), ("shutdown", 28, 4),
                ("engine_state", 32, 4), ("launch_error", 36, 4), ("heartbeat", 40, 8), ("steps", 48, 8),
                ("tokens", 56, 8), ("admitted", 64, 8), ("finished", 72, 8), ("cancelled", 80, 8),
                ("preempted", 88, 8), ("kv_pages_total", 96, 4), ("kv_pages_free", 100, 4), ("running", 104, 4),
                ("waiting", 108, 4), ("submitted", 112, 8), ("cancels", 120, 8), ("max_model_len", 128, 4),
                ("in_step", 132, 4), ("step_limit_s", 136, 4), ("alive", 144, 8), ("creator_pid", 152, 4),
                ("prefix_page_size", 156, 4), ("prefix_seed", 160, 8), ("prefix_query_tokens", 168, 8),
                ("prefix_hit_tokens", 176, 8), ("prefix_evictions", 184, 8), ("prefill_tokens", 192, 8),
                ("cached_pages", 200, 4), ("max_logit_bias", 204, 4), ("max_top_logprobs", 208, 4),
                ("vocab_size", 212, 4), ("secret_digest", 216, 8), ("max_grammar_bytes", 224, 4),
                ("num_speculative_tokens", 228, 4), ("spec_drafts", 232, 8), ("spec_draft_tokens", 240, 8),
                ("spec_accepted_tokens", 248, 8), ("spec_accepted_per_pos", 256, 8 * 16)]
HEADER_SPEC = [("request_id", 0, 8), ("arrival_ns", 8, 8), ("seed", 16, 8), ("prompt_len", 24, 4),
               ("max_tokens", 28, 4), ("temperature", 32, 4), ("top_p", 36, 4), ("top_k", 40, 4),
               ("request_flags", 44, 4), ("n_stop", 48, 4), ("priority", 52, 4), ("prefix_state", 56, 8),
               ("presence_penalty", 64, 4), ("frequency_penalty", 68, 4), ("repetition_penalty", 72, 4),
               ("min_p", 76, 4), ("top_logprobs", 80, 4), ("n_logit_bias", 84, 4), ("grammar", 88, 4),
               ("num_speculative_tokens", 92, 4)]


@pytest.mark.parametrize("dtype,spec,itemsize", [(CONTROL_DTYPE, CONTROL_SPEC, 384), (HEADER_DTYPE, HEADER_SPEC, 96)])
def test_struct_offsets_sizes_and_natural_alignment(dtype, spec, itemsize):
    assert dtype.itemsize == itemsize
    assert list(dtype.names) == [name for name, _, _ in spec]
    for name, offset, size in spec:
        field_dtype, field_offset = dtype.fields[name][:2]
        assert (field_offset, field_dtype.itemsize) == (offset, size), name
        assert field_offset % field_dtype.base.itemsize == 0, f"{name} is not naturally aligned"
        assert field_dtype.base.byteorder in "<=|", f"{name} is not little-endian"
    ends = sorted((off, off + size) for _, off, size in spec)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "fields overlap"


@pytest.mark.parametrize("geometry", [RingGeometry(), RingGeometry(n_slots=3, max_prompt_tokens=5, max_output_tokens=7,
                                                                   max_stop_ids=0, logprobs=False, max_logit_bias=0),
                                      RingGeometry(n_slots=5, max_prompt_tokens=70, prefix_page_size=16,
                                                   max_logit_bias=3, max_top_logprobs=20, max_grammar_bytes=4098,
                                                   vocab_size=100)])
def test_regions_are_page_aligned_disjoint_and_sized(geometry):
    layout = RingLayout(geometry)
    n = geometry.n_slots
    column = (4 * n + 63) // 64 * 64
    expected = {"control": 384, "status": 5 * column, "headers": 96 * n,
                "stop_token_ids": 4 * n * geometry.max_stop_ids, "prompts": 4 * n * geometry.max_prompt_tokens,
                "prefix_keys": 8 * n * (geometry.max_prompt_tokens // geometry.prefix_page_size
                                        if geometry.prefix_page_size else 0),
                "logit_bias": 8 * n * geometry.max_logit_bias,
                "grammars": geometry.max_grammar_bytes // 4 * 4,
                "outputs": 4 * n * geometry.max_output_tokens,
                "logprobs": 4 * n * geometry.max_output_tokens if geometry.logprobs else 0,
                "top_logprobs": 8 * n * geometry.max_output_tokens * geometry.max_top_logprobs}
    previous_end = 0
    for name, (offset, size) in layout.regions.items():
        assert size == expected[name]
        assert offset % 4096 == 0 and offset >= previous_end
        previous_end = offset + size
    assert layout.size >= previous_end and layout.size % 4096 == 0
    for i, name in enumerate(STATUS_COLUMNS):
        assert layout.status_at(name, n - 1) == layout.offset("status") + i * column + 4 * (n - 1)
    assert STATUS_COLUMNS == ("state", "epoch", "cancel", "finish_reason", "n_generated")
    assert layout.output_at(1, 2) == layout.offset("outputs") + 4 * geometry.max_output_tokens + 8
    assert layout.logit_bias_at(2) == layout.offset("logit_bias") + 16 * geometry.max_logit_bias
    assert layout.top_logprobs_at(1, 2) == (layout.offset("top_logprobs")
                                            + 8 * geometry.max_top_logprobs * (geometry.max_output_tokens + 2))
    assert layout.grammar_at(3) == layout.offset("grammars") + 12
    for name in ("logit_bias", "grammars"):                                     # the request side
        assert list(layout.regions).index(name) < list(layout.regions).index("outputs")


def _random_value(dtype: np.dtype, rng):
    if dtype.kind == "f":
        return rng.standard_normal(dtype.shape).astype(dtype.base)
    info = np.iinfo(dtype.base)
    return rng.integers(info.min, info.max, size=dtype.shape, dtype=dtype.base, endpoint=True)


def test_every_field_round_trips_through_the_region_views():
    geometry = RingGeometry(n_slots=5, max_prompt_tokens=7, max_output_tokens=3, max_stop_ids=4, prefix_page_size=3,
                            max_logit_bias=2, max_top_logprobs=2, max_grammar_bytes=64, vocab_size=40)
    layout = RingLayout(geometry)
    rng = np.random.default_rng(0)
    buffer = bytearray(layout.size)
    view = layout.view(buffer)
    written = {}
    for region, array in [("control", view.control), ("headers", view.headers)]:
        for slot in range(len(array)):
            for name in array.dtype.names:
                value = _random_value(array.dtype[name], rng)
                array[name][slot] = value
                written[(region, slot, name)] = value
    for name in STATUS_COLUMNS:
        view.status[name][:] = rng.integers(0, 2**32, 5, dtype=np.uint32)
    view.prompts[:] = rng.integers(0, 2**31, view.prompts.shape)
    view.stop_token_ids[:] = rng.integers(0, 2**31, view.stop_token_ids.shape)
    view.prefix_keys[:] = rng.integers(0, 2**64, view.prefix_keys.shape, dtype=np.uint64, endpoint=False)
    view.outputs[:] = rng.integers(0, 2**31, view.outputs.shape)
    view.logprobs[:] = rng.standard_normal(view.logprobs.shape)
    for pairs in (view.logit_bias, view.top_logprobs):
        pairs["token"] = rng.integers(0, 2**31, pairs.shape)
        pairs["value"] = rng.standard_normal(pairs.shape)
    view.grammars[:] = rng.integers(-2**31, 2**31, view.grammars.shape)
    # Read back through raw byte offsets, as a transport would.
    for (region, slot, name), value in written.items():
        dtype = {"control": CONTROL_DTYPE, "headers": HEADER_DTYPE}[region]
        base = {"control": 0, "headers": layout.header_at(slot)}[region]
        field, offset = dtype.fields[name][:2]
        got = np.frombuffer(bytes(buffer[base + offset: base + offset + field.itemsize]), field.base)
        np.testing.assert_array_equal(got.reshape(field.shape), value)
    for name in STATUS_COLUMNS:
        for slot in range(5):
            offset = layout.status_at(name, slot)
            assert np.frombuffer(bytes(buffer[offset: offset + 4]), "<u4")[0] == view.status[name][slot]
    for slot in range(5):
        prompt = np.frombuffer(bytes(buffer[layout.prompt_at(slot): layout.prompt_at(slot) + 28]), "<i4")
        np.testing.assert_array_equal(prompt, view.prompts[slot])
        at = layout.stop_token_ids_at(slot)
        np.testing.assert_array_equal(np.frombuffer(bytes(buffer[at: at + 16]), "<i4"), view.stop_token_ids[slot])
        keys = np.frombuffer(bytes(buffer[layout.prefix_keys_at(slot): layout.prefix_keys_at(slot) + 16]), "<u8")
        np.testing.assert_array_equal(keys, view.prefix_keys[slot])        # 7 // 3: two full pages
        out = np.frombuffer(bytes(buffer[layout.output_at(slot): layout.output_at(slot, 3)]), "<i4")
        np.testing.assert_array_equal(out, view.outputs[slot])
        lp = np.frombuffer(bytes(buffer[layout.logprob_at(slot): layout.logprob_at(slot, 3)]), "<f4")
        np.testing.assert_array_equal(lp, view.logprobs[slot])
        bias = np.frombuffer(bytes(buffer[layout.logit_bias_at(slot): layout.logit_bias_at(slot) + 16]), PAIR_DTYPE)
        np.testing.assert_array_equal(bias, view.logit_bias[slot])
        word = np.frombuffer(bytes(buffer[layout.grammar_at(slot): layout.grammar_at(slot) + 4]), "<i4")
        assert word[0] == view.grammars[slot]
        for index in range(3):
            at = layout.top_logprobs_at(slot, index)
            np.testing.assert_array_equal(np.frombuffer(bytes(buffer[at: at + 16]), PAIR_DTYPE),
                                          view.top_logprobs[slot, index])


def test_views_do_not_overlap():
    layout = RingLayout(RingGeometry(n_slots=4, max_prompt_tokens=3, max_output_tokens=2, prefix_page_size=1,
                                     max_logit_bias=3, max_top_logprobs=2, max_grammar_bytes=40, vocab_size=9))
    buffer = bytearray(layout.size)
    view = layout.view(buffer)
    columns = [view.status[name] for name in STATUS_COLUMNS]
    for array in (view.control, *columns, view.headers, view.stop_token_ids, view.prompts, view.prefix_keys,
                  view.logit_bias, view.grammars, view.outputs, view.logprobs, view.top_logprobs):
        array.view(np.uint8)[...] = 0xFF
        assert sum(buffer) == 0xFF * array.nbytes
        array.view(np.uint8)[...] = 0


LEGAL = {(FREE, READY, AGENT), (READY, RUNNING, GPU), (READY, FINISHED, GPU), (RUNNING, FINISHED, GPU),
         (FINISHED, FREE, AGENT)}


@pytest.mark.parametrize("old,new,writer", list(itertools.product([FREE, READY, RUNNING, FINISHED, 7],
                                                                  [FREE, READY, RUNNING, FINISHED, 7], [AGENT, GPU])))
def test_state_machine_allows_exactly_the_documented_transitions(old, new, writer):
    if (old, new, writer) in LEGAL:
        check_transition(old, new, writer)
    else:
        with pytest.raises(IllegalTransition):
            check_transition(old, new, writer)
