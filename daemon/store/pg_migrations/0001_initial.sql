-- veild PostgreSQL schema 1: what the SQLite store's migrations 0001-0005 build, plus the
-- cluster's (CONTRACT §13): the node that owns each session and the nodes' leases.
-- Times are milliseconds since the epoch (BIGINT), as in the SQLite store. `seq` columns
-- give the insertion order SQLite's rowid gives (ties of created_at / started_at).

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- The nodes of the cluster: each renews lease_until (heartbeat); one whose lease is past
-- is dead, and the sweeper takes its turns and sessions, then deletes its row.
CREATE TABLE nodes (
    node_id     TEXT PRIMARY KEY,
    url         TEXT NOT NULL,
    started_at  BIGINT NOT NULL,
    lease_until BIGINT NOT NULL
);

CREATE TABLE sessions (
    id                  TEXT PRIMARY KEY,
    seq                 BIGINT GENERATED ALWAYS AS IDENTITY,
    agent_name          TEXT NOT NULL,
    parent_session_id   TEXT REFERENCES sessions(id),
    root_session_id     TEXT NOT NULL,
    depth               INTEGER NOT NULL DEFAULT 0,
    spawn_tool_call_id  TEXT,
    status              TEXT NOT NULL DEFAULT 'idle',
    created_at          BIGINT NOT NULL,
    updated_at          BIGINT NOT NULL,
    model               TEXT,
    input_tokens        BIGINT NOT NULL DEFAULT 0,
    output_tokens       BIGINT NOT NULL DEFAULT 0,
    cache_tokens        BIGINT NOT NULL DEFAULT 0,
    cost                DOUBLE PRECISION NOT NULL DEFAULT 0,
    engine_session_id   TEXT,
    -- The node whose SessionManager runs this session's turns; NULL once a dead node's
    -- sessions are released, until a node claims it (compare-and-set).
    owner               TEXT
);
CREATE INDEX sessions_by_parent ON sessions(parent_session_id);
CREATE INDEX sessions_by_created ON sessions(created_at, seq);
CREATE INDEX sessions_by_root ON sessions(root_session_id, updated_at);
CREATE INDEX sessions_by_owner ON sessions(owner, status);

CREATE TABLE messages (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id    TEXT NOT NULL REFERENCES sessions(id),
    role          TEXT NOT NULL,
    content       TEXT NOT NULL,
    tool_calls    TEXT,  -- JSON, kept as written
    tool_call_id  TEXT,
    created_at    BIGINT NOT NULL,
    turn_id       TEXT
);
CREATE INDEX messages_by_session ON messages(session_id, id);

CREATE TABLE turns (
    id               TEXT PRIMARY KEY,
    seq              BIGINT GENERATED ALWAYS AS IDENTITY,
    session_id       TEXT NOT NULL REFERENCES sessions(id),
    trigger          TEXT NOT NULL,
    started_at       BIGINT NOT NULL,
    ended_at         BIGINT,
    terminal_code    TEXT,
    reply_to         TEXT,
    from_session_id  TEXT,
    start_seq        BIGINT,
    cancel_reason    TEXT,
    model            TEXT,
    input_tokens     BIGINT NOT NULL DEFAULT 0,
    output_tokens    BIGINT NOT NULL DEFAULT 0,
    cache_tokens     BIGINT NOT NULL DEFAULT 0,
    cost             DOUBLE PRECISION NOT NULL DEFAULT 0,
    schedule         TEXT
);
CREATE INDEX turns_unfinished ON turns(session_id) WHERE ended_at IS NULL;
CREATE INDEX turns_by_session ON turns(session_id, started_at, seq);

CREATE TABLE inbox (
    id                BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id        TEXT NOT NULL REFERENCES sessions(id),
    content           TEXT NOT NULL,
    from_session_id   TEXT,
    delivery          TEXT NOT NULL DEFAULT 'steer',
    created_at        BIGINT NOT NULL,
    consumed_by_turn  TEXT,
    -- false: recorded but wakes nothing (see the SQLite store's migration 0002)
    wakes             BOOLEAN NOT NULL DEFAULT TRUE,
    reply_to          TEXT
);
CREATE INDEX inbox_pending ON inbox(session_id, id) WHERE consumed_by_turn IS NULL;
CREATE INDEX inbox_waking ON inbox(session_id) WHERE consumed_by_turn IS NULL AND wakes;
CREATE INDEX inbox_by_session ON inbox(session_id);

CREATE TABLE schedules (
    name             TEXT PRIMARY KEY,
    paused           BOOLEAN NOT NULL DEFAULT FALSE,
    last_run_at      BIGINT,
    next_run_at      BIGINT,
    last_session_id  TEXT,
    last_turn_id     TEXT,
    last_outcome     TEXT,
    skipped          INTEGER NOT NULL DEFAULT 0
);
