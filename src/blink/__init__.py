"""blink: LLM serving with no host CPU on the steady-state path."""

__version__ = "0.1.0"
