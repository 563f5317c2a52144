"""The engine's and the agent's placement on the host: the engine in a process of its own (``process``), the agent's
core (``cores``), its CPU priority (``priority``) and its core reserved from every other process (``partition``)."""
