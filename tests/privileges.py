"""Subprocesses with fewer rights than the test: without CAP_SYS_NICE, to test what an unprivileged agent or client
does (as root the capability is dropped from the bounding set before exec, so the program never gets it but stays root
in every other way; any other user has no capability to drop); and as a second local user, to test what another
user of the host can do to a server."""
import ctypes
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

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


# -- a second local user ----------------------------------------------------------------------------------------------
# The interpreter every user may run (the test's own may sit in root's home, which no other user can enter).
SYSTEM_PYTHON = "/usr/bin/python3"


def unused_uid() -> int:
    """A uid (and gid of the same number) that no account, group or process on this host has: a second local user
    for the test alone, nothing to clean up in /etc."""
    import grp
    import pwd

    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            taken.add(os.stat(f"/proc/{pid}").st_uid)
        except FileNotFoundError:
            pass        # it exited meanwhile
    return next(uid for uid in range(61_000, 65_000) if uid not in taken)


def second_user_reason() -> str | None:
    """Why this process cannot run code as a second user (None: it can)."""
    if os.geteuid() != 0:
        return "needs root, to run the other local user's code under a uid of its own (setuid)"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"needs {SYSTEM_PYTHON}, an interpreter the second user may run"
    return None


def run_as(uid: int, code: str, *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """``python3 -c code`` (the standard library only) as user ``uid`` (gid ``uid``, no supplementary groups): the
    kernel checks its every access as another local user's."""
    def become():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    return subprocess.run([SYSTEM_PYTHON, "-I", "-c", code], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=become, cwd="/", env={"PATH": "/usr/bin:/bin"}, **kwargs)


@contextmanager
def shared_dir():
    """A fresh directory (mode 1777, in /tmp) that a second user may reach, removed with all in it afterwards;
    the test is skipped, saying why, where no second user can be run."""
    import shutil
    import tempfile
    from pathlib import Path

    reason = second_user_reason()
    if reason:
        pytest.skip(reason)
    path = Path(tempfile.mkdtemp(prefix="blink-second-user-", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path)
