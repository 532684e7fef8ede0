"""CONTRACT §11 routes: GET /schedules, POST /schedules/{name}/run|pause|resume.

A body on the POSTs is ignored (never read). Unknown name: 404; a run while the
schedule's turn (for `same`: any turn of its session) runs: 409."""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from daemon.errors import NotFound
from daemon.runtime.core import Runtime
from daemon.schedules.scheduler import Scheduler


def _json(body: dict[str, object], status: int = 200) -> Response:
    response = jsonify(body)
    response.status_code = status
    return response


def schedule_routes(rt: Runtime) -> Blueprint:
    bp = Blueprint("schedules", __name__)

    def scheduler(name: str | None = None) -> Scheduler:
        if rt.schedules is None:  # an app built without the service (none is running)
            raise NotFound(f"no schedule named {name!r}" if name else "no scheduler",
                           {"schedule": name} if name else None)
        return rt.schedules

    @bp.get("/schedules")
    async def list_schedules() -> Response:
        return _json({"schedules": rt.schedules.wire() if rt.schedules is not None else []})

    @bp.post("/schedules/<name>/run")
    async def run(name: str) -> Response:
        started = await scheduler(name).run_now(name)
        return _json({"sessionId": started.session_id, "turnId": started.turn_id}, 202)

    @bp.post("/schedules/<name>/pause")
    async def pause(name: str) -> Response:
        await scheduler(name).pause(name)
        return _json({"name": name, "paused": True})

    @bp.post("/schedules/<name>/resume")
    async def resume(name: str) -> Response:
        await scheduler(name).resume(name)
        return _json({"name": name, "paused": False})

    return bp
