"""Subprocesses without CAP_SYS_NICE, to test what an unprivileged agent or client does. As root the capability is
dropped from the bounding set before exec, so the program never gets it but stays root in every other way (it reads
the interpreter's library and the model cache as before); any other user has no capability to drop."""
import ctypes
import os
import subprocess
import sys

PR_CAPBSET_DROP, CAP_SYS_NICE = 24, 23


def drop_cap_sys_nice() -> None:
    """A ``preexec_fn``: the exec'd program runs without CAP_SYS_NICE."""
    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_NICE) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_SYS_NICE) failed")


def run_python(code: str, *, unprivileged: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -c code``, without CAP_SYS_NICE if ``unprivileged``."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=drop_cap_sys_nice if unprivileged else None)


def may_raise_priority(*, unprivileged: bool = False) -> bool:
    return run_python("import os; os.setpriority(os.PRIO_PROCESS, 0, -10)", unprivileged=unprivileged).returncode == 0
