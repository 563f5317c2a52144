"""``blink bench``: serving benchmarks against any OpenAI-compatible endpoint, or transformers' continuous batching.

``datasets`` makes the requests, ``traffic`` sends them at their arrival times, ``client`` / ``peer`` are the two
backends, ``metrics`` turns what came back into vLLM's numbers (``vllm bench serve`` vocabulary), ``interference``,
``energy`` and ``plots`` are what a run adds around them; ``serve`` is the command.
"""
