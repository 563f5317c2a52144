"""CPU time per token: a server's as all of its processes spend it, read from ``/proc`` (its /metrics may count one
process only: vLLM's ``process_cpu_seconds_total`` is its API server's, not its engine core's, where its scheduler
and structured-output masks run; blink's counts its agent processes, not the engine), and per 1,000 output tokens."""
from __future__ import annotations

import os

# Fields of /proc/PID/stat after the command name's closing parenthesis (state is field 3 of proc(5)): the parent,
# then user and system time of the process and of its children it has waited for, in clock ticks.
PPID, TIMES = 1, slice(11, 15)


def _stat_fields() -> dict[int, list[str]]:
    fields = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:             # it exited while we listed
                continue
            fields[int(entry)] = stat[stat.rindex(")") + 2:].split()
    return fields


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` and of every live process under it, with what the children
    they waited for used. A process of the tree that exits unreaped between two readings takes its time with it, so
    a difference of two readings is a lower bound. ValueError if ``pid`` is not running (Linux only)."""
    fields = _stat_fields()
    if pid not in fields:
        raise ValueError(f"no process {pid} is running: --server-pid names the server's process (the one `blink serve` "
                         "or `vllm serve` started; its children are counted with it)")
    children: dict[int, list[int]] = {}
    for child, stat in fields.items():
        children.setdefault(int(stat[PPID]), []).append(child)
    tree, ticks = [pid], 0
    while tree:
        process = tree.pop()
        ticks += sum(int(t) for t in fields[process][TIMES])
        tree += children.get(process, [])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_per_1k_tokens(server_s: float | None, client_s: float, tokens: int) -> dict:
    """CPU seconds of the server over a run (None where it does not say) and of this process, per 1,000 output
    tokens, in ms."""
    per_1k = (lambda seconds: seconds / tokens * 1e6) if tokens else (lambda seconds: None)
    return {"server_cpu_s": server_s, "server_cpu_ms_per_1k_tokens": None if server_s is None else per_1k(server_s),
            "client_cpu_ms_per_1k_tokens": per_1k(client_s)}
