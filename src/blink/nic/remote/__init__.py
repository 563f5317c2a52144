"""The transports by which an agent reaches an engine's ring on another host or GPU: the setup handshake (``wire``,
``regions``, ``proof``, ``handshake``), RDMA (``verbs``, ``ibverbs``, ``recording``, ``rdma``), CUDA IPC (``ipc``),
the engine's ring as it exports it (``segments``), and both ends put together (``attach``: the agent's
``open_remote``, the engine's ``RingListener``). Imports nothing of blink but the ring and the errors."""
