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

Limits (CONTRACT §16.1, daemon/toolproc/limits.py), as options before `--`:
`--memory-mb N --pids N --cpu-s S` with `--cgroup DIR` (make DIR/call-PID with those
limits and put bash there before it runs anything) or without (setrlimit in bash's
process before exec, and a count of the tree from /proc every `LIMIT_CHECK_S`; past a
limit the tree is killed). `--drop-caps` empties bash's capability bounding set (an
unsandboxed call of a root daemon: without CAP_SYS_PTRACE it cannot read the
non-dumpable daemon's /proc/PID/environ). `--report-fd FD`: the limit that ended the
call, if one did, is written there (`memory`, `pids` or `cpu`) before exiting.
`--track DIR` (limits by setrlimit, but a cgroup v2 this process may make children in):
DIR/call-PID is made with no limits, only so that the kernel keeps every descendant in
it — a double-forked one too, whatever happens to this process — and `cgroup.kill` ends
them all at the end; the daemon kills what is left there should this process itself die
(daemon/toolproc/limits.py `kill_call`).

Without prctl (not Linux) step 1 is skipped: what bash's group and this process's own
children hold is still killed, but a `setsid` grandchild whose parent died escapes.
"""

from __future__ import annotations

import ctypes
import os
import select
import sys
import threading

TYPE_CHECKING = False  # not typing's: importing typing costs more than it saves
if TYPE_CHECKING:
    import signal
else:  # `signal` without its enum import: about 7 ms less CPU on every call
    import _signal as signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM)
PARENT_CHECK_S = 1.0
LIMIT_CHECK_S = 0.1
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
MIB = 1 << 20
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


class _Stop(Exception):
    """The daemon asked us to stop (cancel, timeout, its own death)."""


class _Over(_Stop):
    """The call went past a limit (its name: memory, pids, cpu)."""

    def __init__(self, limit: str) -> None:
        super().__init__(limit)
        self.limit = limit


class _Options:
    """The options before `--`, and what the limits need while the call runs."""

    def __init__(self, args: list[str]) -> None:
        self.memory_mb = self.pids = 0
        self.cpu_s = 0.0
        self.cgroup: str | None = None  # the parent directory of the call's cgroup
        self.track_only = False  # `--track`: a cgroup for membership, limits by rlimit
        self.drop_caps = False
        self.report_fd = -1
        while args and args[0].startswith("--"):
            flag = args.pop(0)
            if flag == "--":
                break
            if flag == "--drop-caps":
                self.drop_caps = True
                continue
            value = args.pop(0)
            if flag == "--memory-mb":
                self.memory_mb = int(value)
            elif flag == "--pids":
                self.pids = int(value)
            elif flag == "--cpu-s":
                self.cpu_s = float(value)
            elif flag == "--cgroup":
                self.cgroup = value
            elif flag == "--track":
                self.cgroup, self.track_only = value, True
            elif flag == "--report-fd":
                self.report_fd = int(value)
        self.argv = args
        self.call: str | None = None  # the call's own cgroup, once made

    @property
    def polls(self) -> bool:
        """Whether the tree is counted on a timer: always without a cgroup; with one,
        for the CPU seconds only (cgroup v2 has no CPU-total limit of its own)."""
        if not self.limited:
            return bool(self.memory_mb or self.pids or self.cpu_s)
        return self.cpu_s > 0

    @property
    def limited(self) -> bool:
        """Whether the kernel bounds the call through its cgroup (not `--track`)."""
        return self.call is not None and not self.track_only


def _watch(daemon: int, options: _Options, bash: list[int]) -> None:
    """Stop on SIGTERM/SIGINT/SIGHUP, and on the timer's SIGALRM once the daemon is gone
    (this process was reparented) or the call is past a limit."""
    every = LIMIT_CHECK_S if options.polls else PARENT_CHECK_S
    checks = [0]

    def on_signal(signum: int, frame: object) -> None:
        if signum != signal.SIGALRM:
            raise _Stop
        checks[0] += 1
        if checks[0] * every >= PARENT_CHECK_S:
            checks[0] = 0
            if os.getppid() != daemon:
                raise _Stop
        if options.polls and bash:
            over = _over(options)
            if over:
                raise _Over(over)

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    signal.setitimer(signal.ITIMER_REAL, every, every)


def _tree(me: int) -> list[int]:
    """Every live descendant of `me` (pids), walking each thread's children."""
    found: list[int] = []
    todo = [me]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(p) for p in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _over(options: _Options) -> str | None:
    """The limit the call's tree is past now, if any."""
    if options.limited:  # a cgroup: only the CPU is ours to count
        try:
            with open(f"{options.call}/cpu.stat") as f:
                usec = int(f.readline().split()[1])  # usage_usec
        except (OSError, IndexError, ValueError):
            return None
        return "cpu" if usec > options.cpu_s * 1e6 else None
    tasks = 0
    ticks = 0
    pages = 0
    for pid in _tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # utime stime cutime cstime (a live process's reaped children are in its c*)
        ticks += sum(int(x) for x in fields[11:15])
        tasks += int(fields[17])  # num_threads
        pages += int(fields[21])  # rss
    if options.pids and tasks > options.pids:
        return "pids"
    if options.memory_mb and pages * PAGE > options.memory_mb * MIB:
        return "memory"
    if options.cpu_s:
        reaped = os.times()
        if ticks / TICKS + reaped.children_user + reaped.children_system > options.cpu_s:
            return "cpu"
    return None


def _make_cgroup(options: _Options) -> None:
    """The call's cgroup with its limits (`--cgroup`); left unmade on an error, and
    then the limits fall to setrlimit and the count."""
    if options.cgroup is None:
        return
    path = f"{options.cgroup}/call-{os.getpid()}"
    try:
        os.mkdir(path)
        settings = [] if options.track_only else [
            ("memory.max", options.memory_mb * MIB), ("memory.swap.max", 0),
            ("memory.oom.group", 1), ("pids.max", options.pids)]
        for name, value in settings:
            if value or name in ("memory.swap.max", "memory.oom.group"):
                try:
                    with open(f"{path}/{name}", "w") as f:
                        f.write(str(value))
                except FileNotFoundError:  # no swap accounting: nothing to bound
                    pass
        options.call = path
    except OSError as exc:
        if not options.track_only:  # tracking only: the subreaper remains, silently
            os.write(2, f"veild: no cgroup for this call ({exc}); limits by setrlimit\n"
                        .encode())
        options.cgroup = None


def _end_cgroup(options: _Options) -> str | None:
    """Kill what is left in the call's cgroup, say which limit the kernel enforced,
    and remove it."""
    if options.call is None:
        return None
    over = None
    try:
        with open(f"{options.call}/memory.events") as f:
            if any(line.split() and line.split()[0] == "oom_kill" and line.split()[1] != "0"
                   for line in f):
                over = "memory"
        with open(f"{options.call}/pids.events") as f:
            if not over and any(line.split()[:1] == ["max"] and line.split()[1] != "0"
                                for line in f):
                over = "pids"
    except OSError:
        pass
    try:
        with open(f"{options.call}/cgroup.kill", "w") as f:
            f.write("1")
    except OSError:
        pass
    for _ in range(100):
        try:
            os.rmdir(options.call)
            break
        except OSError:
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            os.sched_yield()
    return over


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


def _confine(options: _Options) -> None:
    """In the forked child, before exec: into the call's cgroup, else the rlimits; the
    capability bounding set emptied when asked."""
    if options.call is not None:
        try:
            with open(f"{options.call}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            if not options.track_only:
                raise
            # Tracking only: untracked, the subreaper still reaches the tree.
    if not options.limited:
        import resource

        if options.memory_mb:
            size = options.memory_mb * MIB
            resource.setrlimit(resource.RLIMIT_DATA, (size, size))
        if options.cpu_s:
            cpu = max(1, int(options.cpu_s + 0.999))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        if options.pids and os.geteuid() != 0:  # root is not bound by it anyway
            # The user's other tasks and the supervisor, then the call's own (this
            # process, counted in _user_tasks, is the first of them).
            nproc = _user_tasks() - 1 + options.pids
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if options.drop_caps:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        try:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
        except (OSError, ValueError):
            last = 40
        for cap in range(last + 1):
            _prctl(PR_CAPBSET_DROP, cap)


def _user_tasks() -> int:
    """Tasks (threads) of this user on the machine now: RLIMIT_NPROC counts them all."""
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def _started_environment() -> dict[bytes, bytes]:
    """The environment this process was started with, for the child: not os.environ,
    to which Python adds LC_CTYPE itself where the locale is C (PEP 538) — the tool
    gets exactly the environment the daemon gave it (CONTRACT §16)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environb)
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def _exec_child(options: _Options) -> None:
    """In the forked child: ARGV in its own group, killed if the supervisor dies."""
    argv = options.argv
    try:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        os.setpgid(0, 0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _confine(options)
        os.execvpe(argv[0], argv, _started_environment())
    except BaseException as exc:  # the child must never return to the caller
        os.write(2, f"veild: cannot run {argv[0]}: {exc}\n".encode())
    os._exit(127)


def main() -> int:
    options = _Options(sys.argv[1:])
    if options.report_fd >= 0:
        os.set_inheritable(options.report_fd, False)  # bash does not get it
    daemon = os.getppid()
    started: list[int] = []  # bash's pid once it runs: the limits are counted then
    _make_cgroup(options)  # first: without one, the timer counts the tree more often
    _watch(daemon, options, started)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    bash: int | None = None
    status: int | None = None
    over: str | None = None
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            bash = os.fork()
            if bash == 0:
                _exec_child(options)
            started.append(bash)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        _watch_pidfd(daemon)
        while status is None:
            pid, got = os.waitpid(-1, 0)  # adopted orphans that end are reaped here
            if pid == bash:
                status = got
    except _Over as exc:
        over = exc.limit
    except (_Stop, ChildProcessError):
        pass
    while True:  # from here on nothing interrupts the sweep
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            signal.setitimer(signal.ITIMER_REAL, 0)
            break
        except _Stop:
            continue
    if options.call is not None:  # the kernel kills the whole cgroup at once
        try:
            with open(f"{options.call}/cgroup.kill", "w") as f:
                f.write("1")
        except OSError:
            pass
    code = _exit_code(_sweep(bash, status))
    over = _end_cgroup(options) or over
    if over is None and status is not None and options.cpu_s and options.call is None:
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU,
                                                              signal.SIGKILL):
            over = _over(options) or ("cpu" if os.WTERMSIG(status) == signal.SIGXCPU
                                      else None)
    if over and options.report_fd >= 0:
        try:
            os.write(options.report_fd, over.encode())
        except OSError:
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
