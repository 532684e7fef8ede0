"""`GET /metrics` (CONTRACT §12): the daemon's metrics in Prometheus text format. Auth is
the app's, as for every route."""

from __future__ import annotations

from quart import Blueprint, Response

from daemon.api.spec import Op, Resp, documented
from daemon.observe.metrics import CONTENT_TYPE, Metrics


def metrics_routes(metrics: Metrics) -> Blueprint:
    bp = Blueprint("metrics", __name__)

    @bp.get("/metrics")
    @documented(Op("Prometheus metrics (text format)", {
        200: Resp("the metrics", None, "text/plain"),
    }, tags=("operations",)))
    async def scrape() -> Response:
        return Response(metrics.render(), content_type=CONTENT_TYPE)

    return bp
