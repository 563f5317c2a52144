"""Short soaks in CI (tests/soak.py: mixed requests through the HTTP server, then every invariant): over the stand-in
engine, and over the real CPU engine with steps made longer than the agent's liveness timeout on purpose; the full
ones are reported in docs/reliability.md."""
from tests import soak


def test_a_short_soak_keeps_every_invariant():
    result = soak.run(requests=1500, concurrency=48, seed=1)
    result.check()
    kinds = {kind for kind, outcome in result.outcomes if outcome in ("ok", "4xx", "cancelled")}
    assert kinds == set(soak.KINDS), "every kind of request was served or refused as it should"


def test_long_steps_of_the_cpu_engine_lose_no_request():
    """Regression (issue 38, item 3: 507 of 7,201 valid requests of a soak got a false "engine dead" 503 after steps
    longer than the liveness timeout). Every 8th step sleeps 4 s, past the agent's 3 s liveness timeout: not 1 s, which
    a loaded 2-core CI host can keep the engine process's tick thread off the CPU for (a 600-request soak at load
    4-13 lost its first 64 requests to "has not ticked for 1.0 s"; docs/reliability.md)."""
    engine = soak.CpuEngine(slow_every=8, slow_s=4.0, liveness_timeout_s=3.0)
    result = soak.run(requests=100, concurrency=64, seed=2, engine=engine)
    result.check()
    assert result.steps >= 3 * engine.slow_every, f"only {result.steps} steps: too few long ones to test anything"
