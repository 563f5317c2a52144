"""A short soak in CI (tests/soak.py: mixed requests through the HTTP server over the stand-in engine, then every
invariant); the full one (10^5 requests) is reported in docs/reliability.md."""
from tests import soak


def test_a_short_soak_keeps_every_invariant():
    result = soak.run(requests=1500, concurrency=48, seed=1)
    result.check()
    kinds = {kind for kind, outcome in result.outcomes if outcome in ("ok", "4xx", "cancelled")}
    assert kinds == set(soak.KINDS), "every kind of request was served or refused as it should"
