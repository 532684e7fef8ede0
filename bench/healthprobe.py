"""GET /health every EVERY seconds on one keep-alive connection until SIGTERM; then one
JSON line on stdout: each request's latency (s), the answers that were not 200, and
which node answered (a cluster node's /health says its id; every 20th answer is read).

A process of its own (plain stdlib, blocking), so that what it times is the daemon's
answer, not the bench process's event loop, busy with its /ws watchers. It writes
`ready` once its first request was answered. A request that comes back late is followed
by the next at once, not by a catch-up burst.

    python bench/healthprobe.py http://127.0.0.1:PORT 0.05
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import time
from collections import Counter
from types import FrameType
from urllib.parse import urlsplit


def main() -> None:
    url, every = urlsplit(sys.argv[1]), float(sys.argv[2])
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    conn = http.client.HTTPConnection(host, port, timeout=60)
    latencies: list[float] = []
    bad: Counter[str] = Counter()
    nodes: Counter[str] = Counter()  # a cluster node's /health names it
    next_at = time.perf_counter()
    while not stopping:
        started = time.perf_counter()
        try:
            conn.request("GET", "/health")
            answer = conn.getresponse()
            body = answer.read()
            status = str(answer.status)
            if len(latencies) % 20 == 0 and status == "200":
                nodes[str(json.loads(body).get("node", ""))] += 1
        except (OSError, http.client.HTTPException) as exc:
            status = type(exc).__name__
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=60)
        latencies.append(time.perf_counter() - started)
        if status != "200":
            bad[status] += 1
        if len(latencies) == 1:
            print("ready", flush=True)
        now = time.perf_counter()
        next_at = max(next_at + every, now)
        time.sleep(next_at - now)
    print(json.dumps({"latencies_s": latencies, "bad": dict(bad), "nodes": dict(nodes)}),
          flush=True)


if __name__ == "__main__":
    main()
