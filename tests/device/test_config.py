"""blink.device.config.SchedulerConfig: every validation rule names its field, the default buckets, and resolving
the sizes the engine decides at start-up."""
import pytest

from blink.device.config import MAX_BUCKETS, MAX_EOS, MAX_SEQS, SchedulerConfig, graded_buckets

RESOLVED = dict(num_pages=64, max_model_len=64, page_size=16)


@pytest.mark.parametrize("field,value,rule", [
    ("max_num_seqs", 0, r"an int in \[1, 2\*\*31\)"), ("max_num_seqs", 2.0, r"an int in \[1, 2\*\*31\)"),
    ("max_num_seqs", MAX_SEQS + 1, f"<= {MAX_SEQS}"), ("max_num_batched_tokens", 0, r"an int in \[1, 2\*\*31\)"),
    ("max_num_batched_tokens", 10**30, r"an int in \[1, 2\*\*31\)"),     # checked before buckets derive from it
    ("page_size", True, r"an int in \[1, 2\*\*31\)"), ("page_size", 2**31, r"an int in \[1, 2\*\*31\)"),
    ("block_threads", 0, r"an int in \[1, 2\*\*31\)"), ("block_threads", 1025, "<= 1024"),
    ("buckets", (1, 2**31), r"a non-empty strictly increasing tuple of at most \d+ ints in \[1, 2\*\*31\)"),
    ("num_pages", 0, "None .decided at start-up. or an int"), ("max_model_len", 2**31, "None .decided at start-up."),
    ("buckets", (), "a non-empty strictly increasing tuple"), ("buckets", (4, 2, 2048), "a non-empty strictly"),
    ("buckets", [1, 2048], "a non-empty strictly increasing tuple"),
    ("buckets", tuple(range(1, MAX_BUCKETS + 1)) + (2048,), f"a non-empty strictly increasing tuple of at most "
                                                          f"{MAX_BUCKETS} ints"),
    ("eos_token_ids", tuple(range(MAX_EOS + 1)), f"a tuple of at most {MAX_EOS} token ids"),
    ("eos_token_ids", (-1,), "a tuple of at most"), ("eos_token_ids", [2], "a tuple of at most"),
    ("watermark_pages", -1, "an int >= 0"), ("watermark_pages", 64, r"an int in \[0, num_pages\)"),
    ("idle_sleep_ns", -1, r"an int in \[0, 1000000\]"),
    ("idle_sleep_ns", 10**7, r"an int in \[0, 1000000\]"), ("launch_mode", "eager", "one of"),
    ("enable_prefix_caching", 1, "a bool"),
])
def test_every_rule_names_the_field(field, value, rule):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field} must be {rule}"):
        SchedulerConfig(**{**RESOLVED, field: value})


def test_the_token_budget_fits_the_largest_bucket():
    with pytest.raises(ValueError, match="SchedulerConfig.max_num_batched_tokens must be <= the largest bucket 2048"):
        SchedulerConfig(max_num_batched_tokens=4096, buckets=(1, 2048))


def test_every_running_sequence_must_be_able_to_decode_in_one_step():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= max_num_seqs \(64\)"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_a_resolved_pool_must_hold_one_longest_sequence_above_the_watermark():
    with pytest.raises(ValueError, match=r"SchedulerConfig.num_pages must be >= watermark_pages \+ 4"):
        SchedulerConfig(num_pages=5, max_model_len=64, page_size=16, watermark_pages=2)
    assert SchedulerConfig(num_pages=6, max_model_len=64, page_size=16, watermark_pages=2).max_pages_per_seq == 4


def test_default_buckets_pad_a_step_by_at_most_a_quarter_or_eight_rows():
    assert SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8).buckets == (
        1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    buckets = SchedulerConfig().buckets
    assert buckets == graded_buckets(2048) and len(buckets) <= MAX_BUCKETS and buckets[-1] == 2048
    for tokens in range(9, 2049):
        padded = min(b for b in buckets if b >= tokens)
        assert padded - tokens < max(8, tokens / 4), tokens
    assert SchedulerConfig(buckets=(8, 300), max_num_batched_tokens=300, max_num_seqs=8).buckets == (8, 300)


def test_graded_buckets_coarsen_to_fit_the_launch_table():
    for tokens in (1, 3, 9, 2049, 4096, 65536, 2**30):
        buckets = graded_buckets(tokens)
        assert buckets[-1] == tokens and len(buckets) <= MAX_BUCKETS and list(buckets) == sorted(set(buckets))
    assert graded_buckets(4096)[-4:] == (1536, 2048, 3072, 4096)  # two per doubling: four would be 43 graphs
    assert graded_buckets(2**30, per_doubling=1) == tuple(1 << k for k in range(31))


def test_resolve_fills_in_only_what_was_left_to_the_engine():
    left = SchedulerConfig(eos_token_ids=(5,))
    assert not left.resolved
    with pytest.raises(ValueError, match="max_model_len is not resolved"):
        left.max_pages_per_seq
    resolved = left.resolve(num_pages=300, max_model_len=128, eos_token_ids=(2, 5))
    assert resolved.resolved and (resolved.num_pages, resolved.max_model_len) == (300, 128)
    assert resolved.eos_token_ids == (2, 5)
    given = SchedulerConfig(num_pages=40, max_model_len=256).resolve(num_pages=300, max_model_len=128)
    assert (given.num_pages, given.max_model_len) == (40, 256)
    with pytest.raises(ValueError, match="num_pages must be >= watermark_pages"):
        SchedulerConfig().resolve(num_pages=3, max_model_len=128)


def test_speculative_config_takes_vllms_fields_and_names_a_bad_one():
    from blink.device.config import SpeculativeConfig

    given = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                                        '"disable_by_batch_size": 32}')
    assert given == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, disable_by_batch_size=32)
    for text, match in [('{"method": "eagle"}', "SpeculativeConfig.method must be one of"),
                        ('{"num_speculative_tokens": 0}', "SpeculativeConfig.num_speculative_tokens must be"),
                        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 3}', "SpeculativeConfig.prompt_lookup_max"),
                        ('{"disable_by_batch_size": 1}', r"SpeculativeConfig.disable_by_batch_size must be None or an "
                                                         r"int >= 2"),
                        ('{"draft_model": "x"}', r"unknown field\(s\) \['draft_model'\]"),
                        ("[4]", "must be a JSON object"), ("{", "must be a JSON object")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_json(text)
    with pytest.raises(ValueError, match="SchedulerConfig.speculative must be None or a SpeculativeConfig"):
        SchedulerConfig(speculative={"method": "ngram"})
