"""Helpers about processes, for test modules of any kind: this module imports only the standard library, so GPU test
modules may use it (the GPU image lacks the client packages the server tests import)."""
import os


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:     # the field after state is the ppid
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            pass    # it ended meanwhile
    return found
