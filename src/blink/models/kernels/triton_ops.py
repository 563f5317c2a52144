"""The CUDA implementations, under the names ``reference`` uses (see ``ops_for``)."""
from .activation import silu_and_mul
from .attention import attention, attention_plan
from .kv_write import kv_write
from .norm import rms_norm
from .rope import rope
from .sampling import gumbel_argmax

__all__ = ["attention", "attention_plan", "gumbel_argmax", "kv_write", "rms_norm", "rope", "silu_and_mul"]
