"""blink.process: CPU priorities of the host's processes (the engine process itself runs end to end in
tests/nic/openai/test_server.py)."""
import os
import subprocess
import sys


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def raising_priority_is_permitted() -> bool:
    return run_python("import os; os.setpriority(os.PRIO_PROCESS, 0, -10)").returncode == 0


def test_agent_priority_is_applied_or_refused_with_a_clear_error():
    high = run_python("import os; from blink.process import set_priority; set_priority('high'); "
                      "print(os.getpriority(os.PRIO_PROCESS, 0))")
    realtime = run_python("import os; from blink.process import set_priority; set_priority('realtime'); "
                          "print(os.sched_getscheduler(0) == os.SCHED_RR)")
    if raising_priority_is_permitted():
        assert (high.returncode, high.stdout) == (0, "-10\n"), high.stderr
        assert (realtime.returncode, realtime.stdout) == (0, "True\n"), realtime.stderr
    else:
        assert high.returncode == 1 and "--agent-priority high: not permitted" in high.stderr
    # An unprivileged user may not raise its priority: one line that says what to do, no traceback.
    unprivileged = "os.setgid(65534); os.setuid(65534); " if os.geteuid() == 0 else ""
    denied = run_python(f"import os; from blink.process import set_priority; {unprivileged}"
                        "set_priority('realtime')")
    assert denied.returncode == 1 and "Traceback" not in denied.stderr
    assert "--agent-priority realtime: not permitted" in denied.stderr
    assert "Use --agent-priority normal." in denied.stderr
