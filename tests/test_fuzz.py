"""CONTRACT §12 and §3 — schemathesis fuzzes the running daemon against its own
GET /openapi.json: for every operation, data that fits the document and data that does
not. No answer is a 5xx; every answer (status, content type, headers, body) is one the
document names; data that breaks the document is refused (4xx), data that fits it is
not refused as malformed; and a refused request changes nothing: the session, message,
turn and inbox counts in the database are what they were before it.

The daemon runs in-process on port 0 under Trio (tests/harness.py), as everywhere else
in the suite; schemathesis is synchronous (requests, hypothesis), so the whole fuzz
runs in one worker thread and talks to the daemon over loopback like any client. The
daemon's own logs and failures stay in this process, where pytest sees them.

Bounded: a fixed number of examples per operation and mode, no example database, so a
run is the same size every time (about 20 s on a loaded 2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from daemon.mock.script import MARKER
from tests.harness import Provider, db_rows, mock, open_daemon

EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance,
          negative_data_rejection, positive_data_acceptance]
# Operations that must never get the seeded session's id: they would start a turn in
# the background (a delivery wakes it) or never end (a live stream).
NO_REAL_SESSION = {("POST", "/sessions/{session_id}/messages"),
                   ("GET", "/sessions/{session_id}/stream")}


def counts(tmp: Path) -> tuple[int, ...]:
    row = db_rows(tmp, "SELECT (SELECT COUNT(*) FROM sessions) AS s, "
                       "(SELECT COUNT(*) FROM messages) AS m, (SELECT COUNT(*) FROM turns) AS t, "
                       "(SELECT COUNT(*) FROM inbox) AS i")[0]
    return row["s"], row["m"], row["t"], row["i"]


class Seed:
    """An idle session with messages that about half the cases aim at (instead of a
    random id, which only ever finds 404); made again when a fuzzed prune removed it."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30)
        self.session_id = ""

    def get(self) -> str:
        if not self.session_id or self.client.get(
                f"/sessions/{self.session_id}").status_code == 404:
            r = self.client.post("/agents/plain/chat", json={"message": mock(say="seeded")})
            self.session_id = r.json()["sessionId"]
        return self.session_id


def fuzz(url: str, tmp: Path) -> dict[str, int]:
    """In a worker thread: every operation, both modes; returns how many calls each
    (operation, mode, status) got, so the test can see that both sides were reached."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    statuses: dict[str, int] = {}
    seed = Seed(url)
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fuzz_operation(op, mode, url, tmp, seed, statuses)
    finally:
        seed.client.close()
    return statuses


def fuzz_operation(op: Any, mode: GenerationMode, url: str, tmp: Path, seed: Seed,
                   statuses: dict[str, int]) -> None:
    key = (op.method.upper(), op.path)

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode), real=st.booleans())
    def run(case: Any, real: bool) -> None:
        params = case.path_parameters or {}
        if real and "session_id" in params and key not in NO_REAL_SESSION \
                and key[0] != "DELETE":
            params["session_id"] = seed.get()
        if real and "name" in params:
            params["name"] = "plain"
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) \
                    and isinstance(case.body.get("message"), str):
                # A real turn: the fuzzed text, answered at once by the provider (not
                # in negative mode: the line would make an invalid message valid).
                case.body["message"] += "\n" + MARKER + json.dumps({"say": "fuzzed"})
        before = counts(tmp)
        response = case.call(base_url=url, allow_redirects=False, timeout=30)
        label = f"{key[0]} {key[1]} {mode.value} {response.status_code}"
        statuses[label] = statuses.get(label, 0) + 1
        # /ws is a WebSocket: schemathesis's plain GETs are not upgrades, and the
        # daemon answers them 400 as documented, whatever the (valid) query says.
        checks = CHECKS if key != ("GET", "/ws") else [
            c for c in CHECKS if c is not positive_data_acceptance]
        case.validate_response(response, checks=checks)
        if response.status_code >= 400:
            assert counts(tmp) == before, (
                f"{case.method} {case.formatted_path} answered {response.status_code} "
                "and changed the database")

    try:
        run()
    except Unsatisfiable:
        # Nothing to get wrong: an operation without parameters or body has no
        # negative data (GET /health).
        if mode is not GenerationMode.NEGATIVE:
            raise
        statuses[f"{key[0]} {key[1]} negative none"] = 0


@pytest.mark.deadline(240)  # 72 s measured on a shared 2-core machine
async def test_the_daemon_answers_as_its_document_says(provider: Provider, tmp_path: Path
                                                       ) -> None:
    async with open_daemon(tmp_path, provider) as d:
        statuses = await trio.to_thread.run_sync(fuzz, d.url, tmp_path)
        # The daemon is still well after it.
        health = await d.http.get("/health")
        assert health.status_code == 200
    assert any(" 400" in label for label in statuses), statuses
    for reached in ("POST /agents/{name}/chat positive 200",
                    "GET /sessions/{session_id} positive 200",
                    "POST /sessions/{session_id}/cancel positive 200",
                    "DELETE /sessions positive 200",
                    "GET /v1/models positive 200",
                    "POST /v1/chat/completions negative 400"):
        assert statuses.get(reached), (reached, statuses)
