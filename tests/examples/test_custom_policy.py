"""The custom-policy example runs as a user would run it and passes its own check against a host-side sort."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_custom_policy_example_admits_shortest_prompt_first():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_policy.py")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "admission order (prompt lengths): [2, 5, 5, 9, 17, 30]" in done.stdout
