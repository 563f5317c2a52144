"""The NIC↔GPU contract that both sides import: the ring's geometry, layout and control block, what a request
carries, the transports that reach the ring, the reference consumer and the stand-in model. Imports nothing else of
blink (docs/architecture.md, "Layers")."""
