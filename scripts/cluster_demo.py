"""`make cluster-demo`: a two-node veild cluster on this machine (docs/cluster.md).

PostgreSQL (Debian's, initdb'd once into var/cluster-demo/pg as the `postgres` user when
run as root: initdb refuses root) on a free loopback port, with a fresh `veild`
database each start; a redis-server (no persistence) on a free port; two
`veild serve` nodes with config/daemon.toml's demo agent and a [cluster] table, on ports
7441 and 7442. Ctrl-C stops the nodes (SIGTERM: their turns end as on one node), then
Redis, then PostgreSQL. The nodes, Redis and PostgreSQL run in sessions of their own, so the
terminal's Ctrl-C reaches this script only and the stop happens in that order.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

VAR = ROOT / "var" / "cluster-demo"
PORTS = (7441, 7442)
LEASE_S = 5  # short, so that a killed node's turn is INTERRUPTED within 10 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


class Postgres:
    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                       key=lambda p: int(Path(p).parent.parent.name))
        if not found:
            sys.exit("cluster-demo: PostgreSQL is not installed (apt-get install postgresql)")
        self.bin = Path(found[-1]).parent
        self.data = VAR / "pg"
        self.port = free_port()

    def start(self) -> str:
        if not (self.data / "PG_VERSION").exists():
            self.data.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                shutil.chown(self.data, "postgres", "postgres")
            subprocess.run(as_postgres([str(self.bin / "initdb"), "-D", str(self.data),
                                        "-U", "postgres", "--auth=trust", "--encoding=UTF8",
                                        "--locale=C.UTF-8"]),
                           check=True, capture_output=True, text=True)
        # No unix socket: its path would have to be short and writable by postgres.
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   "-c unix_socket_directories=''")
        started = subprocess.run(
            as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l",
                         str(self.data / "server.log"), "-o", options, "-w", "-t", "60",
                         "start"]), capture_output=True, text=True)
        if started.returncode != 0:
            sys.exit(f"cluster-demo: PostgreSQL did not start: {started.stderr.strip()} "
                     f"(see {self.data / 'server.log'})")
        admin = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:  # a fresh demo each start
            conn.execute("DROP DATABASE IF EXISTS veild WITH (FORCE)")
            conn.execute("CREATE DATABASE veild")
        return f"postgresql://postgres@127.0.0.1:{self.port}/veild"

    def stop(self) -> None:
        subprocess.run(as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m",
                                    "fast", "-w", "stop"]), capture_output=True)


class Redis:
    """redis-server without persistence, in a session of its own (so the terminal's
    Ctrl-C does not stop it before the nodes)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("cluster-demo: redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        (VAR / "redis").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(VAR / "redis"),
             "--logfile", str(VAR / "redis" / "redis.log")],
            stdout=subprocess.DEVNULL, start_new_session=True)
        for _ in range(100):  # until it accepts a connection (at most 10 s)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        sys.exit(f"cluster-demo: redis-server did not start (see {VAR / 'redis' / 'redis.log'})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


def node_config(index: int, store: str, bus: str) -> Path:
    """config/daemon.toml with this node's port and data_dir, and a [cluster] table."""
    text = (ROOT / "config" / "daemon.toml").read_text()
    text = text.replace("port = 7433", f"port = {PORTS[index]}", 1)
    text = text.replace('data_dir = "./var"', f'data_dir = "{VAR / f"node-{index + 1}"}"', 1)
    text += (f'\n[cluster]\nstore = "{store}"\nbus = "{bus}"\nnode_id = "node-{index + 1}"\n'
             f'lease_s = {LEASE_S}\nworkspaces = "{VAR / "workspaces"}"\n')
    path = VAR / f"node-{index + 1}.toml"
    path.write_text(text)
    return path


def start_node(index: int, config: Path) -> subprocess.Popen[str]:
    veild = Path(sys.executable).parent / "veild"
    argv = [str(veild)] if veild.exists() else [sys.executable, "-m", "daemon"]
    env = {**os.environ, "VEILD_LOG": os.environ.get("VEILD_LOG", "WARNING")}
    proc = subprocess.Popen([*argv, "serve", "--config", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.wait()
        raise RuntimeError(f"node-{index + 1} did not start (exit {proc.returncode})")
    threading.Thread(target=_echo, args=(proc, f"node-{index + 1}"), daemon=True).start()
    return proc


def _echo(proc: subprocess.Popen[str], name: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"[{name}] {line.rstrip()}", flush=True)


def stop_node(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # stop cleanly on a SIGTERM too
    VAR.mkdir(parents=True, exist_ok=True)
    pg = Postgres()
    nodes: list[subprocess.Popen[str]] = []
    redis = Redis()
    try:
        store = pg.start()
        print(f"cluster-demo: PostgreSQL on 127.0.0.1:{pg.port} ({pg.data})", flush=True)
        redis.start()
        print(f"cluster-demo: Redis on 127.0.0.1:{redis.port}", flush=True)
        for index in range(len(PORTS)):
            nodes.append(start_node(index, node_config(index, store, redis.url)))
        one, two = (f"http://127.0.0.1:{port}" for port in PORTS)
        print(f"""
veild cluster: two nodes, one veild (docs/cluster.md)
  node-1  {one}/studio   (pid {nodes[0].pid})
  node-2  {two}/studio   (pid {nodes[1].pid})

Try:
  - open both Studios: a chat started on one streams on the other as well
  - watch every event on node-2:   .venv/bin/veild tail --url {two}
  - chat via node-1:  curl -s {one}/agents/assistant/chat -H 'content-type: application/json' \\
        -d '{{"message":"hello"}}'
  - kill a node mid-turn: kill -9 {nodes[0].pid}  (node-1); within {2 * LEASE_S} s node-2
    publishes the INTERRUPTED terminal of its turn, and any node answers for its sessions
Ctrl-C stops the nodes, Redis and PostgreSQL.
""", flush=True)
        while True:
            for proc in nodes:
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    continue
            if all(proc.poll() is not None for proc in nodes):
                print("cluster-demo: both nodes have ended", flush=True)
                return 1
    except KeyboardInterrupt:
        print("\ncluster-demo: stopping the nodes, Redis, PostgreSQL …", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: the stop goes on
        for proc in nodes:
            stop_node(proc)
        redis.stop()
        pg.stop()
        print("cluster-demo: stopped", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
