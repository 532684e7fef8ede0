"""TOML configuration -> frozen, validated objects.

Every error names the file, the key and what is wrong (CONTRACT §2); unknown keys are
errors too, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from daemon.errors import ConfigError
from daemon.hosts import configured_host, is_loopback, normalise_origin
from daemon.timing import Every, Timing, TimingError, parse_cron, parse_every, parse_zone

DEFAULT_CONFIG_PATH = Path("config/daemon.toml")
ENGINES = ("openai", "claude-cli", "anthropic")  # the names CONTRACT §2 reserves
PROVIDER_TYPES = ("openai", "anthropic", "mock")
TRANSPORTS = ("auto", "lean", "httpx")  # how a provider's stream is read
# Which provider types each engine can talk to (the mock speaks both APIs).
ENGINE_PROVIDERS = {"openai": ("openai", "mock"), "anthropic": ("anthropic", "mock")}
TOOL_NAMES = ("bash", "agent_spawn", "agent_message")
# CONTRACT §10: an MCP server's name: lowercase letters, digits, - and _, no "__" (the
# separator of the NAME__TOOL names the model sees).
MCP_NAME = re.compile(r"[a-z0-9_-]+")
MAX_RESULT_BYTES_LIMIT = 64 << 20
LOG_FORMATS = ("text", "json")
SANDBOX_MODES = ("auto", "bwrap", "none")  # CONTRACT §16
# An environment variable's name, as `env` / `env_pass` take it.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ToolLimits:
    """CONTRACT §16.1: what one tool call's processes may use together: memory (MiB),
    processes and threads at once, CPU seconds (0: no limit), and the bytes of each of
    its streams published as `tool.chunk`."""

    memory_mb: int = 2048
    pids: int = 512
    cpu_s: float = 0.0
    stream_bytes: int = 4 * 1024 * 1024


LIMIT_KEYS = ("tool_memory_mb", "tool_pids", "tool_cpu_s", "tool_stream_bytes")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7433
    # Issue 46 item 6: SO_REUSEPORT on the listener, so that several cluster nodes on
    # one host share `port` and the kernel deals new connections among them (only with
    # [cluster]: each embedded daemon has a store of its own).
    reuse_port: bool = False
    data_dir: Path = Path("./var")
    auth_token_env: str | None = None
    max_depth: int = 4
    # Deliveries one session's inbox holds before the next is refused (409, CONTRACT §6).
    inbox_max: int = 1000
    # CONTRACT §6: at most this many turns run at once; another waits for a slot (a
    # waiting spawn's child runs in its parent's slot, so a tree cannot deadlock).
    max_running_turns: int = 4096
    # CONTRACT §7: each WebSocket or SSE connection's queue holds at most this many
    # bytes of events before the client is closed as lagged (1013) ...
    stream_queue_bytes: int = 16 * 1024 * 1024
    # ... and once it holds more than this many events, adjacent chunks of one turn at
    # its tail are merged (`seqFrom`), so a client that is behind catches up.
    stream_coalesce_after: int = 512
    # The durable event log (data_dir/events.db) keeps this many recent seqs for
    # `since` / Last-Event-ID replay, also across restarts ...
    retention_events: int = 200_000
    # ... and never more than this many bytes of stored JSON;
    retention_bytes: int = 256 * 1024 * 1024
    # it writes what was published at least this often (one transaction per flush);
    event_flush_ms: float = 50.0
    # what waits for a slow disk is at most this many bytes (the events' size in
    # memory); past it the oldest waiting events are given up for the log (live clients
    # got them; a replay reports a stream.gap), logged and counted.
    event_log_pending_bytes: int = 64 * 1024 * 1024
    # How long a turn may take to publish its terminal after shutdown cancels it.
    shutdown_grace_s: float = 5.0
    # How long a lagged or closing client gets to take its close frame before its
    # connection is aborted (a client that never reads must not pin the daemon).
    client_close_grace_s: float = 5.0
    # How long a store call may wait for the database (a lock another process holds)
    # before the request that needs it answers 503 UNAVAILABLE.
    store_busy_timeout_s: float = 5.0
    # CONTRACT §3.1: Host names (besides loopback and `host`) the daemon answers to,
    # exact origins (besides local ones) whose pages may use it, and the explicit
    # opt-out that lets a non-loopback `host` run without a token.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allow_unauthenticated: bool = False
    # CONTRACT §12: log lines on stderr as "text" or "json"; None = text on a terminal,
    # JSON lines otherwise.
    log_format: str | None = None
    # CONTRACT §12: idle trees whose last update is older than this many days are
    # deleted at start and daily; 0 keeps everything.
    keep_days: int = 0
    # CONTRACT §16: how each bash call is confined: "auto" (bubblewrap when it works
    # here, tried once at start), "bwrap" (must work, else exit 2) or "none"; and more
    # paths the sandbox hides, beyond the data dir, the config's dir and the home.
    sandbox: str = "auto"
    sandbox_hide: tuple[Path, ...] = ()
    # CONTRACT §16 (issue 42): read-only paths a sandboxed call sees besides the
    # system's own (the sandbox binds an allowlist, daemon/toolproc/sandbox.py).
    sandbox_allow: tuple[Path, ...] = ()
    # CONTRACT §16.1: every tool process's limits (an agent's own values win).
    tool_limits: ToolLimits = field(default_factory=lambda: ToolLimits())
    # CONTRACT §12.1: the OTLP/HTTP collector traces go to (its base URL; None: the
    # OTEL_EXPORTER_OTLP_* variables, else no traces), and whether spans hold content.
    otel_endpoint: str | None = None
    otel_content: bool = False
    # CONTRACT §19: each turn's workspace kept before it runs (rewind, fork), unless the
    # workspace's files add up to more than `snapshot_max_bytes`; `snapshot_keep` per
    # session (older ones dropped).
    snapshots: bool = True
    snapshot_max_bytes: int = 256 * 1024 * 1024
    snapshot_keep: int = 100
    # CONTRACT §18: turns left open by the last process are resumed at start ("auto")
    # or ended INTERRUPTED ("off", v3); at most `resume_max` times each, and only when
    # their last stored progress is at most `resume_within_s` old. A stop gives running
    # turns `drain_s` to reach a stored step, then suspends them (resumed next start).
    resume: str = "auto"
    resume_max: int = 2
    resume_within_s: float = 86400.0
    drain_s: float = 5.0

    @property
    def resuming(self) -> bool:
        return self.resume == "auto"

    @property
    def auth_token(self) -> str | None:
        if not self.auth_token_env:
            return None
        return os.environ.get(self.auth_token_env) or None


@dataclass(frozen=True)
class ProviderConfig:
    name: str
    type: str
    base_url: str = ""
    api_key_env: str | None = None
    # Silence (no byte) before the response headers or mid-stream that ends the turn in
    # PROVIDER_ERROR, and how long connecting may take (CONTRACT §5.8).
    stall_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    # How the stream is read: "auto" (the lean transport unless a proxy applies), "lean"
    # or "httpx" (daemon.llm.provider_http); a proxy URL (httpx only); a CA bundle
    # that replaces the system's CAs for this provider's TLS.
    transport: str = "auto"
    proxy: str | None = None
    ca_file: str | None = None
    # CONTRACT §14: a call that failed transiently before anything of it was published
    # is retried up to max_retries times, waiting retry_initial_ms doubled each time up
    # to retry_max_ms (full jitter), or what the provider's Retry-After asks when that
    # is at most retry_after_max_s; at most max_concurrent requests in flight (0: any).
    max_retries: int = 4
    retry_initial_ms: float = 500.0
    retry_max_ms: float = 30_000.0
    retry_after_max_s: float = 120.0
    max_concurrent: int = 0
    # CONTRACT §14.1: the Chat Completions key the output cap is sent as.
    max_tokens_key: str = "max_tokens"
    # A mock provider only: it refuses, as a real API does for its length (CONTRACT
    # §15), a request whose messages hold more than this many characters (0: never).
    max_context_chars: int = 0
    # CONTRACT §12.1 (v4): the `gen_ai.provider.name` its calls' spans carry; "": the
    # convention's well-known value for its type and host (`gen_ai_provider`).
    otel_provider_name: str = ""

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @property
    def gen_ai_provider(self) -> str:
        """The GenAI semantic conventions' `gen_ai.provider.name` for this provider:
        `otel_provider_name` when set, else the well-known value its host or type
        says (`openai` for any other server speaking Chat Completions)."""
        if self.otel_provider_name:
            return self.otel_provider_name
        if self.type == "anthropic":
            return "anthropic"
        host = urlsplit(self.base_url).hostname or ""
        for suffix, name in _GEN_AI_HOSTS:
            if host == suffix or host.endswith("." + suffix):
                return name
        return "openai"


# Hosts whose API has its own well-known `gen_ai.provider.name` (GenAI conventions).
_GEN_AI_HOSTS = (
    ("openai.azure.com", "azure.ai.openai"), ("services.ai.azure.com", "azure.ai.inference"),
    ("generativelanguage.googleapis.com", "gcp.gemini"), ("aiplatform.googleapis.com",
                                                          "gcp.vertex_ai"),
    ("amazonaws.com", "aws.bedrock"), ("mistral.ai", "mistral_ai"),
    ("deepseek.com", "deepseek"), ("groq.com", "groq"), ("x.ai", "x_ai"),
    ("perplexity.ai", "perplexity"), ("cohere.com", "cohere"), ("cohere.ai", "cohere"),
    ("anthropic.com", "anthropic"),
)


@dataclass(frozen=True)
class AgentConfig:
    name: str
    engine: str = "openai"
    provider: str | None = None
    model: str = ""
    system: str = "You are a helpful assistant."
    tools: tuple[str, ...] = ()
    max_iterations: int = 20
    budget_tokens: int = 0
    # Tool calls one LLM answer may run; each one past it gets an error result instead.
    max_tool_calls: int = 32
    # bash tool limits: default timeout and how much output a result keeps.
    bash_timeout_s: float = 120.0
    bash_max_output_bytes: int = 256 * 1024
    # anthropic engine: the answer's token limit, and extended thinking (0 = off).
    max_tokens: int = 8192
    thinking_budget: int = 0
    # CONTRACT §14.1: the output cap sent with every call (0: none; the anthropic
    # engine then sends max_tokens, which its API requires).
    max_output_tokens: int = 0
    # claude-cli engine: the executable, extra arguments, its HOME (default: the
    # session's workspace), and how long it may print nothing before the turn ends in
    # PROVIDER_ERROR. `env`: what every tool process of the agent gets (CONTRACT §16).
    command: str = "claude"
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    home: Path | None = None
    stall_timeout_s: float = 300.0
    # CONTRACT §9: shell-style patterns (fnmatch) over a tool's name and, for an MCP
    # tool, also `mcp:NAME/TOOL`: calls of `approve` tools wait for a person, `deny`
    # tools are not offered (deny wins); how long a request waits (0 = no limit).
    approve: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    approval_timeout_s: float = 0.0
    # CONTRACT §16: what of the daemon's environment its tool processes get besides the
    # minimal base and `env` (names copied when set); whether its sandboxed bash may use
    # the network; `sandbox = false` runs its bash unsandboxed (the escape hatch).
    env_pass: tuple[str, ...] = ()
    network: bool = False
    sandbox: bool = True
    # CONTRACT §16.1: this agent's own tool_* limits, by key; the rest are [server]'s.
    tool_limits_set: Mapping[str, Any] = field(default_factory=dict)
    # CONTRACT §14: where a call goes once its retries on the agent's provider are
    # exhausted, in order: (provider, model); model None = the agent's.
    fallback: tuple[tuple[str, str | None], ...] = ()
    # CONTRACT §15: the model's window in tokens (0: no compaction), the share of it
    # past which a call is compacted first, the most recent tokens never pruned or
    # summarised (None: a quarter of the window), and where the summarising call goes
    # (provider, model); None: the agent's own provider and model.
    context_tokens: int = 128_000
    compact_at: float = 0.8
    compact_keep_tokens_set: int | None = None
    compact_model: tuple[str, str] | None = None

    @property
    def compact_keep_tokens(self) -> int:
        if self.compact_keep_tokens_set is not None:
            return self.compact_keep_tokens_set
        return self.context_tokens // 4


@dataclass(frozen=True)
class McpServerConfig:
    """`[mcp.NAME]` (CONTRACT §10): a stdio server (`command`) or Streamable HTTP (`url`)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path = Path(".")
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Initialize and the first tool list must finish within this ...
    startup_timeout_s: float = 30.0
    # ... and one tool call within this (progress does not extend it).
    call_timeout_s: float = 300.0
    # CONTRACT §16: names copied from the daemon's environment (when set) into a stdio
    # server's, on top of the MCP SDK's default inherited set and `env`.
    env_pass: tuple[str, ...] = ()
    # CONTRACT §16.1: a stdio server in the sandbox (its own workspace), with network
    # unless `network = false`; it runs under [server]'s tool limits either way.
    sandbox: bool = False
    network: bool = True
    # A tool result's text is cut to this (with a note), and no message of the server's
    # is read whole past 4 x this (at least 1 MiB): daemon/mcp/bound.py.
    max_result_bytes: int = 256 * 1024


@dataclass(frozen=True)
class ScheduleConfig:
    """`[schedules.NAME]` (CONTRACT §11)."""

    name: str
    agent: str
    message: str
    timing: Timing  # from `every`, or `cron` + `timezone`
    timezone: str = "UTC"
    session: str = "new"  # "new" | "same": every run continues one session
    enabled: bool = True
    catch_up: bool = True


@dataclass(frozen=True)
class ClusterConfig:
    """`[cluster]` (CONTRACT §13): this daemon is one node of several on one PostgreSQL
    store and one Redis bus."""

    store: str  # postgresql://user:password@host:port/db
    bus: str  # redis://… or rediss://…, a password and a db index allowed
    node_id: str  # unique among live nodes; default HOST-PID
    # A node heartbeats every lease_s/3; one silent for lease_s is dead (swept).
    lease_s: float = 15.0
    # Seqs the bus's stream keeps for `since=` replay, cluster-wide.
    retention_events: int = 1_000_000
    # How long a starting node retries an unreachable store or bus before exit 1.
    connect_timeout_s: float = 10.0
    # Sessions' working directories; None = data_dir/workspaces (a shared filesystem
    # lets files follow a session across nodes).
    workspaces: Path | None = None

    def workspaces_in(self, data_dir: Path) -> Path:
        return self.workspaces if self.workspaces is not None else data_dir / "workspaces"

    def snapshots_in(self, data_dir: Path) -> Path:
        """CONTRACT §19: the snapshots beside the workspaces (`WORKSPACES.snapshots`,
        on the same shared filesystem); data_dir/snapshots by default."""
        if self.workspaces is None:
            return data_dir / "snapshots"
        return self.workspaces.with_name(self.workspaces.name + ".snapshots")


def redact_url(url: str) -> str:
    """`url` without its password, for messages and logs: the user info's (`u:***@`) and
    a `password=` query parameter's (libpq and Redis URLs take one there too)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = next((i for i, ch in enumerate(rest) if ch in "/?#"), len(rest))
    authority, tail = rest[:end], _QUERY_PASSWORD.sub(r"\1***", rest[end:])
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        authority = f"{userinfo.split(':', 1)[0]}:***@{host}"
    return f"{scheme}://{authority}{tail}"


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


@dataclass(frozen=True)
class Config:
    path: Path
    server: ServerConfig = field(default_factory=ServerConfig)
    providers: Mapping[str, ProviderConfig] = field(default_factory=dict)
    agents: Mapping[str, AgentConfig] = field(default_factory=dict)
    mcp: Mapping[str, McpServerConfig] = field(default_factory=dict)
    schedules: Mapping[str, ScheduleConfig] = field(default_factory=dict)
    cluster: ClusterConfig | None = None  # None: the embedded SQLite store and bus

    @property
    def resuming(self) -> bool:
        """CONTRACT §18 is in force: `resume = "auto"` (with [cluster] too: the sweeping
        node resumes a lost node's turns, cluster/takeover.py)."""
        return self.server.resuming

    def with_overrides(
        self, *, host: str | None = None, port: int | None = None, data_dir: str | None = None
    ) -> Config:
        server = self.server
        if host is not None:
            server = replace(server, host=bind_host(host))
        if port is not None:
            server = replace(server, port=port)
        if data_dir is not None:
            server = replace(server, data_dir=Path(data_dir))
        return replace(self, server=server)


# Every duration key is finite and at most a year: past that a timeout is a typo, and
# NaN, inf or 1e308 s overflow what they become (ms integers, deadlines, SQLite's).
MAX_SECONDS = 365 * 86_400.0
# SQLite takes its busy timeout as a C int of milliseconds (more reads as 0: no wait).
MAX_BUSY_TIMEOUT_S = 2_147_483.0
MAX_KEEP_DAYS = 36_500


class _Reader:
    """Reads typed keys out of one TOML table, naming file and key on every error."""

    def __init__(self, file: str, prefix: str, table: Mapping[str, Any]) -> None:
        self.file, self.prefix, self.table = file, prefix, table
        self.seen: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(self.file, self._key(key), message)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        self.seen.add(key)
        if key not in self.table:
            return default
        value = self.table[key]
        # bool is an int in Python; a port of `true` is still wrong.
        if isinstance(value, bool) and kind is not bool and bool not in _as_tuple(kind):
            raise self.fail(key, f"expected {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise self.fail(key, f"expected {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def positive_seconds(self, key: str, default: float, *,
                         maximum: float = MAX_SECONDS) -> float:
        value = float(self.get(key, (int, float), default))
        if not 0 < value <= maximum:  # NaN and inf fail here too
            raise self.fail(key, f"must be a positive number of seconds up to "
                                 f"{maximum:g}, got {value:g}")
        return value

    def seconds(self, key: str, default: float) -> float:
        """A duration where 0 means none (a grace, a timeout turned off)."""
        value = float(self.get(key, (int, float), default))
        if not 0 <= value <= MAX_SECONDS:
            raise self.fail(key, f"must be 0 or a positive number of seconds up to "
                                 f"{MAX_SECONDS:g}, got {value:g}")
        return value

    def positive_int(self, key: str, default: int, *, minimum: int = 1,
                     maximum: int | None = None) -> int:
        value: int = self.get(key, int, default)
        if value < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be at most {maximum}, got {value}")
        return value

    def check_unknown(self) -> None:
        for key in self.table:
            if key not in self.seen:
                raise self.fail(key, "unknown key")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(str(path), "-", "file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "-", f"not valid TOML: {exc}") from exc


def _server(file: str, table: Any) -> ServerConfig:
    if not isinstance(table, dict):
        raise ConfigError(file, "server", "must be a table")
    r = _Reader(file, "server", table)
    port = r.get("port", int, 7433)
    if not 0 <= port <= 65535:
        raise r.fail("port", f"must be 0..65535, got {port}")
    # Relative to the working directory, like any path given on a command line.
    data_dir = Path(r.get("data_dir", str, "./var"))
    cfg = ServerConfig(
        host=bind_host(r.get("host", str, "127.0.0.1")),
        port=port,
        reuse_port=r.get("reuse_port", bool, False),
        data_dir=data_dir,
        auth_token_env=r.get("auth_token_env", str, None),
        max_depth=r.positive_int("max_depth", 4, minimum=0),
        inbox_max=r.positive_int("inbox_max", 1000),
        max_running_turns=r.positive_int("max_running_turns", 4096),
        stream_queue_bytes=r.positive_int("stream_queue_bytes", 16 * 1024 * 1024,
                                          minimum=1024),
        stream_coalesce_after=r.positive_int("stream_coalesce_after", 512, minimum=0),
        retention_events=r.positive_int("retention_events", 200_000),
        retention_bytes=r.positive_int("retention_bytes", 256 * 1024 * 1024),
        event_flush_ms=_positive_float(r, "event_flush_ms", 50.0),
        event_log_pending_bytes=r.positive_int("event_log_pending_bytes", 64 * 1024 * 1024,
                                               minimum=1024 * 1024),
        shutdown_grace_s=r.seconds("shutdown_grace_s", 5.0),
        client_close_grace_s=r.seconds("client_close_grace_s", 5.0),
        store_busy_timeout_s=r.positive_seconds("store_busy_timeout_s", 5.0,
                                                maximum=MAX_BUSY_TIMEOUT_S),
        allowed_hosts=_hosts(r, "allowed_hosts"),
        allowed_origins=_origins(r, "allowed_origins"),
        allow_unauthenticated=r.get("allow_unauthenticated", bool, False),
        log_format=_log_format(r),
        keep_days=r.positive_int("keep_days", 0, minimum=0, maximum=MAX_KEEP_DAYS),
        sandbox=_sandbox_mode(r),
        sandbox_hide=_absolute_paths(r, "sandbox_hide"),
        sandbox_allow=_absolute_paths(r, "sandbox_allow"),
        tool_limits=ToolLimits(**_tool_limits(r)),
        otel_endpoint=_otel_endpoint(r),
        otel_content=r.get("otel_content", bool, False),
        resume=_resume_mode(r),
        resume_max=r.positive_int("resume_max", 2, minimum=0),
        resume_within_s=r.positive_seconds("resume_within_s", 86400.0),
        drain_s=_drain_s(r),
        snapshots=r.get("snapshots", bool, True),
        snapshot_max_bytes=r.positive_int("snapshot_max_bytes", 256 * 1024 * 1024,
                                          minimum=0),
        snapshot_keep=r.positive_int("snapshot_keep", 100),
    )
    r.check_unknown()
    return cfg


def _otel_endpoint(r: _Reader) -> str | None:
    value: str | None = r.get("otel_endpoint", str, None)
    if value is None or not value.strip():
        return None
    value = value.strip()
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise r.fail("otel_endpoint", "must be an http:// or https:// URL of an OTLP/HTTP "
                                      f"collector (e.g. http://127.0.0.1:4318), got {value!r}")
    return value


MAX_TOOL_MEMORY_MB = 1 << 30
MAX_TOOL_PIDS = 4_194_304


def _tool_limits(r: _Reader) -> dict[str, Any]:
    """The `tool_*` keys of one table that are there (CONTRACT §16.1), as ToolLimits'
    fields: memory in MiB (at least 16), tasks (at least 8), CPU seconds (0: none),
    stream bytes (at least 1 KiB)."""
    found: dict[str, Any] = {}
    if "tool_memory_mb" in r.table:
        found["memory_mb"] = r.positive_int("tool_memory_mb", 2048, minimum=16,
                                            maximum=MAX_TOOL_MEMORY_MB)
    if "tool_pids" in r.table:
        found["pids"] = r.positive_int("tool_pids", 512, minimum=8, maximum=MAX_TOOL_PIDS)
    if "tool_cpu_s" in r.table:
        found["cpu_s"] = r.seconds("tool_cpu_s", 0.0)
    if "tool_stream_bytes" in r.table:
        found["stream_bytes"] = r.positive_int("tool_stream_bytes", 4 << 20, minimum=1024)
    return found


def agent_limits(server: ToolLimits, agent: AgentConfig) -> ToolLimits:
    """The limits of `agent`'s tool calls: its own `tool_*` values, else [server]'s."""
    return replace(server, **agent.tool_limits_set)


def _resume_mode(r: _Reader) -> str:
    value: str = r.get("resume", str, "auto")
    if value not in ("auto", "off"):
        raise r.fail("resume", f'must be "auto" or "off", got {value!r}')
    return value


# CONTRACT §1: the daemon exits within 10 s of SIGTERM; the drain leaves room for the
# suspends, the store's last writes and closing the listeners.
MAX_DRAIN_S = 8.0


def _drain_s(r: _Reader) -> float:
    value = r.seconds("drain_s", 5.0)
    if value > MAX_DRAIN_S:
        raise r.fail("drain_s", f"must be at most {MAX_DRAIN_S:g} (a stop ends within "
                                f"10 s), got {value:g}")
    return value


def _sandbox_mode(r: _Reader) -> str:
    value: str = r.get("sandbox", str, "auto")
    if value not in SANDBOX_MODES:
        raise r.fail("sandbox", f'must be "auto", "bwrap" or "none", got {value!r}')
    return value


def _absolute_paths(r: _Reader, key: str) -> tuple[Path, ...]:
    paths = []
    for value in _strings(r, key):
        path = Path(value)
        if not path.is_absolute():
            raise r.fail(key, f"{value!r} is not an absolute path")
        paths.append(path)
    return tuple(paths)


def _env_names(r: _Reader, key: str) -> tuple[str, ...]:
    names = r.get(key, list, [])
    for name in names:
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise r.fail(key, f"expected environment variable names, got {name!r}")
    return tuple(names)


def _env_table(r: _Reader, key: str) -> dict[str, str]:
    table = _string_table(r, key)
    for name in table:
        if not ENV_NAME.fullmatch(name):
            raise r.fail(key, f"{name!r} is not an environment variable name")
    return table


def _log_format(r: _Reader) -> str | None:
    value: str | None = r.get("log_format", str, None)
    if value is not None and value not in LOG_FORMATS:
        raise r.fail("log_format", f'must be "text" or "json", got {value!r}')
    return value


def _positive_float(r: _Reader, key: str, default: float) -> float:
    value = float(r.get(key, (int, float), default))
    if not 0 < value <= MAX_SECONDS * 1000:  # NaN and inf fail here too
        raise r.fail(key, f"must be above 0 and at most {MAX_SECONDS * 1000:g}, got {value:g}")
    return value


def _strings(r: _Reader, key: str) -> list[str]:
    values = r.get(key, list, [])
    if not all(isinstance(v, str) and v.strip() for v in values):
        raise r.fail(key, "must be a list of non-empty strings")
    return [v.strip() for v in values]


def _hosts(r: _Reader, key: str) -> tuple[str, ...]:
    hosts = _strings(r, key)
    for host in hosts:
        if any(c in host for c in "/?#@ ") or host == "*":
            raise r.fail(key, f"{host!r} is not a host name (no scheme, path or wildcard)")
    return tuple(hosts)


def _origins(r: _Reader, key: str) -> tuple[str, ...]:
    origins = _strings(r, key)
    for origin in origins:
        if normalise_origin(origin) is None:
            raise r.fail(key, f"{origin!r} is not an origin like https://app.example:8443")
    return tuple(origins)


def bind_host(host: str) -> str:
    """The address the socket binds: an IPv6 literal written as in a URL (`[::1]`)
    without its brackets; the daemon's URL puts them back."""
    inner = host.strip()
    if inner.startswith("[") and inner.endswith("]") and ":" in inner:
        return inner[1:-1]
    return host


def exposure_warning(config: Config) -> str | None:
    """The start's WARNING when `allow_unauthenticated` is what lets a non-loopback
    `host` run without a token (docs/security.md): it must not go unnoticed."""
    server = config.server
    if server.auth_token is None and server.allow_unauthenticated and not is_loopback(
        configured_host(server.host)
    ):
        return (f"serving {server.host!r}, not a loopback address, without a token "
                "(allow_unauthenticated = true): anyone who can reach it can run shell "
                "commands, unless something in front of veild decides who connects "
                "(docs/security.md)")
    return None


def check_exposure(config: Config) -> None:
    """CONTRACT §3.1: a non-loopback `host` without a token does not start, unless the
    operator said so in `allow_unauthenticated`."""
    server = config.server
    if server.auth_token is None and not server.allow_unauthenticated and not is_loopback(
        configured_host(server.host)
    ):
        via = (f"${server.auth_token_env} is not set" if server.auth_token_env
               else "server.auth_token_env is not set")
        raise ConfigError(str(config.path), "server.host", (
            f"{server.host!r} is not a loopback address and no token is set ({via}); "
            "anyone who can reach it could run shell commands. Set a token, or "
            "allow_unauthenticated = true behind your own auth"))


def _provider(file: str, name: str, table: Any) -> ProviderConfig:
    if not isinstance(table, dict):
        raise ConfigError(file, f"providers.{name}", "must be a table")
    r = _Reader(file, f"providers.{name}", table)
    kind = r.get("type", str, None)
    if kind is None:
        raise r.fail("type", "is required")
    if kind not in PROVIDER_TYPES:
        raise r.fail("type", f"must be one of {', '.join(PROVIDER_TYPES)}, got {kind!r}")
    base_url = r.get("base_url", str, "https://api.anthropic.com" if kind == "anthropic" else "")
    if kind == "openai" and not base_url.startswith(("http://", "https://")):
        raise r.fail("base_url", "is required: an http(s) URL ending before /chat/completions")
    if kind == "anthropic" and not base_url.startswith(("http://", "https://")):
        raise r.fail("base_url", "must be an http(s) URL ending before /v1/messages")
    cfg = ProviderConfig(
        name=name, type=kind, base_url=base_url.rstrip("/"),
        api_key_env=r.get("api_key_env", str, None),
        stall_timeout_s=r.positive_seconds("stall_timeout_s", 120.0),
        connect_timeout_s=r.positive_seconds("connect_timeout_s", 10.0),
        **_transport(r),
        **_retries(r),
        max_tokens_key=_one_of(r, "max_tokens_key", MAX_TOKENS_KEYS),
        otel_provider_name=r.get("otel_provider_name", str, ""),
    )
    if kind == "mock":
        cfg = replace(cfg, max_context_chars=r.positive_int("max_context_chars", 0, minimum=0))
    r.check_unknown()
    return cfg


MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens")


def _one_of(r: _Reader, key: str, choices: tuple[str, ...]) -> str:
    value: str = r.get(key, str, choices[0])
    if value not in choices:
        raise r.fail(key, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _retries(r: _Reader) -> dict[str, Any]:
    initial = float(r.get("retry_initial_ms", (int, float), 500))
    maximum = float(r.get("retry_max_ms", (int, float), 30_000))
    if not 0 <= initial <= maximum or maximum == float("inf"):
        key = "retry_initial_ms" if initial < 0 or initial > maximum else "retry_max_ms"
        raise r.fail(key, f"needs 0 <= retry_initial_ms <= retry_max_ms, got {initial:g} "
                          f"and {maximum:g}")
    after = float(r.get("retry_after_max_s", (int, float), 120))
    if not 0 <= after < float("inf"):
        raise r.fail("retry_after_max_s", f"must be 0 or more seconds, got {after:g}")
    return {"max_retries": r.positive_int("max_retries", 4, minimum=0),
            "retry_initial_ms": initial, "retry_max_ms": maximum,
            "retry_after_max_s": after,
            "max_concurrent": r.positive_int("max_concurrent", 0, minimum=0)}


def _check_provider(r: _Reader, key: str, what: str, engine: str, name: str,
                    providers: Mapping[str, ProviderConfig]) -> None:
    """`name` is a configured provider of a type `engine` speaks."""
    if name not in providers:
        raise r.fail(key, f"{what}no [providers.{name}] is configured")
    kinds = ENGINE_PROVIDERS[engine]
    if providers[name].type not in kinds:
        raise r.fail(key, f"{what}the {engine} engine needs a provider of type "
                          f"{' or '.join(kinds)}, [providers.{name}] is {providers[name].type}")


def _fallback(r: _Reader, engine: str, providers: Mapping[str, ProviderConfig]
              ) -> tuple[tuple[str, str | None], ...]:
    """`fallback = ["PROVIDER", "PROVIDER:MODEL", …]`: each provider configured and of
    a type the agent's engine speaks."""
    entries = _strings(r, "fallback")
    if entries and engine not in ENGINE_PROVIDERS:
        raise r.fail("fallback", f"the {engine} engine calls no provider of veild's")
    out: list[tuple[str, str | None]] = []
    for entry in entries:
        name, sep, model = entry.partition(":")
        if sep and not model:
            raise r.fail("fallback", f"{entry!r}: expected PROVIDER or PROVIDER:MODEL")
        _check_provider(r, "fallback", f"{entry!r}: ", engine, name, providers)
        out.append((name, model or None))
    return tuple(out)


CONTEXT_KEYS = ("context_tokens", "compact_at", "compact_keep_tokens", "compact_model")


def _context(r: _Reader, engine: str, provider: str | None, model: str,
             providers: Mapping[str, ProviderConfig]) -> dict[str, Any]:
    """CONTRACT §15's keys. `compact_model` is "PROVIDER:MODEL", "PROVIDER" (its model:
    the agent's) or "MODEL" (on the agent's provider); the provider must speak the
    agent's engine, as a fallback's must."""
    if engine not in ENGINE_PROVIDERS:
        for key in CONTEXT_KEYS:
            if key in r.table:
                # The CLI keeps its own context (and compacts it itself): a key that
                # looked applied but was not would be worse than none.
                raise r.fail(key, f"the {engine} engine keeps its own context; veild "
                                  "does not compact it")
        return {"context_tokens": 0}
    window = r.positive_int("context_tokens", 128_000, minimum=0)
    at = r.get("compact_at", (int, float), 0.8)
    if isinstance(at, bool) or not 0 < float(at) <= 1:
        raise r.fail("compact_at", f"must be a share of the window, above 0 and at most 1, "
                                   f"got {at!r}")
    keep = r.positive_int("compact_keep_tokens", window // 4, minimum=0)
    if window and keep >= float(at) * window:
        raise r.fail("compact_keep_tokens", f"must be below compact_at x context_tokens "
                                            f"({int(float(at) * window)}), got {keep}")
    out: dict[str, Any] = {"context_tokens": window, "compact_at": float(at)}
    if "compact_keep_tokens" in r.table:
        out["compact_keep_tokens_set"] = keep
    entry = r.get("compact_model", str, None)
    if entry is not None:
        assert provider is not None
        name, sep, named = entry.partition(":")
        if sep and name in providers:
            if not named:
                raise r.fail("compact_model", f"{entry!r}: expected PROVIDER:MODEL, "
                                              "PROVIDER or MODEL")
            target = (name, named)
        elif entry in providers:
            target = (entry, model)
        elif entry.strip():
            target = (provider, entry)
        else:
            raise r.fail("compact_model", "must name a model or a provider")
        _check_provider(r, "compact_model", f"{entry!r}: ", engine, target[0], providers)
        out["compact_model"] = target
    return out


def _string_table(r: _Reader, key: str) -> dict[str, str]:
    table = r.get(key, dict, {})
    if not all(isinstance(v, str) for v in table.values()):
        raise r.fail(key, "values must be strings")
    return dict(table)


def _mcp_server(file: str, name: str, table: Any, base: Path) -> McpServerConfig:
    prefix = f"mcp.{name}"
    if not isinstance(table, dict):
        raise ConfigError(file, prefix, "must be a table")
    if not MCP_NAME.fullmatch(name) or "__" in name or name.endswith("_"):
        # No "__" and no "_" at the end: the model's NAME__TOOL then splits at its first
        # "__", so two servers' tools never get the same name (daemon/mcp/names.py).
        raise ConfigError(file, prefix, "a server name is lowercase letters, digits, - and _ "
                                        "(no '__', not ending in '_')")
    r = _Reader(file, prefix, table)
    command = r.get("command", str, None)
    url = r.get("url", str, None)
    if (command is None) == (url is None):
        raise r.fail("command", "give exactly one of command (stdio) or url (Streamable HTTP)")
    args = r.get("args", list, [])
    if not all(isinstance(a, str) for a in args):
        raise r.fail("args", "must be a list of strings")
    cwd = base / r.get("cwd", str, ".")
    if command is not None:
        if not command:
            raise r.fail("command", "must not be empty")
        if "/" in command and not Path(command).is_absolute():
            command = str(cwd / command)  # relative to cwd; a bare name is found on PATH
    if url is not None and not url.startswith(("http://", "https://")):
        raise r.fail("url", "must be an http(s) URL")
    cfg = McpServerConfig(
        name=name, command=command, args=tuple(args), env=_env_table(r, "env"),
        cwd=cwd, url=url, headers=_string_table(r, "headers"),
        startup_timeout_s=r.positive_seconds("startup_timeout_s", 30.0),
        call_timeout_s=r.positive_seconds("call_timeout_s", 300.0),
        env_pass=_env_names(r, "env_pass"),
        sandbox=r.get("sandbox", bool, False),
        network=r.get("network", bool, True),
        max_result_bytes=r.positive_int("max_result_bytes", 256 * 1024),
    )
    if cfg.max_result_bytes > MAX_RESULT_BYTES_LIMIT:
        raise r.fail("max_result_bytes", f"must be at most {MAX_RESULT_BYTES_LIMIT}, got "
                                         f"{cfg.max_result_bytes}")
    if url is not None and (cfg.args or cfg.env or cfg.env_pass or cfg.sandbox):
        key = ("args" if cfg.args else "env" if cfg.env else "env_pass" if cfg.env_pass
               else "sandbox")
        raise r.fail(key, "only for a stdio server (command)")
    if command is not None and cfg.headers:
        raise r.fail("headers", "only for a Streamable HTTP server (url)")
    r.check_unknown()
    return cfg


def _check_tool(r: _Reader, tool: Any, mcp: Mapping[str, McpServerConfig]) -> None:
    if not isinstance(tool, str):
        raise r.fail("tools", f"expected tool names, got {tool!r}")
    if tool.startswith("mcp:"):
        server = tool[4:].split("/", 1)[0]
        if server not in mcp:
            raise r.fail("tools", f"{tool!r}: no [mcp.{server}] is configured")
        if tool.count("/") > 1 or tool.endswith("/"):
            raise r.fail("tools", f"{tool!r}: expected mcp:NAME or mcp:NAME/TOOL")
        return
    if tool not in TOOL_NAMES:
        raise r.fail("tools", f"unknown tool {tool!r} (known: {', '.join(TOOL_NAMES)}, "
                              f"mcp:NAME, mcp:NAME/TOOL)")


def _transport(r: _Reader) -> dict[str, Any]:
    transport = r.get("transport", str, "auto")
    if transport not in TRANSPORTS:
        raise r.fail("transport", f"must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    proxy = r.get("proxy", str, None)
    if proxy is not None:
        if not proxy.startswith(("http://", "https://")):
            raise r.fail("proxy", f"must be an http(s) URL, got {proxy[:100]!r}")
        if transport == "lean":
            raise r.fail("proxy", 'the lean transport does not speak to proxies: use '
                                  'transport = "auto" or "httpx"')
    ca_file = r.get("ca_file", str, None)
    if ca_file is not None:
        if not Path(ca_file).is_file():
            raise r.fail("ca_file", f"{ca_file!r} is not a file")
        try:
            ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise r.fail("ca_file", f"{ca_file!r} holds no usable CA certificate: {exc}") \
                from exc
    return {"transport": transport, "proxy": proxy, "ca_file": ca_file}


def _patterns(r: _Reader, key: str) -> tuple[str, ...]:
    """`approve` / `deny`: shell-style patterns such as "bash" or "mcp:files/*"."""
    values = r.get(key, list, [])
    if not all(isinstance(v, str) and v.strip() and v == v.strip() for v in values):
        raise r.fail(key, "must be a list of tool name patterns (non-empty strings such "
                          "as \"bash\" or \"mcp:files/*\")")
    return tuple(values)


def _non_negative_seconds(r: _Reader, key: str) -> float:
    value = float(r.get(key, (int, float), 0))
    if not 0 <= value <= MAX_SECONDS:
        raise r.fail(key, f"must be 0 (no limit) or a positive number of seconds up to "
                          f"{MAX_SECONDS:g}, got {value:g}")
    return value


def _agent(
    file: str, prefix: str, name: str, table: Any, providers: Mapping[str, ProviderConfig],
    mcp: Mapping[str, McpServerConfig] | None = None,
) -> AgentConfig:
    if not isinstance(table, dict):
        raise ConfigError(file, prefix, "must be a table")
    r = _Reader(file, prefix, table)
    engine = r.get("engine", str, "openai")
    if engine not in ENGINES:
        raise r.fail("engine", f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    provider = r.get("provider", str, None)
    if engine in ENGINE_PROVIDERS:
        if provider is None:
            raise r.fail("provider", f"is required for the {engine} engine")
        _check_provider(r, "provider", "", engine, provider, providers)
    tools = r.get("tools", list, [])
    for tool in tools:
        _check_tool(r, tool, mcp or {})
    model = r.get("model", str, "")
    if engine in ENGINE_PROVIDERS and not model:
        raise r.fail("model", "is required")
    args = r.get("args", list, [])
    if not all(isinstance(a, str) for a in args):
        raise r.fail("args", "must be a list of strings")
    env = _env_table(r, "env")
    home = r.get("home", str, None)
    cfg = AgentConfig(
        name=name,
        engine=engine,
        provider=provider,
        model=model,
        system=r.get("system", str, "You are a helpful assistant."),
        tools=tuple(tools),
        max_iterations=r.positive_int("max_iterations", 20),
        budget_tokens=r.positive_int("budget_tokens", 0, minimum=0),
        max_tool_calls=r.positive_int("max_tool_calls", 32),
        bash_timeout_s=r.positive_seconds("bash_timeout_s", 120.0),
        bash_max_output_bytes=r.positive_int("bash_max_output_bytes", 256 * 1024),
        max_tokens=r.positive_int("max_tokens", 8192),
        thinking_budget=r.positive_int("thinking_budget", 0, minimum=0),
        max_output_tokens=r.positive_int("max_output_tokens", 0, minimum=0),
        command=r.get("command", str, "claude"),
        args=tuple(args),
        env=dict(env),
        home=Path(home) if home else None,
        stall_timeout_s=r.positive_seconds("stall_timeout_s", 300.0),
        approve=_patterns(r, "approve"),
        deny=_patterns(r, "deny"),
        approval_timeout_s=_non_negative_seconds(r, "approval_timeout_s"),
        env_pass=_env_names(r, "env_pass"),
        network=r.get("network", bool, False),
        sandbox=r.get("sandbox", bool, True),
        tool_limits_set=_tool_limits(r),
        fallback=_fallback(r, engine, providers),
        **_context(r, engine, provider, model, providers),
    )
    if engine == "claude-cli" and (cfg.approve or cfg.deny):
        # The CLI runs its own tools: a rule that looked applied but was not would be
        # worse than none.
        raise r.fail("approve" if cfg.approve else "deny",
                     "the claude-cli engine runs its own tools; veild cannot hold them "
                     "for approval (use the CLI's own permission settings)")
    if cfg.thinking_budget and cfg.thinking_budget >= (cfg.max_output_tokens or cfg.max_tokens):
        key = "max_output_tokens" if cfg.max_output_tokens else "max_tokens"
        raise r.fail("thinking_budget",
                     f"must be below {key} ({cfg.max_output_tokens or cfg.max_tokens})")
    r.check_unknown()
    return cfg


SCHEDULE_SESSIONS = ("new", "same")
# A schedule's name is a URL path segment (POST /schedules/NAME/run).
_SCHEDULE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def _schedule(
    file: str, name: str, table: Any, agents: Mapping[str, AgentConfig]
) -> ScheduleConfig:
    prefix = f"schedules.{name}"
    if not isinstance(table, dict):
        raise ConfigError(file, prefix, "must be a table")
    if not _SCHEDULE_NAME.match(name):
        raise ConfigError(file, prefix, "a schedule's name is letters, digits, - and _")
    r = _Reader(file, prefix, table)
    agent = r.get("agent", str, None)
    if agent is None:
        raise r.fail("agent", "is required")
    if agent not in agents:
        raise r.fail("agent", f"no agent {agent!r} is configured")
    message = r.get("message", str, "")
    if not message.strip():
        raise r.fail("message", "is required (the user message of each run)")
    every, cron = r.get("every", str, None), r.get("cron", str, None)
    zone_name = r.get("timezone", str, "UTC")
    try:
        zone = parse_zone(zone_name)
    except TimingError as exc:
        raise r.fail("timezone", str(exc)) from None
    timing: Timing
    if (every is None) == (cron is None):
        raise r.fail("every", "give either `every` (\"30s\", \"15m\", \"2h\") or `cron`")
    if every is not None:
        if "timezone" in table:
            raise r.fail("timezone", "only applies to `cron`")
        try:
            timing = Every(every.strip(), parse_every(every))
        except TimingError as exc:
            raise r.fail("every", str(exc)) from None
    else:
        assert cron is not None
        try:
            timing = parse_cron(cron.strip(), zone)
        except TimingError as exc:
            raise r.fail("cron", str(exc)) from None
    session = r.get("session", str, "new")
    if session not in SCHEDULE_SESSIONS:
        raise r.fail("session", f"must be \"new\" or \"same\", got {session!r}")
    cfg = ScheduleConfig(
        name=name, agent=agent, message=message, timing=timing, timezone=zone_name,
        session=session, enabled=r.get("enabled", bool, True),
        catch_up=r.get("catch_up", bool, True),
    )
    r.check_unknown()
    return cfg


STORE_SCHEMES = ("postgresql", "postgres")
BUS_SCHEMES = ("redis", "rediss")
# A node id names the node's Redis control stream and its row in the store.
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _cluster_url(r: _Reader, key: str, schemes: tuple[str, ...]) -> str:
    value: str | None = r.get(key, str, None)
    if value is None:
        raise r.fail(key, f"required: a {schemes[0]}:// URL")
    scheme, sep, rest = value.strip().partition("://")
    if not sep or scheme not in schemes or not rest:
        raise r.fail(key, f"must be a {' or '.join(s + '://' for s in schemes)} URL, "
                          f"got {redact_url(value)!r}")
    return value.strip()


def _cluster(file: str, table: Any) -> ClusterConfig:
    if not isinstance(table, dict):
        raise ConfigError(file, "cluster", "must be a table")
    r = _Reader(file, "cluster", table)
    store = _cluster_url(r, "store", STORE_SCHEMES)
    bus = _cluster_url(r, "bus", BUS_SCHEMES)
    node_id = r.get("node_id", str, f"{socket.gethostname()}-{os.getpid()}")
    if not NODE_ID.fullmatch(node_id):
        raise r.fail("node_id", f"must be 1-100 letters, digits, '.', '_' or '-' "
                                f"(not first), got {node_id!r}")
    workspaces = r.get("workspaces", str, None)
    if workspaces is not None and not workspaces.strip():
        raise r.fail("workspaces", "must be a directory path")
    cfg = ClusterConfig(
        store=store, bus=bus, node_id=node_id,
        lease_s=r.positive_seconds("lease_s", 15.0),
        retention_events=r.positive_int("retention_events", 1_000_000),
        connect_timeout_s=r.positive_seconds("connect_timeout_s", 10.0),
        workspaces=Path(workspaces) if workspaces is not None else None,
    )
    r.check_unknown()
    return cfg


def load_config(path: Path) -> Config:
    """Load and validate `path` and the agent files in `config/agents/` beside it."""
    file = str(path)
    raw = _read_toml(path)
    top = _Reader(file, "", raw)
    server = _server(file, top.get("server", dict, {}))
    providers = {
        name: _provider(file, name, table)
        for name, table in top.get("providers", dict, {}).items()
    }
    base = path.resolve().parent  # an MCP server's default cwd (CONTRACT §10)
    mcp = {
        name: _mcp_server(file, name, table, base)
        for name, table in top.get("mcp", dict, {}).items()
    }
    agents: dict[str, AgentConfig] = {}
    for name, table in top.get("agents", dict, {}).items():
        agents[name] = _agent(file, f"agents.{name}", name, table, providers, mcp)
    agents_dir = path.parent / "agents"
    if agents_dir.is_dir():
        for agent_file in sorted(agents_dir.glob("*.toml")):
            name = agent_file.stem
            if name in agents:
                raise ConfigError(
                    str(agent_file), name, f"agent {name!r} is also defined in {file}"
                )
            agents[name] = _agent(
                str(agent_file), "", name, _read_toml(agent_file), providers, mcp
            )
    schedules = {
        name: _schedule(file, name, table, agents)
        for name, table in top.get("schedules", dict, {}).items()
    }
    cluster_table = top.get("cluster", dict, None)
    cluster = _cluster(file, cluster_table) if cluster_table is not None else None
    if server.reuse_port and cluster is None:
        # Two embedded daemons on one port would be two veilds, each with its own
        # sessions: a client's next connection could land on the one without its session.
        raise ConfigError(file, "server.reuse_port",
                          "needs a [cluster] table (nodes that share a store and a bus)")
    top.check_unknown()
    return Config(path=path, server=server, providers=providers, agents=agents, mcp=mcp,
                  schedules=schedules, cluster=cluster)


def resolve_config_path(cli_path: str | None) -> Path:
    if cli_path:
        return Path(cli_path)
    env = os.environ.get("VEILD_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG_PATH
