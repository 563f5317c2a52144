"""The custom-policy example runs as a user would run it (public API only, no simulator switch set) and passes its
own check against a host-side sort."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_custom_policy_example_admits_shortest_prompt_first():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_policy.py")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished in this order (prompt lengths): [2, 5, 9, 17, 30]" in done.stdout
