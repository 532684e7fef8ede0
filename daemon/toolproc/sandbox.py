"""The bubblewrap sandbox of each bash call (CONTRACT §16).

A sandboxed call runs as

    supervise.py [LIMITS] bwrap --unshare-all [--share-net] --die-with-parent
                        --new-session --cap-drop ALL
                        --ro-bind /usr /usr --symlink usr/bin /bin ... --ro-bind /etc /etc
                        --dev /dev --proc /proc --tmpfs /tmp --tmpfs /run --symlink ...
                        --ro-bind ALLOWED... --tmpfs HIDDEN... --bind WS WS
                        --remount-ro HIDDEN... --remount-ro / --chdir WS -- bash -c COMMAND

- an allowlist, not the host's `/` (issue 42): on an empty root, read-only, only the
  system directories a shell needs — `/usr` and `/bin`, `/sbin`, `/lib*` (symlinks into
  it on a merged-/usr system, else bound), `/etc` (all of it: programs read many files
  there — passwd, hosts, certificates, ld.so.cache, alternatives — minus its known
  secrets, `ETC_SECRETS`, each hidden), `[server] sandbox_allow` — and its workspace
  read-write at the same path (its cwd and HOME); a private `/tmp` and `/var/tmp`, a
  tmpfs over `/run` (and `/var/run` a link to it), a fresh `/dev` and `/proc`. Nothing
  else of the host is there: not the data dir (other sessions' workspaces, the
  database, the event log), not `/home`, `/root`, `/srv`, `/opt`, `/var`, `/sys`, `/mnt`
  — and so no Unix socket of the host (`/run/postgresql`, `/var/run/docker.sock`,
  `/run/user/UID/bus`): a socket is reached by its path, and no path to one is bound.
  The hidden paths of §16 (the data dir, the config file's directory, the daemon
  user's home, `[server] sandbox_hide`) are still mounted empty where they fall under
  a bound directory (`/etc/veild`, an allowed path);
- its own PID namespace with a fresh /proc: no other process of the machine — the
  daemon's environment in /proc/PID/environ above all — is visible. bubblewrap ends as
  soon as bash (the namespace's first process) ends, and `--die-with-parent` then kills
  the namespace's init, so the kernel kills everything else in it: a background job,
  a `setsid` or double-forked child, a nested `unshare`;
- its own network namespace (only its own loopback: the daemon's port is not there)
  unless the agent says `network = true`; no capabilities, a new session (no TIOCSTI
  into a terminal).

The supervisor (supervise.py) still runs outside, as for an unsandboxed call:
cancel and timeout signal it, it kills bubblewrap, and as a subreaper it then adopts
and reaps the namespace's init — which the kernel lets go only once every process of
the namespace is dead. So when the tool returns nothing it started is left, as seen
from the host's /proc (docs/security.md has the figures).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import trio

from daemon.config import AgentConfig, Config, ToolLimits
from daemon.errors import ConfigError
from daemon.toolproc.limits import Limiter, open_limiter
from daemon.toolproc.procgroup import SUPERVISOR

# The logger keeps its name from before the move (operators filter logs by it).
log = logging.getLogger("daemon.sandbox")

PROBE_TIMEOUT_S = 10.0
BASE_ARGS = ("--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL")
# The system directories a shell needs, read-only (the allowlist, issue 42).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
PRIVATE_ARGS = ("--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp",
                "--tmpfs", "/run", "--symlink", "../run", "/var/run")
# What of /etc a tool never needs and must not read: password hashes, sudo rules, the
# host's SSH and TLS private keys, stored credentials and VPN keys.
ETC_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
               "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private",
               "/etc/credstore", "/etc/credstore.encrypted", "/etc/wireguard",
               "/etc/NetworkManager/system-connections", "/etc/ppp", "/etc/krb5.keytab",
               "/etc/security/opasswd", "/etc/veild/env")
PRIVATE_TMP = Path("/tmp")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"


@dataclass(frozen=True)
class Sandbox:
    """bubblewrap's path and what it hides, or no sandbox (`bwrap` None)."""

    bwrap: str | None = None
    hide: tuple[Path, ...] = ()
    # Read-only paths bound besides the system's (`[server] sandbox_allow`).
    allow: tuple[Path, ...] = ()
    # How every tool call's limits are enforced (CONTRACT §16.1, limits.py).
    limiter: Limiter = field(default_factory=Limiter)
    # [server]'s tool_* limits (an agent's own values win: config.agent_limits).
    limits: ToolLimits = field(default_factory=ToolLimits)
    # An empty regular file bound over each hidden file (a device such as /dev/null
    # cannot be opened on bubblewrap's nodev binds).
    empty: Path = Path("/nonexistent")
    # Why `auto` fell back to none (for the log and `veild doctor`).
    why_none: str | None = None

    @property
    def mode(self) -> str:
        return "none" if self.bwrap is None else "bwrap"

    @cached_property
    def present(self) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
        """The hidden directories (outermost first) and files that exist, where they
        would show — under what is bound (the system directories, the private /var/tmp,
        `allow`) —, outside the private /tmp and not under another hidden directory:
        stat'ed once (in a thread by `open_sandbox`), not on the event loop at every
        call (issue 44)."""
        bound = [Path(p) for p in (*SYSTEM_DIRS, "/var/tmp")] + list(self.allow)
        hide = [p for p in (*self.hide, *map(Path, ETC_SECRETS))
                if any(_within(p, root) for root in bound)]
        dirs: list[Path] = []
        files: list[Path] = []
        for path in sorted(set(hide), key=lambda p: len(p.parts)):
            if _within(path, PRIVATE_TMP) or any(_within(path, outer) for outer in dirs):
                continue
            if path.is_dir():
                dirs.append(path)
            elif path.exists():
                files.append(path)
        return tuple(dirs), tuple(files)

    def wrap(self, argv: Sequence[str], workspace: Path, *, network: bool,
             read_only: Sequence[Path] = (), chdir: Path | None = None) -> list[str]:
        """`argv` as it runs inside this sandbox for `workspace` (absolute), with
        `read_only` bound too (an MCP server's own directory) even where hidden, and
        its cwd `chdir` (default: the workspace)."""
        if self.bwrap is None:
            return list(argv)
        args = [self.bwrap, *BASE_ARGS]
        if network:
            args.append("--share-net")
        args += _system_binds(network)
        for path in self.allow:
            args += ["--ro-bind-try", str(path), str(path)]
        dirs, files = _hidden(self.present, workspace)
        for path in dirs:
            args += ["--tmpfs", str(path)]
        for path in files:  # a hidden file reads as empty
            args += ["--ro-bind", str(self.empty), str(path)]
        args += ["--bind", str(workspace), str(workspace)]
        for path in read_only:
            args += ["--ro-bind", str(path), str(path)]
        for path in dirs:
            args += ["--remount-ro", str(path)]
        return [*args, "--remount-ro", "/", "--chdir", str(chdir or workspace), "--", *argv]


    def command(self, argv: Sequence[str], *, limits: ToolLimits, workspace: Path | None,
                network: bool, confined: bool, report_fd: int | None = None,
                read_only: Sequence[Path] = (), chdir: Path | None = None) -> list[str]:
        """The whole argv of one tool process (CONTRACT §16, §16.1): `argv` under its
        supervisor with the limits, in this sandbox when `confined` (and there is one),
        else with no capabilities (the daemon's /proc stays closed to it)."""
        inner = list(argv)
        sandboxed = confined and self.bwrap is not None and workspace is not None
        if sandboxed:
            assert workspace is not None
            inner = self.wrap(argv, workspace, network=network, read_only=read_only,
                              chdir=chdir)
        opts = ["--memory-mb", str(limits.memory_mb), "--pids", str(limits.pids)]
        if limits.cpu_s:
            opts += ["--cpu-s", f"{limits.cpu_s:g}"]
        if self.limiter.mode == "cgroup":
            opts += ["--cgroup", str(self.limiter.tools)]
        elif self.limiter.track is not None:  # the tree in a cgroup, limits by rlimit
            opts += ["--track", str(self.limiter.track)]
        if not sandboxed:
            opts.append("--drop-caps")
        if report_fd is not None:
            opts += ["--report-fd", str(report_fd)]
        return [sys.executable, "-I", "-S", str(SUPERVISOR), *opts, "--", *inner]


def _system_binds(network: bool) -> list[str]:
    """The system directories, read-only: a symlink (merged /usr) stays a symlink, a
    directory is bound; then the private /dev, /proc, /tmp, /run. With the network, a
    /etc/resolv.conf that points into /run (systemd-resolved) keeps its target."""
    args: list[str] = []
    for name in SYSTEM_DIRS:
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    args += PRIVATE_ARGS
    resolv = os.path.realpath("/etc/resolv.conf")
    if network and resolv.startswith("/run/") and os.path.isfile(resolv):
        args += ["--ro-bind", resolv, resolv]
    return args


def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _hidden(present: tuple[tuple[Path, ...], tuple[Path, ...]], workspace: Path
            ) -> tuple[list[Path], list[Path]]:
    """The directories to mount empty, outermost first, and the files to mount empty:
    those present (`Sandbox.present`) but neither the workspace nor inside it (the
    session's own work). No stat: this runs at every call, on the event loop."""
    dirs, files = present
    return ([p for p in dirs if not _within(p, workspace)],
            [p for p in files if not _within(p, workspace)])


def hidden_paths(config: Config) -> tuple[Path, ...]:
    """What every sandbox hides (CONTRACT §16), resolved: symlinks to them lead into
    the empty directory too."""
    server = config.server
    paths = [server.data_dir, config.path.parent, *server.sandbox_hide]
    if config.cluster is not None:
        paths.append(config.cluster.workspaces_in(server.data_dir))
        paths.append(config.cluster.snapshots_in(server.data_dir))  # CONTRACT §19
    for home in (os.environ.get("HOME"), _passwd_home()):
        if home:
            paths.append(Path(home))
    resolved = {Path(os.path.realpath(p)) for p in paths}
    resolved.discard(Path("/"))  # a home of "/" (some system users) hides nothing
    return tuple(sorted(resolved))


def _passwd_home() -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return None


def empty_file(data_dir: Path) -> Path:
    """DATA_DIR/sandbox-empty: a file of no bytes, made read-only (it is hidden itself,
    like all of the data dir; bubblewrap reads bind sources from the host's view)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = Path(os.path.realpath(data_dir / "sandbox-empty"))
    if not path.is_file() or path.stat().st_size:
        path.unlink(missing_ok=True)
        path.touch(mode=0o444)
    return path


async def probe(bwrap: str) -> str | None:
    """Runs `true` in a sandbox like a call's: None when it worked, else why not."""
    try:
        with trio.fail_after(PROBE_TIMEOUT_S):
            done = await trio.run_process(
                [bwrap, *BASE_ARGS, *_system_binds(False), "--", "true"], stdin=subprocess.DEVNULL,
                capture_stdout=True, capture_stderr=True, check=False,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except trio.TooSlowError:
        return f"{bwrap} did not finish a trial run within {PROBE_TIMEOUT_S:g}s"
    except OSError as exc:
        return f"cannot run {bwrap}: {exc.strerror or exc}"
    if done.returncode != 0:
        err = " ".join(done.stderr.decode("utf-8", "replace").split())[:300]
        return f"{bwrap} failed a trial run (exit {done.returncode}): {err or 'no output'}"
    return None


async def find_bwrap() -> tuple[str | None, str | None]:
    """bubblewrap on PATH and working here: (its path, None), else (None, why not)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bwrap is not on PATH"
    why = await probe(bwrap)
    return (bwrap, None) if why is None else (None, why)


def opted_out(agents: Iterable[AgentConfig]) -> list[str]:
    """The agents whose bash runs unsandboxed by their own `sandbox = false`."""
    return sorted(a.name for a in agents if not a.sandbox and "bash" in a.tools)


async def open_sandbox(config: Config) -> Sandbox:
    """`[server] sandbox` in force: `auto` tries bubblewrap once and falls back to none
    with one WARNING; `bwrap` that does not work is a ConfigError (exit 2)."""
    mode = config.server.sandbox
    limiter = open_limiter()
    limits = config.server.tool_limits
    log.info("tool limits: %s", limiter.describe())
    if mode == "none":
        return Sandbox(why_none='[server] sandbox = "none"', limiter=limiter, limits=limits)
    bwrap, why = await find_bwrap()
    if bwrap is None:
        if mode == "bwrap":
            raise ConfigError(str(config.path), "server.sandbox",
                              f'"bwrap" does not work here: {why}; {INSTALL_HINT}')
        log.warning("sandbox: none: bash calls run unsandboxed (%s); %s", why, INSTALL_HINT)
        return Sandbox(why_none=why, limiter=limiter, limits=limits)
    sandbox = Sandbox(bwrap, hidden_paths(config), allow=config.server.sandbox_allow,
                      empty=empty_file(config.server.data_dir), limiter=limiter,
                      limits=limits)
    await trio.to_thread.run_sync(lambda: sandbox.present)  # stat'ed once, off the loop
    log.info("sandbox: bwrap (%s); hidden: %s", bwrap,
             ", ".join(str(p) for p in sandbox.hide))
    for name in opted_out(config.agents.values()):
        log.warning("sandbox: agent %s runs its bash unsandboxed (sandbox = false)", name)
    return sandbox
