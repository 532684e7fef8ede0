-- veild schema 1: sessions, their messages, turns (for crash recovery), inbox, meta.
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE sessions (
    id                  TEXT PRIMARY KEY,
    agent_name          TEXT NOT NULL,
    parent_session_id   TEXT REFERENCES sessions(id),
    root_session_id     TEXT NOT NULL,
    depth               INTEGER NOT NULL DEFAULT 0,
    spawn_tool_call_id  TEXT,
    status              TEXT NOT NULL DEFAULT 'idle',
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    model               TEXT,
    input_tokens        INTEGER NOT NULL DEFAULT 0,
    output_tokens       INTEGER NOT NULL DEFAULT 0,
    cache_tokens        INTEGER NOT NULL DEFAULT 0,
    cost                REAL NOT NULL DEFAULT 0,
    engine_session_id   TEXT
);
CREATE INDEX sessions_by_parent ON sessions(parent_session_id);
CREATE INDEX sessions_by_created ON sessions(created_at);

CREATE TABLE messages (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id    TEXT NOT NULL REFERENCES sessions(id),
    role          TEXT NOT NULL,
    content       TEXT NOT NULL,
    tool_calls    TEXT,
    tool_call_id  TEXT,
    created_at    INTEGER NOT NULL
);
CREATE INDEX messages_by_session ON messages(session_id, id);

CREATE TABLE turns (
    id              TEXT PRIMARY KEY,
    session_id      TEXT NOT NULL REFERENCES sessions(id),
    trigger         TEXT NOT NULL,
    started_at      INTEGER NOT NULL,
    ended_at        INTEGER,
    terminal_code   TEXT
);
CREATE INDEX turns_unfinished ON turns(ended_at) WHERE ended_at IS NULL;

CREATE TABLE inbox (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id       TEXT NOT NULL REFERENCES sessions(id),
    content          TEXT NOT NULL,
    from_session_id  TEXT,
    delivery         TEXT NOT NULL DEFAULT 'steer',
    created_at       INTEGER NOT NULL,
    consumed_by_turn TEXT
);
CREATE INDEX inbox_pending ON inbox(session_id, id) WHERE consumed_by_turn IS NULL;
