"""blink.config.EngineConfig: every validation rule names its field; the model length and the ring derived from it;
policies given as functions or import paths."""
import pytest

import blink.config
from blink.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, SchedulerConfig, load_policy


@pytest.mark.parametrize("field,value,rule", [
    ("model", "", "None .the embedded default model. or a model directory"), ("load_format", "pt", "one of"),
    ("device", "tpu", r"one of \('auto', 'cpu', 'cuda'\)"), ("dtype", "int8", "None or one of"),
    ("scheduler", {"max_num_seqs": 8}, "a SchedulerConfig"), ("policy", 3, "None, a function or 'module:function'"),
    ("n_slots", 0, r"an int in \[1, 1048576\]"), ("max_stop_ids", 65, r"an int in \[0, 64\]"),
    ("max_prompt_tokens", 0, r"an int in \[1, 16777216\]"), ("max_output_tokens", 2**25, r"an int in \[1, 16777216\]"),
    ("sim_threads", 0, r"an int in 1\.\.1024"), ("sim_threads", 1025, r"an int in 1\.\.1024"),
    ("gpu_memory_utilization", 1.5, r"a float in \(0, 1\]"),
    ("gpu_memory_utilization", 1, r"a float in \(0, 1\]"), ("cpu_kv_cache_gib", 0, "a finite number > 0"),
    ("cpu_kv_cache_gib", True, "a finite number > 0"), ("cpu_kv_cache_gib", float("inf"), "a finite number > 0"),
    ("logprobs", 1, "a bool"), ("ring_name", "a/b", "None .an in-process"),
    ("ring_name", "", "None .an in-process"), ("ring_name", "..", "None .an in-process"),
    ("ring_name", "a\x00b", "None .an in-process"), ("ring_name", "r" * 256, "None .an in-process"),
    ("tensor_parallel_size", 0, r"an int in 1\.\.64"),
    ("tensor_parallel_size", 2.0, r"an int in 1\.\.64"), ("tensor_parallel_size", True, r"an int in 1\.\.64"),
    ("request_side", "gpu", r"one of \('host', 'device'\)"), ("quantization", "int8", r"None or one of \('fp8',\)"),
    ("kv_cache_dtype", "fp8_e5m2", r"one of \('auto', 'fp8'\)"),
])
def test_every_rule_names_the_field(field, value, rule):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be {rule}"):
        EngineConfig(**{field: value})


def test_fp8_is_named_as_the_models_name_it_and_split_over_ranks_too():
    from blink.models.quantization import QUANTIZATIONS

    assert QUANTIZATIONS == blink.config.QUANTIZATIONS  # written twice: the engine's config imports no torch
    config = EngineConfig(quantization="fp8", kv_cache_dtype="fp8", tensor_parallel_size=2)
    assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")


def test_the_model_length_defaults_to_the_context_capped_by_the_default_and_the_ring():
    assert EngineConfig().max_model_len(8192) == DEFAULT_MAX_MODEL_LEN
    assert EngineConfig().max_model_len(1024) == 1024
    assert EngineConfig(max_prompt_tokens=64, max_output_tokens=16).max_model_len(8192) == 80
    assert EngineConfig(max_prompt_tokens=64).max_model_len(8192) == DEFAULT_MAX_MODEL_LEN
    assert EngineConfig(scheduler=SchedulerConfig(max_model_len=6000)).max_model_len(8192) == 6000
    with pytest.raises(ValueError, match=r"max_model_len=9000 is longer than the model's context"):
        EngineConfig(scheduler=SchedulerConfig(max_model_len=9000)).max_model_len(8192)
    with pytest.raises(ValueError, match="leaves no room to generate"):
        EngineConfig(scheduler=SchedulerConfig(max_model_len=1)).max_model_len(8192)


def test_the_ring_is_derived_from_the_model_length_unless_given():
    geometry = EngineConfig(n_slots=32).geometry(2048)
    assert (geometry.n_slots, geometry.max_prompt_tokens, geometry.max_output_tokens) == (32, 2047, 2047)
    geometry = EngineConfig(max_prompt_tokens=100, max_output_tokens=10, max_stop_ids=2, logprobs=False).geometry(2048)
    assert (geometry.max_prompt_tokens, geometry.max_output_tokens, geometry.max_stop_ids) == (100, 10, 2)
    assert geometry.logprobs is False
    assert geometry.prefix_page_size == 16, "the agent hashes prompt pages for the prefix cache (on by default)"
    no_cache = EngineConfig(scheduler=SchedulerConfig(page_size=32, enable_prefix_caching=False)).geometry(2048)
    assert no_cache.prefix_page_size == 0
    assert EngineConfig(scheduler=SchedulerConfig(page_size=32)).geometry(2048).prefix_page_size == 32
    with pytest.raises(ValueError, match="max_prompt_tokens=2048 leaves no room to generate in sequences of "
                                         "max_model_len=2048"):
        EngineConfig(max_prompt_tokens=2048).geometry(2048)


def test_policies_load_from_functions_and_import_paths():
    from blink.device.policy import by_priority, fcfs

    assert load_policy(None) is fcfs
    assert load_policy("blink.device.policy:by_priority") is by_priority
    plain = load_policy(lambda arrival_ns, prompt_len, max_tokens, priority, request_id: prompt_len)
    assert hasattr(plain, "py_func")
    for bad, message in [("blink.device.policy", "must look like 'package.module:function'"),
                         ("no_such_module_here:f", "cannot import the policy module"),
                         ("blink.device.policy:nothing", "has no 'nothing'"),
                         ("os:getcwd", "must be a function of the request's arrival_ns, prompt_len, max_tokens, "
                                       "priority, request_id"),
                         (lambda a: a, "must be a function of the request's")]:
        with pytest.raises(ValueError, match=message):
            load_policy(bad)
