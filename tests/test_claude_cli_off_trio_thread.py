"""The claude-cli engine's file setup (its workspace and HOME made, its stderr file
opened) runs on a worker thread, not on Trio's: a disk that blocks does not stop the
daemon. The slow disk is real: the session's `.claude-cli.stderr` is replaced by a FIFO,
whose open for writing blocks until a reader comes. A plain OS thread watches
/proc/self/task for the thread blocked in that open (wchan `wait_for_partner`, the
kernel's FIFO open) and reports which one it is; while it stays blocked the daemon still
answers /health; then the watcher opens the FIFO for reading and the turn goes on.
On the Trio thread the open froze every task of the process, the test's own among them:
the watcher then releases it at once (nothing else could) and reports the Trio thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import trio

from tests.harness import Provider, open_daemon
from tests.test_claude_cli import claude_agent, fake

WATCH_S = 20.0  # how long the watcher looks for a blocked open, and holds it


class FifoOpenWatch:
    """An OS thread that finds the thread of this process blocked opening a FIFO, tells
    Trio which one (`tid`, then `found`), holds it until `release` (at once when it is
    the Trio thread) and then drains the FIFO as its reader."""

    def __init__(self, fifo: Path, trio_tid: int) -> None:
        self.fifo = fifo
        self.trio_tid = trio_tid
        self.tid: int | None = None
        self.found = trio.Event()
        self.release = threading.Event()
        self.held = threading.Event()  # set while the blocked open is being held
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="fifo-open-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(WATCH_S)

    def _blocked(self) -> int | None:
        for task in os.listdir("/proc/self/task"):
            try:
                wchan = Path(f"/proc/self/task/{task}/wchan").read_text()
            except OSError:
                continue  # the thread ended
            if wchan == "wait_for_partner":
                return int(task)
        return None

    def _run(self) -> None:
        stop = threading.Event()
        for _ in range(int(WATCH_S / 0.005)):
            self.tid = self._blocked()
            if self.tid is not None:
                break
            stop.wait(0.005)  # a plain thread polling /proc, bounded: not the test's sync
        if self.tid is not None and self.tid != self.trio_tid:
            self.held.set()
            self._token.run_sync_soon(self.found.set)
            self.release.wait(WATCH_S)
            self.held.clear()
        else:  # none found, or the Trio thread: nobody but this thread can release it
            self._token.run_sync_soon(self.found.set)
        with open(self.fifo, "rb") as reader:  # lets the open through; drains its writer
            while reader.read(65536):
                pass


async def test_the_stderr_file_opens_off_the_trio_thread(
    tmp_path: Path, provider: Provider
) -> None:
    async with open_daemon(tmp_path, provider, extra=claude_agent()) as daemon:
        first = await daemon.chat(fake(), agent="claude")
        assert first.status_code == 200, first.text
        sid = first.json()["sessionId"]
        fifo = tmp_path / "data" / "workspaces" / sid / ".claude-cli.stderr"
        fifo.unlink()
        os.mkfifo(fifo)
        watch = FifoOpenWatch(fifo, threading.get_native_id())
        watch.start()
        replies: list[int] = []

        async def second() -> None:
            r = await daemon.chat(fake(calls=[{"say": "through"}]), agent="claude",
                                  sessionId=sid)
            replies.append(r.status_code)

        with trio.fail_after(WATCH_S * 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(second)
                await watch.found.wait()
                assert watch.tid is not None, "no thread was seen waiting to open the FIFO"
                assert watch.tid != watch.trio_tid, (
                    "the stderr file was opened on the Trio thread")
                # The open waits on its worker thread, and meanwhile the daemon answers.
                health = await daemon.http.get("/health")
                assert health.status_code == 200 and watch.held.is_set()
                watch.release.set()
        watch.join()
        assert replies == [200]
        assert (await daemon.http.get(f"/sessions/{sid}/messages")).json()[
            "messages"][-1]["content"] == "through"
