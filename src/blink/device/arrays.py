"""The arrays of one scheduler, host side: the ring's fields of ``SchedulerArrays`` as views of a ring region
(``ring_arrays``) and a fresh scheduler state in numpy (``state_arrays``), which the CPU simulator runs on as they
are and the GPU scheduler copies to device memory."""
from __future__ import annotations

import numpy as np

from blink.device.config import MAX_EOS, SchedulerConfig
from blink.device.state import (CFG_DTYPE, CONTROL_RECORD, HEADER_RECORD, IDLE, SCHED_DTYPE,
                                SCRATCH_CLEAR, STATS_DTYPE, table_entries)
from blink.device.step import StepLayout
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS, RingGeometry
from blink.ring.grammar import mask_words
from blink.ring.layout import RingView


def ring_arrays(view: RingView) -> dict[str, np.ndarray]:
    """The ring fields of ``SchedulerArrays`` as numpy views of the ring region."""
    n = view.headers.shape[0]
    logprobs = view.logprobs if view.logprobs is not None else np.zeros((n, 1), np.float32)
    prefix_keys = view.prefix_keys if view.prefix_keys is not None else np.zeros((n, 1), np.uint64)
    stops = view.stop_token_ids if view.stop_token_ids is not None else np.zeros((n, 1), np.int32)
    bias, top = (np.zeros((n, 2), np.int32) if pairs is None else pairs.view(np.int32).reshape(n, -1)
                 for pairs in (view.logit_bias, view.top_logprobs))
    return dict(control=view.control.view(CONTROL_RECORD), state=view.status["state"],
                epoch=view.status["epoch"], cancel=view.status["cancel"], finish=view.status["finish_reason"],
                ngen=view.status["n_generated"], headers=view.headers.view(HEADER_RECORD), stop_token_ids=stops,
                prompts=view.prompts, prefix_keys=prefix_keys, outputs=view.outputs, logprobs=logprobs, bias_i32=bias,
                bias_f32=bias.view(np.float32), top_i32=top, top_f32=top.view(np.float32),
                grammars=view.grammars if view.grammars is not None else np.zeros(1, np.int32))


def zero_history(config: SchedulerConfig) -> np.ndarray:
    """A token history of the scheduler's own, zeroed, one int32 per KV position (``SchedulerArrays.history_tokens``),
    for a step that does not bring the model's (``TokenHistory.tokens``): the stand-in's."""
    return np.zeros(config.num_pages * config.page_size, np.int32)


def check_history(config: SchedulerConfig, tokens: int) -> None:
    """``ValueError`` unless a token history of ``tokens`` entries has one for every KV position of ``config``."""
    if tokens < config.num_pages * config.page_size:
        raise ValueError(f"the token history holds {tokens} tokens, fewer than the {config.num_pages} x "
                         f"{config.page_size} KV positions of SchedulerConfig(num_pages, page_size): allocate it "
                         "for the same pool (TokenHistory.allocate(num_pages, page_size, ...))")


def check_prefix_ring(config: SchedulerConfig, geometry: RingGeometry) -> None:
    """``ValueError`` unless the ring carries prompt keys exactly when the scheduler caches prefixes, for its pages."""
    want = config.page_size if config.enable_prefix_caching else 0
    if geometry.prefix_page_size != want:
        raise ValueError(
            f"the ring's prefix_page_size is {geometry.prefix_page_size}, but SchedulerConfig(enable_prefix_caching="
            f"{config.enable_prefix_caching}, page_size={config.page_size}) needs {want}: build the ring with "
            f"RingGeometry(prefix_page_size={want}) (0: the agent hashes no prompt), or change the scheduler's")


def state_arrays(config: SchedulerConfig, geometry: RingGeometry, step: StepLayout,
                 prefix_seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh scheduler state for a ring of ``geometry`` whose keys have ``prefix_seed``: every page free, nothing
    running, nothing cached."""
    if step.max_num_seqs < config.max_num_seqs or step.max_num_batched_tokens < config.buckets[-1]:
        raise ValueError(f"StepLayout {step} is smaller than SchedulerConfig needs (max_num_seqs "
                         f"{config.max_num_seqs}, largest bucket {config.buckets[-1]})")
    if step.max_pages_per_seq < config.max_pages_per_seq:
        raise ValueError(f"StepLayout.max_pages_per_seq {step.max_pages_per_seq} < {config.max_pages_per_seq} "
                         "(max_model_len / page_size)")
    for name in ("max_logit_bias", "max_top_logprobs"):
        if getattr(step, name) < getattr(geometry, name):
            raise ValueError(f"StepLayout.{name} {getattr(step, name)} < the ring's {getattr(geometry, name)}")
    check_prefix_ring(config, geometry)
    spec = config.speculative
    cfg = filled(CFG_DTYPE, page_size=config.page_size, token_budget=config.max_num_batched_tokens,
                 max_num_seqs=config.max_num_seqs, n_buckets=len(config.buckets), n_eos=len(config.eos_token_ids),
                 watermark=config.watermark_pages, max_model_len=config.max_model_len, logprobs=int(geometry.logprobs),
                 max_stop=geometry.max_stop_ids, prefix_caching=int(config.enable_prefix_caching),
                 max_logit_bias=geometry.max_logit_bias, max_top_logprobs=geometry.max_top_logprobs,
                 grammar_words=geometry.max_grammar_bytes // 4, mask_words=mask_words(geometry.vocab_size),
                 **({} if spec is None else dict(spec_tokens=spec.num_speculative_tokens,
                                                 spec_min=spec.prompt_lookup_min, spec_max=spec.prompt_lookup_max,
                                                 disable_by_batch_size=spec.disable_by_batch_size or 0)))
    eos = np.zeros(MAX_EOS, np.int32)
    eos[:len(config.eos_token_ids)] = config.eos_token_ids
    n, pages, seqs = geometry.n_slots, config.num_pages, config.max_num_seqs
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    u64 = lambda *shape: np.zeros(shape, np.uint64)  # noqa: E731
    return dict(
        sched=filled(SCHED_DTYPE, free_top=config.num_pages, bucket=IDLE),
        stats=filled(STATS_DTYPE, prefix_seed=prefix_seed), cfg=cfg, buckets=np.array(config.buckets, np.int32),
        eos_ids=eos,
        free_pages=np.arange(pages, dtype=np.int32), seq_pages=i32(n, config.max_pages_per_seq), seq_npages=i32(n),
        seq_computed=i32(n), seq_total=i32(n), seq_prompt_len=i32(n), seq_max_tokens=i32(n), seq_flags=i32(n),
        seq_last=i32(n), seq_version=i32(n), seq_finish=i32(n), seq_top_k=i32(n), seq_n_stop=i32(n),
        seq_stop=i32(n, max(geometry.max_stop_ids, 1)), seq_temperature=np.zeros(n, np.float32),
        seq_top_p=np.ones(n, np.float32), seq_seed=np.zeros(n, np.int64),
        seq_penalties=np.tile(np.float32([0, 0, 1]), (n, 1)), seq_min_p=np.zeros(n, np.float32),
        seq_top_logprobs=i32(n), seq_n_logit_bias=i32(n), seq_bias_ids=i32(n, max(geometry.max_logit_bias, 1)),
        seq_bias=np.zeros((n, max(geometry.max_logit_bias, 1)), np.float32),
        seq_grammar=np.full(n, -1, np.int32), seq_num_speculative_tokens=i32(n),
        seq_draft=i32(n, MAX_SPECULATIVE_TOKENS), seq_ndraft=i32(n),
        seq_keys=u64(n, config.max_pages_per_seq),
        seq_hash=u64(n), seq_seen=i32(n), queue_slots=i32(n), queue_keys=np.zeros(n, np.int64),
        queue_tmp_slots=i32(n), queue_tmp_keys=np.zeros(n, np.int64), running=i32(seqs), consumed=i32(seqs),
        pending_finished=i32(n),
        row_slot=np.full(seqs, -1, np.int32), row_version=i32(seqs), row_pages=i32(seqs), row_draft=i32(seqs),
        page_ref=i32(pages), page_cached=i32(pages), page_key=u64(pages), page_lru=np.full(pages, -1, np.int32),
        page_scratch=np.full(pages, SCRATCH_CLEAR, np.int32), lru_pages=i32(2 * pages),
        table_keys=u64(table_entries(pages)), table_pages=np.full(table_entries(pages), -1, np.int32),
        grammar_mirror=i32(max(geometry.max_grammar_bytes // 4, 1)))


def filled(dtype: np.dtype, **fields) -> np.ndarray:
    """A one-element array of record ``dtype``: ``fields`` by name, every other field 0."""
    array = np.zeros(1, dtype)
    for name, value in fields.items():
        array[0][name] = value
    return array


def control_gauges(control: np.ndarray, config: SchedulerConfig) -> None:
    """Host, before the first iteration: gauges that never change (``control``: the ring's control block)."""
    control["kv_pages_total"] = config.num_pages
    control["kv_pages_free"] = config.num_pages
    control["num_speculative_tokens"] = config.speculative.num_speculative_tokens if config.speculative else 0
