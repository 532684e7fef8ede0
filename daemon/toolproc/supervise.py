"""The supervisor of one bash tool call: `python -I -S supervise.py ARGV...` (Linux),
where ARGV is `bash -c COMMAND`, or bubblewrap running it (daemon/toolproc/sandbox.py).

It is a separate, tiny process (standard library only, run without site) so that the
daemon never adopts anybody's orphans:

1. It becomes a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): a process the
   command started that outlives its parent — a background job once bash is gone, a
   `setsid` child, a daemon that double-forked — is reparented to this process instead
   of to init, so it is still within reach.
2. It runs ARGV in a process group of its own (bash's `$$` is its pgid) with the
   inherited stdin/stdout/stderr and environment; it gets SIGKILL should this process die
   (`PR_SET_PDEATHSIG`, which is safe here: this process forks from its only thread).
3. It waits for bash to exit — not for the pipes to close, which a background job may
   hold for ever — or for SIGTERM/SIGINT/SIGHUP (the daemon's cancel or timeout), or
   for the daemon to die: a thread waits on a pidfd of the daemon (readable the moment
   the daemon process is gone, also after a SIGKILL) and interrupts the wait at once;
   where pidfds are missing a timer checks every second that its parent is still the
   daemon. (PDEATHSIG cannot do that: the daemon starts processes from a worker
   thread, and the signal fires when *that thread* ends.)
4. Then it kills every descendant: SIGKILL to bash's group and to each child it has
   (bash, adopted orphans), reap, and again — a killed process's children are
   reparented to it — until it has no child left.
5. It exits with bash's status (128+N when signal N ended bash).

Without prctl (not Linux) step 1 is skipped: what bash's group and this process's own
children hold is still killed, but a `setsid` grandchild whose parent died escapes.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM)
PARENT_CHECK_S = 1.0


class _Stop(Exception):
    """The daemon asked us to stop (cancel, timeout, its own death)."""


def _watch(daemon: int) -> None:
    """Stop on SIGTERM/SIGINT/SIGHUP, and on the timer's SIGALRM once the daemon is gone
    (this process was reparented)."""

    def on_signal(signum: int, frame: object) -> None:
        if signum != signal.SIGALRM or os.getppid() != daemon:
            raise _Stop

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    signal.setitimer(signal.ITIMER_REAL, PARENT_CHECK_S, PARENT_CHECK_S)


def _watch_pidfd(daemon: int) -> None:
    """Interrupt the main thread (SIGTERM: `_Stop`) the moment the daemon process ends
    (CONTRACT §18: no tool outlives its daemon). Started after the fork."""
    try:
        fd = os.pidfd_open(daemon)
    except (AttributeError, OSError):
        return  # the timer's check remains
    if os.getppid() != daemon:  # gone before the pidfd was opened
        os.kill(os.getpid(), signal.SIGTERM)
        return
    main = threading.main_thread().ident
    assert main is not None

    def wait() -> None:
        select.select([fd], [], [])
        signal.pthread_kill(main, signal.SIGTERM)

    threading.Thread(target=wait, daemon=True).start()


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _children(me: int) -> list[int]:
    """Pids whose parent is `me` (zombies included)."""
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:  # CONFIG_PROC_CHILDREN
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.append(int(entry))
    return found


def _sweep(bash: int | None, status: int | None) -> int | None:
    """Kill and reap every descendant; returns bash's wait status if we reaped it."""
    me = os.getpid()
    if bash is not None:
        try:
            os.killpg(bash, signal.SIGKILL)  # bash's own group: its ordinary children
        except OSError:
            pass
    while True:
        for pid in _children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, got = os.waitpid(-1, 0)  # its children are ours before it is reaped
        except ChildProcessError:
            return status
        if pid == bash and status is None:
            status = got


def _exit_code(status: int | None) -> int:
    if status is None:
        return 128 + signal.SIGKILL
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _exec_child(argv: list[str]) -> None:
    """In the forked child: ARGV in its own group, killed if the supervisor dies."""
    try:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        os.setpgid(0, 0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.execvp(argv[0], argv)
    except BaseException as exc:  # the child must never return to the caller
        os.write(2, f"veild: cannot run {argv[0]}: {exc}\n".encode())
    os._exit(127)


def main() -> int:
    argv = sys.argv[1:]
    daemon = os.getppid()
    _watch(daemon)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    bash: int | None = None
    status: int | None = None
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            bash = os.fork()
            if bash == 0:
                _exec_child(argv)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        _watch_pidfd(daemon)
        while status is None:
            pid, got = os.waitpid(-1, 0)  # adopted orphans that end are reaped here
            if pid == bash:
                status = got
    except (_Stop, ChildProcessError):
        pass
    while True:  # from here on nothing interrupts the sweep
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            signal.setitimer(signal.ITIMER_REAL, 0)
            break
        except _Stop:
            continue
    return _exit_code(_sweep(bash, status))


if __name__ == "__main__":
    sys.exit(main())
