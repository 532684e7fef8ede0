"""CONTRACT §11 routes: GET /schedules, POST /schedules/{name}/run|pause|resume.

A body on the POSTs is ignored (never read). Unknown name: 404; a run while the
schedule's turn (for `same`: any turn of its session) runs: 409."""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from daemon.api.actions import perform_on_scheduler
from daemon.api.runtime import Runtime
from daemon.api.spec import BOOL, INT, STR, Op, Resp, array, documented, error, nullable, obj


def _answer(result: tuple[int, dict[str, object]]) -> Response:
    status, body = result
    response = jsonify(body)
    response.status_code = status
    return response


# What GET /openapi.json says of these routes (api/spec.py).
_SCHEDULE = obj(
    ["name", "agent", "timezone", "enabled", "paused", "running", "nextRunAt", "lastRunAt",
     "lastSessionId", "lastTurnId", "lastOutcome", "skipped"],
    name=STR, agent=STR, every=STR, cron=STR, timezone=STR, enabled=BOOL, paused=BOOL,
    running=BOOL, nextRunAt=nullable(INT), lastRunAt=nullable(INT),
    lastSessionId=nullable(STR), lastTurnId=nullable(STR), lastOutcome=nullable(STR),
    skipped=INT,
)
_NO_SCHEDULE = error("no schedule of that name")


def _paused(done: str, summary: str) -> Op:
    return Op(summary, {200: Resp(done, obj(["name", "paused"], name=STR, paused=BOOL)),
                        404: _NO_SCHEDULE}, tags=("schedules",))


def schedule_routes(rt: Runtime) -> Blueprint:
    bp = Blueprint("schedules", __name__)

    @bp.get("/schedules")
    @documented(Op("Schedules and their state (CONTRACT §11)", {
        200: Resp("every schedule", obj(["schedules"], schedules=array(_SCHEDULE))),
    }, tags=("schedules",)))
    async def list_schedules() -> Response:
        return _answer(await perform_on_scheduler(rt, {"verb": "list"}))

    @bp.post("/schedules/<name>/run")
    @documented(Op("Run a schedule now (also while paused)", {
        202: Resp("started", obj(["sessionId", "turnId"], sessionId=STR, turnId=STR)),
        404: _NO_SCHEDULE,
        409: error("its turn (for `same`: any turn of its session) runs"),
    }, tags=("schedules",)))
    async def run(name: str) -> Response:
        return _answer(await perform_on_scheduler(rt, {"verb": "run", "name": name}))

    @bp.post("/schedules/<name>/pause")
    @documented(_paused("paused", "Pause a schedule"))
    async def pause(name: str) -> Response:
        return _answer(await perform_on_scheduler(rt, {"verb": "pause", "name": name}))

    @bp.post("/schedules/<name>/resume")
    @documented(_paused("resumed", "Resume a schedule"))
    async def resume(name: str) -> Response:
        return _answer(await perform_on_scheduler(rt, {"verb": "resume", "name": name}))

    return bp
