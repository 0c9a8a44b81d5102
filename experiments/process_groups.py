"""Child processes that end with everything they started.

A campaign step, a preflight kind or an ncu target runs in a session (and process group) of
its own, so that at its timeout the whole group goes (forked gloo ranks, a profiled target),
not only the direct child (run_group, kill_group); a probe that waits on such a group
kills it when it is itself stopped (kill_children_on_sigterm, track_child).
"""

import os
import subprocess

_CHILDREN = []  # the process (group) a probe is waiting on, for kill_children_on_sigterm


def track_child(proc):
    _CHILDREN[:] = [proc]


def kill_children_on_sigterm():
    """On SIGTERM (run_step's first signal at a step's timeout), kill the process group that
    this probe started in a session of its own, then exit."""
    import signal

    def handler(signum, frame):
        for proc in _CHILDREN:
            kill_group(proc, grace_s=0)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def kill_group(proc, grace_s=3.0):
    """End `proc` and every process of its group (it leads a session of its own): SIGTERM,
    up to grace_s seconds, then SIGKILL to whatever of the group is left (forked ranks, a
    profiled target). Elsewhere than POSIX: proc alone."""
    import signal
    if os.name != "posix":
        proc.kill()
        proc.wait()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGTERM and grace_s > 0:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def run_group(argv, timeout, started=None, **kw):
    """Run argv in a session (and process group) of its own, its output captured; at the
    timeout kill the whole group (kill_group), not only the direct child. Returns (returncode,
    or None after a timeout; stdout; stderr)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True, **kw)
    if started:
        started(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or "", err or ""
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:  # what it printed before; a process outside the group may still hold the pipes
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", "(output lost: the pipes stayed open after the kill)"
        return None, out or "", err or ""
