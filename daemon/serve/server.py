"""The daemon: store, bus, sessions, providers and HTTP, started in order and stopped in
the reverse order.

Shutdown (SIGTERM/SIGINT, or `Daemon.request_shutdown()`): stop accepting, cancel every
running turn with `shutdown` and wait for their terminals, end every bus subscription
(SSE streams finish, WebSockets close with 1001), give connections a grace period and
abort what is left, close the store.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import trio

from daemon.api.app import build_app
from daemon.api.health import health_fast_path
from daemon.api.httpserver import Connections, HttpServer, bind_socket
from daemon.api.runtime import Runtime
from daemon.clock import SYSTEM_CLOCK, Clock, SystemClock
from daemon.cluster.node import SCHEDULER_LOCK, ClusterNode
from daemon.config import AgentConfig, Config, check_exposure, exposure_warning
from daemon.engines.anthropic import AnthropicEngine
from daemon.engines.base import Engine
from daemon.engines.claude_cli import ClaudeCliEngine
from daemon.engines.modelcall import ModelCall, ProviderSlots, Route
from daemon.engines.openai import OpenAIEngine
from daemon.errors import ConfigError, Fenced, ServiceUnavailable
from daemon.eventlog.sqlite import SqliteEventLog
from daemon.llm.anthropic_client import AnthropicClient
from daemon.llm.openai_client import OpenAIClient
from daemon.llm.provider_http import ProviderHTTP, choose_transport, open_provider_http
from daemon.mcp.manager import McpManager
from daemon.observe.looplag import LoopLag
from daemon.observe.loopstats import install_from_env
from daemon.observe.metrics import Metrics
from daemon.observe.provider import ObservedAnthropicClient, ObservedOpenAIClient, ProviderCalls
from daemon.observe.tracing import NO_TRACING, Tracing, open_tracing
from daemon.runtime.bus import Bus
from daemon.runtime.ports import EventLog, Store
from daemon.runtime.pruner import serve_pruner
from daemon.runtime.rewind import Rewinds
from daemon.runtime.sessions import SessionManager
from daemon.runtime.turn import TurnServices
from daemon.schedules.launch import SessionLauncher
from daemon.schedules.scheduler import Scheduler
from daemon.serve.sdnotify import notify, serve_status, serve_watchdog
from daemon.snapshots import SnapshotConfig, Snapshots
from daemon.store import open_store
from daemon.toolproc import survivors
from daemon.toolproc.limits import sweep_calls, sweep_orphaned
from daemon.toolproc.procgroup import close_own_proc
from daemon.toolproc.sandbox import Sandbox, open_sandbox
from daemon.tools.agents import AgentMessageTool, AgentSpawnTool
from daemon.tools.base import Tool
from daemon.tools.bash import BashTool

if TYPE_CHECKING:
    from daemon.cluster.node import Degradable
    from daemon.config import ClusterConfig
    from daemon.redisconn import Client as RedisClient
    from daemon.store.postgres import PostgresStore

# The in-process mock of `[providers.X] type = "mock"` (daemon/mock/provider.py's
# serve_mock_provider): started with nursery.start(serve, host, port,
# max_context_chars=...), it reports its port. Passed in by whoever starts the daemon
# (the CLI, the tests' harness), so the server does not import the mock.
ServeMock = Callable[..., Awaitable[None]]

# The logger keeps its name from before the move (operators filter logs by it).
log = logging.getLogger("daemon.server")


@dataclass
class Daemon:
    runtime: Runtime
    http: HttpServer
    host: str
    _stop: trio.Event
    metrics: Metrics
    loop_lag: LoopLag
    tracing: Tracing = NO_TRACING  # CONTRACT §12.1 (`await tracing.flush()`: export now)

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def request_shutdown(self) -> None:
        self._stop.set()


C = TypeVar("C")  # a provider client: OpenAIClient or AnthropicClient


def _engine_factory(
    config: Config, clients: dict[str, ProviderHTTP], mock_roots: dict[str, str],
    metrics: Metrics, sandbox: Sandbox,
) -> Callable[[AgentConfig], Engine]:
    """Engines by agent. A mock provider (started in-process, root URL in `mock_roots`)
    answers both the Chat Completions API (under /v1) and the Messages API. Each
    provider has its own HTTP client: its own timeouts, and its own connection pool, so
    a provider that holds every connection it has stalls no other provider's agents."""
    openai: dict[str, OpenAIClient] = {}
    anthropic: dict[str, AnthropicClient] = {}
    for name, provider in config.providers.items():
        key = provider.api_key
        http = clients[name]
        # Each request is timed and logged once (observe/provider.py).
        if provider.type in ("openai", "mock"):
            url = f"{mock_roots[name]}/v1" if provider.type == "mock" else provider.base_url
            openai[name] = ObservedOpenAIClient(http, url, key, ProviderCalls(
                name, f"{url.rstrip('/')}/chat/completions", metrics.provider_request_ended))
        if provider.type in ("anthropic", "mock"):
            url = mock_roots[name] if provider.type == "mock" else provider.base_url
            anthropic[name] = ObservedAnthropicClient(http, url, key, ProviderCalls(
                name, f"{url.rstrip('/')}/v1/messages", metrics.provider_request_ended))

    # One set of slots per provider, shared by every agent that calls it (§14).
    slots = {name: ProviderSlots(name, p.max_concurrent, metrics.provider_in_flight_now)
             for name, p in config.providers.items()}

    def routes(agent: AgentConfig, clients: Mapping[str, C]) -> list[Route[C]]:
        # Config validation gives these engines providers of a type they speak.
        assert agent.provider is not None
        entries = [(agent.provider, None), *agent.fallback]
        return [Route(config.providers[name], clients[name], model or agent.model,
                      slots[name]) for name, model in entries]

    def summary_routes(agent: AgentConfig, clients: Mapping[str, C]) -> list[Route[C]] | None:
        """CONTRACT §15 compact_model: where the summarising call goes (None: where the
        agent's calls go, fallbacks included)."""
        if agent.compact_model is None:
            return None
        name, model = agent.compact_model
        return [Route(config.providers[name], clients[name], model, slots[name])]

    def engine_for(agent: AgentConfig) -> Engine:
        retried = metrics.provider_retried
        if agent.engine == "claude-cli":
            return ClaudeCliEngine(agent, sandbox, retries=retried)
        if agent.engine == "anthropic":
            summary = summary_routes(agent, anthropic)
            return AnthropicEngine(
                agent, ModelCall(routes(agent, anthropic), retries=retried),
                ModelCall(summary, retries=retried) if summary else None)
        summary_chat = summary_routes(agent, openai)
        return OpenAIEngine(agent, ModelCall(routes(agent, openai), retries=retried),
                            ModelCall(summary_chat, retries=retried) if summary_chat else None)

    return engine_for


async def _serve_signals(
    stop: Callable[[], None], *, task_status: trio.TaskStatus[None]
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            stop()
            return


def _snapshots(config: Config) -> Snapshots:
    """CONTRACT §19: the snapshot service, in data_dir/snapshots (a cluster's beside its
    workspaces). Off (`snapshots = false`) it still serves forks of the workspace now
    and says "snapshots off" of every turn."""
    server = config.server
    root = (config.cluster.snapshots_in(server.data_dir) if config.cluster is not None
            else server.data_dir / "snapshots")
    return Snapshots(SnapshotConfig(root=root, enabled=server.snapshots,
                                    max_bytes=server.snapshot_max_bytes,
                                    keep=server.snapshot_keep))


def _metrics(bus: Bus) -> Metrics:
    """The daemon's metrics; the bus's own counters are read at scrape time."""
    metrics = Metrics()
    metrics.add("veild_events_published_total", "counter", "Events published on the bus.",
                lambda: bus.published)
    metrics.add("veild_stream_subscribers", "gauge",
                "Live bus subscribers (WebSocket and SSE clients).", lambda: bus.subscriber_count)
    metrics.add("veild_stream_lagged_total", "counter",
                "Subscribers ended as lagged (their queue was full).", lambda: bus.lagged)
    # Slow clients' chunks merged in their queues (CONTRACT §7), where the bus does it.
    metrics.add("veild_stream_coalesced_total", "counter",
                "Chunk events merged into another in a slow subscriber's queue.",
                lambda: bus.coalesced)
    return metrics


# CONTRACT §1: SIGTERM to exit in 10 s. Turns get shutdown_grace_s for their terminals
# and connections client_close_grace_s to finish, each within what is left of this
# budget; closing the event log and the store get the last CLOSE_S each.
STOP_BUDGET_S = 8.0
# Generation thresholds of the daemon's own process (freeze_startup_objects).
GC_THRESHOLDS = (5_000, 10, 50)
CLOSE_S = 0.8


async def serve_daemon(
    config: Config, *, handle_signals: bool = False, clock: Clock = SYSTEM_CLOCK,
    serve_mock: ServeMock | None = None,
    task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until `request_shutdown()`; reports the Daemon when listening.

    Two nurseries: `core` holds what must stop gracefully (sessions, the HTTP server);
    `services` inside it holds the owned services (signals, the event log's flusher,
    the demo provider, the watchdog). The stop sequence runs from a `finally` while the
    core still runs, so it also runs when a service crashes: turns end `shutdown` and
    WebSockets get 1001 either way. `serve_mock` serves the providers of type "mock"
    (required when the config has one).
    """
    check_exposure(config)  # before anything listens (CONTRACT §3.1)
    for name, provider in config.providers.items():
        if provider.type == "mock" and serve_mock is None:
            raise ConfigError(str(config.path), f"providers.{name}.type",
                              "a mock provider needs the daemon started by `veild serve`")
    if (warning := exposure_warning(config)) is not None:
        log.warning(warning)
    # CONTRACT §16.1: no tool reads the daemon's environment through /proc.
    if not close_own_proc():
        log.warning("cannot make the daemon non-dumpable: an unsandboxed tool may read "
                    "/proc/%d/environ", os.getpid())
    sandbox = await open_sandbox(config)  # CONTRACT §16: tried once, here
    if handle_signals:
        install_from_env()  # VEILD_LOOPSTATS: a bench run's loop profile (issue 46)
    stop = trio.Event()
    async with trio.open_nursery() as outer:
        if handle_signals:
            # First of all: a SIGTERM from here on is a graceful stop, never the default
            # action (no window between binding the socket and handling signals).
            await outer.start(_serve_signals, stop.set)
        async with AsyncExitStack() as backends:
            store, event_log, redis = await _open_backends(config, backends)
            async with trio.open_nursery() as core:
                await _serve(config, store, event_log, redis, core, stop, task_status,
                             clock, sandbox, own_process=handle_signals,
                             serve_mock=serve_mock)
                core.cancel_scope.cancel()
        outer.cancel_scope.cancel()


def freeze_startup_objects() -> None:
    """Take what startup built (modules, classes, the app, about 100,000 objects) out
    of the cyclic GC's reach: they live as long as the process, and a full collection
    would otherwise traverse them all, holding the Trio thread for 30-70 ms under load
    (a cancel's terminal waits behind it). Only in the daemon's own process
    (`veild serve`): a test process starts many daemons, whose frozen objects would
    never be collected.

    Then the generation thresholds (issue 46, docs/performance.md): in a burst of
    1,000 turns a young collection cost 0.5 ms of CPU at the default 700 allocations,
    and a full one 120-200 ms (it walks every in-flight task, coroutine and connection:
    ~480,000 objects), 64 of them in two minutes because every tenth gen1 collection
    was a full one. Young collections seven times larger still take a few ms; full ones
    come after 50 gen1 collections, not 10: about 35 times fewer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _listen_url(host: str, listener: socket.socket) -> str:
    port = listener.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Late:
    """The runtime, once it is built. The node serves its control stream before that
    (while it recovers its own turns): what other nodes route to it meanwhile is 503."""

    value: Runtime | None = None


async def _join_cluster(
    config: ClusterConfig, store: PostgresStore, event_log: EventLog, redis: RedisClient,
    sessions: SessionManager, services: trio.Nursery, url: str, stop: trio.Event,
    runtime: _Late, max_running_turns: int,
) -> ClusterNode:
    """This node in the cluster (CONTRACT §13): registered under its id (a live node
    with the same id: NodeIdInUse, exit 1), its control stream served (operations other
    nodes route here for the sessions it owns), its lease renewed."""
    from daemon.api.actions import answer_routed
    from daemon.cluster.clock import StoreClock
    from daemon.cluster.control import ControlChannel
    from daemon.cluster.directory import ClusterDirectory
    from daemon.cluster.routing import Router

    store_clock = StoreClock()  # the store's clock, measured by the heartbeat (§13.8)
    node = ClusterNode(config, config.node_id, store.coordination,
                       cast("Degradable", event_log), redis, stop.set, store_clock)
    await node.register(url)
    # The lease runs from here: it is renewed before anything else is started (the
    # control stream's start waits on Redis; a slow start must not let it run out).
    await services.start(node.serve)
    # A routed JSON chat holds its call (and the owner's handler) for its whole turn: the
    # bounds leave room for as many as turns may run, plus the short operations (a
    # cancel must never wait behind chats).
    room = max_running_turns + 256
    channel = ControlChannel(redis, config.node_id, max_in_flight=room, max_handlers=room,
                             clock=store_clock)

    async def answer(op: str, body: dict[str, Any]) -> dict[str, Any]:
        rt = runtime.value
        if rt is None:  # still recovering its own turns: the caller retries (503)
            raise ServiceUnavailable(f"node {config.node_id} is starting")
        return await answer_routed(rt, op, body)

    await services.start(channel.serve, answer)
    router = Router(config.node_id, store.coordination, channel, lease_s=config.lease_s)
    sessions.directory = ClusterDirectory(node, router, store, SCHEDULER_LOCK)
    return node


async def _bounded_close(close: Callable[[], Awaitable[None]]) -> None:
    with trio.move_on_after(CLOSE_S, shield=True):
        await close()


async def _open_backends(
    config: Config, stack: AsyncExitStack,
) -> tuple[Store, EventLog, RedisClient | None]:
    """The store and the event log (closed by `stack`, the log first): the embedded
    SQLite pair, or with [cluster] PostgreSQL and the Redis stream (CONTRACT §13)."""
    server, cluster = config.server, config.cluster
    if cluster is None:
        store: Store = await open_store(server)
        stack.push_async_callback(_bounded_close, store.aclose)
        event_log: EventLog = await SqliteEventLog.open(
            server.data_dir / "events.db", retention_events=server.retention_events,
            retention_bytes=server.retention_bytes, flush_ms=server.event_flush_ms,
            seq_floor=await store.seq_reserved() or 0, mirror=store.set_seq_reserved,
            pending_bytes=server.event_log_pending_bytes,
            read_timeout_s=server.store_busy_timeout_s,
        )
        stack.push_async_callback(_bounded_close, event_log.aclose)
        return store, event_log, None
    from daemon.eventlog.redis import RedisEventLog
    from daemon.redisconn import connect

    # Nothing of the store is here, but the workspaces (by default) and claude-cli's home.
    server.data_dir.mkdir(parents=True, exist_ok=True)
    cluster_store = await open_store(server, cluster)
    stack.push_async_callback(_bounded_close, cluster_store.aclose)
    redis = await stack.enter_async_context(
        connect(cluster.bus, connect_timeout_s=cluster.connect_timeout_s))
    # The durable seq floor (CONTRACT §13.9): seqs are reserved in PostgreSQL ahead of
    # Redis's counter, so a Redis that lost its data never hands out a seq again.
    event_log = await RedisEventLog.open(
        redis, retention_events=cluster.retention_events,
        reserve=cluster_store.raise_seq_reserved,
        fences=cluster_store.coordination.node_fences)
    stack.push_async_callback(_bounded_close, event_log.aclose)
    return cluster_store, event_log, redis


async def _serve(
    config: Config, store: Store, event_log: EventLog, redis: RedisClient | None,
    core: trio.Nursery, stop: trio.Event, task_status: trio.TaskStatus[Daemon],
    clock: Clock = SYSTEM_CLOCK, sandbox: Sandbox | None = None, *,
    own_process: bool = False, serve_mock: ServeMock | None = None,
) -> None:
    server = config.server
    bus = Bus(event_log, queue_bytes=server.stream_queue_bytes,
              coalesce_after=server.stream_coalesce_after)
    metrics = _metrics(bus)
    metrics.known(list(config.agents), list(config.providers))  # series at 0 from the start
    sessions: SessionManager | None = None
    cluster: ClusterNode | None = None
    http_server: HttpServer | None = None
    mcp: McpManager | None = None
    tracing: Tracing = NO_TRACING
    async with AsyncExitStack() as clients_stack, trio.open_nursery() as services:
        clients = {
            name: await clients_stack.enter_async_context(open_provider_http(
                base_url=p.base_url, transport=p.transport, proxy=p.proxy,
                ca_file=p.ca_file, stall_timeout_s=p.stall_timeout_s,
                connect_timeout_s=p.connect_timeout_s,
            ))
            for name, p in config.providers.items()
        }
        for name, p in config.providers.items():
            log.info("provider %s: %s transport (%s)", name,
                     *choose_transport(p.transport, p.base_url, p.proxy))
        try:
            # CONTRACT §12.1: a TracerProvider of this daemon's own (none when off),
            # closed at the end of the stop.
            tracing = open_tracing(server.otel_endpoint, content=server.otel_content)
            metrics.add("veild_otel_dropped_total", "counter", "Spans dropped: the export "
                        "queue was full or the collector did not take them.",
                        tracing.dropped)
            await services.start(event_log.serve)
            loop_lag = LoopLag(metrics.loop_lag.set)
            await services.start(loop_lag.serve)
            mcp = McpManager(config.mcp, config.agents.values(), sandbox or Sandbox(),
                             server.data_dir / "mcp")
            metrics.add("veild_mcp_non_json_lines_total", "counter", "Lines MCP stdio "
                        "servers wrote to stdout that were not JSON-RPC (ignored).",
                        mcp.non_json_lines)
            await services.start(mcp.serve)  # each server connects in the background
            mock_roots: dict[str, str] = {}
            for name, provider in config.providers.items():
                if provider.type == "mock":
                    assert serve_mock is not None  # serve_daemon checked it
                    port = await services.start(partial(
                        serve_mock, max_context_chars=provider.max_context_chars),
                        "127.0.0.1", 0)
                    mock_roots[name] = f"http://127.0.0.1:{port}"
            tools: dict[str, Tool] = {
                t.name: t for t in (BashTool(), AgentSpawnTool(), AgentMessageTool())
            }
            turn_services = TurnServices(
                bus=bus, store=store,
                engine_for=_engine_factory(config, clients, mock_roots, metrics,
                                           sandbox or Sandbox()),
                tools=tools, metrics=metrics,
                workspaces=(config.cluster.workspaces_in(server.data_dir)
                            if config.cluster is not None else server.data_dir / "workspaces"),
                snapshots=_snapshots(config),
                grace_s=server.shutdown_grace_s,
                slots=trio.CapacityLimiter(server.max_running_turns),
                mcp=mcp, sandbox=sandbox or Sandbox(), tracing=tracing,
            )
            # A store's shielded writes (the embedded group commit's batches) end with
            # the stop's bound, so that a hung disk holds no task past it.
            store.bound_shields(partial(turn_services.stop.shielded, to_last=True,
                                        at_least=CLOSE_S / 2))
            sessions = SessionManager(config, store, bus, turn_services)
            listener = bind_socket(server.host, server.port, server.reuse_port)
            late = _Late()
            if config.cluster is not None:
                assert redis is not None
                cluster = await _join_cluster(
                    config.cluster, cast("PostgresStore", store), event_log, redis,
                    sessions, services, _listen_url(server.host, listener), stop,
                    late, server.max_running_turns,
                )
            # CONTRACT §18: a tool of the last run still running ends before any turn
            # is resumed (its call is then reported stopped, never run again).
            survivors.use(server.data_dir / "tools")
            ended = await trio.to_thread.run_sync(survivors.end_survivors,
                                                  server.data_dir / "tools")
            limiter = (sandbox or Sandbox()).limiter
            if limiter.mode == "cgroup" and limiter.tools is not None:
                # And every call's cgroup the last run left (§16.1): all it holds.
                ended += await trio.to_thread.run_sync(sweep_calls, limiter.tools)
            elif limiter.track is not None:  # issue 44: what a dead supervisor left
                ended += await trio.to_thread.run_sync(sweep_orphaned, limiter.track)
            if ended:
                log.warning("ended %d tool processes of the last run", ended)
            # CONTRACT §19: interrupted workspace swaps and rewinds settled before any
            # turn (a session this node does not own is its owner's to settle).
            await Rewinds(sessions).settle()
            await core.start(sessions.serve)
            await services.start(serve_pruner, sessions, server.keep_days, clock)
            # A service (it stops after the turns it started have ended `shutdown`,
            # so it records their outcome); its turns run in the session manager.
            scheduler = Scheduler(config.schedules, store, SessionLauncher(sessions),
                                  SystemClock(), stop=turn_services.stop)
            if cluster is None:
                await services.start(scheduler.serve)
            else:  # a schedule ticks on one node of the cluster (CONTRACT §13.5)
                await services.start(cluster.serve_leader, SCHEDULER_LOCK, scheduler.serve)
                await services.start(cluster.serve_sweeper, sessions)
            runtime = late.value = Runtime(config, store, bus, sessions, mcp, scheduler,
                                           clock, loop_lag.worst_recent)
            connections = Connections()
            http_server = HttpServer(
                build_app(runtime, connections, metrics),
                listener,
                connections,
                fast=health_fast_path(runtime),  # /health answered first (issue 46)
            )
            await core.start(http_server.serve)
            daemon = Daemon(runtime, http_server, server.host, stop, metrics, loop_lag,
                            tracing)
            await services.start(serve_watchdog, lambda: metrics.running)
            await services.start(serve_status, metrics.wait_running_changed)
            if own_process:
                freeze_startup_objects()
            notify("READY=1")
            task_status.started(daemon)
            await stop.wait()
        finally:
            # Also when a service crashed: the core (sessions, HTTP) still runs here, so
            # turns end `shutdown` and WebSockets get 1001. The services and the HTTP
            # client outlive the turns they serve.
            deadline = trio.current_time() + STOP_BUDGET_S
            with trio.CancelScope(deadline=deadline, shield=True):
                notify("STOPPING=1")
                if mcp is not None:
                    mcp.request_stop()  # servers stop while the turns end
                if http_server is not None:
                    http_server.stop_accepting()
                if sessions is not None:
                    await sessions.shutdown(deadline - 1.0)  # leave connections a second
                if cluster is not None:
                    with trio.move_on_at(deadline - 0.5):
                        await cluster.leave()  # its sessions are free for other nodes
                bus.close_all("shutdown")
                if http_server is not None:
                    left = max(0.0, deadline - trio.current_time() - 0.2)
                    await http_server.close(min(server.client_close_grace_s, left))
                # The turns' last spans go out, within what is left (bounded, shielded).
                await tracing.aclose(max(0.05, min(CLOSE_S / 2,
                                                   deadline - trio.current_time())))
            services.cancel_scope.cancel()
    if cluster is not None and cluster.fenced:
        # Swept while it lived (CONTRACT §13.8): it stopped publishing for those turns;
        # the daemon exits 1 with this line (a restart rejoins with a new epoch).
        raise Fenced(cluster.node_id, cluster.epoch)
