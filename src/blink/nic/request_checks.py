"""One request against one ring's limits, before the agent claims a slot for it: ``checked_prompt`` names the field
that breaks them (``RequestError``, a ``ValueError``) or returns the prompt as the ring stores it."""
from __future__ import annotations

import numpy as np

from blink.errors import RequestError
from blink.nic.grammar_table import GrammarTable
from blink.ring.geometry import RingGeometry
from blink.ring.request import SamplingParams


def checked_prompt(geometry: RingGeometry, grammars: GrammarTable, prompt_tokens, params: SamplingParams) -> np.ndarray:
    """The prompt as the ring stores it (int32); ``RequestError`` naming the field that breaks ``geometry``'s limits
    (a grammar: ``grammars``, the agent's table, says whether it could ever be placed)."""
    g = geometry
    if not isinstance(params, SamplingParams):
        raise RequestError("params", f"params must be a SamplingParams (got {type(params).__name__})")
    try:
        prompt = np.asarray(prompt_tokens)
    except Exception as e:
        raise RequestError("prompt_tokens", f"prompt_tokens must be a sequence of token ids ({e})") from None
    if prompt.ndim != 1 or prompt.size == 0 or not (np.issubdtype(prompt.dtype, np.integer)):
        raise RequestError("prompt_tokens", "prompt_tokens must be a non-empty 1-D sequence of int token ids "
                                            f"(got shape {prompt.shape}, dtype {prompt.dtype})")
    checks = [
        (prompt.size <= g.max_prompt_tokens, "prompt_tokens",
         f"prompt_tokens has {prompt.size} tokens; this ring's slots hold at most {g.max_prompt_tokens} "
         "(RingGeometry.max_prompt_tokens)"),
        (prompt.min() >= 0 and prompt.max() < 2**31, "prompt_tokens", "prompt_tokens must be token ids in [0, 2**31)"),
        (params.max_tokens <= g.max_output_tokens, "max_tokens",
         f"max_tokens={params.max_tokens} is above this ring's output capacity {g.max_output_tokens} "
         "(RingGeometry.max_output_tokens)"),
        (len(params.stop_token_ids) <= g.max_stop_ids, "stop_token_ids",
         f"stop_token_ids has {len(params.stop_token_ids)} ids; at most {g.max_stop_ids} fit "
         "(RingGeometry.max_stop_ids)"),
        (not params.logprobs or g.logprobs, "logprobs",
         "logprobs=True needs a ring built with RingGeometry(logprobs=True)"),
        (params.top_logprobs <= g.max_top_logprobs, "top_logprobs",
         f"top_logprobs={params.top_logprobs} is above the {g.max_top_logprobs} this ring has room for "
         "(RingGeometry.max_top_logprobs)"),
        (len(params.logit_bias or ()) <= g.max_logit_bias, "logit_bias",
         f"logit_bias has {len(params.logit_bias or ())} tokens; at most {g.max_logit_bias} fit "
         "(RingGeometry.max_logit_bias)"),
        (prompt.size + params.max_tokens <= g.max_model_len, "max_tokens",
         f"the prompt has {prompt.size} tokens and max_tokens={params.max_tokens}, together "
         f"{prompt.size + params.max_tokens} positions, but the engine's max_model_len is {g.max_model_len}: "
         "lower max_tokens or shorten the prompt"),
    ]
    for ok, field, message in checks:
        if not ok:
            raise RequestError(field, message)
    if params.grammar is not None:
        grammars.check(params.grammar)
    return prompt.astype("<i4")
