"""The CUDA implementations, under the names ``reference`` uses (see ``ops_for``)."""
from .activation import silu_and_mul
from .attention import attention, attention_plan
from .bias import apply_logit_bias
from .fp8 import fp8_linear, fp8_takes_e4m3
from .grammar import apply_grammar
from .history import record_tokens
from .linear import linear
from .moe import fused_moe
from .norm import rms_norm
from .penalties import apply_penalties
from .rope_kv_write import rope_kv_write
from .sampling import candidate_threshold, gumbel_argmax, row_logsumexp, sampling_params, store_sampled
from .top_candidates import top_candidates

__all__ = ["apply_grammar", "apply_logit_bias", "apply_penalties", "attention", "attention_plan", "candidate_threshold",
           "fp8_linear", "fp8_takes_e4m3", "fused_moe", "gumbel_argmax", "linear", "rms_norm", "rope_kv_write",
           "record_tokens", "row_logsumexp", "sampling_params", "silu_and_mul", "store_sampled", "top_candidates"]
