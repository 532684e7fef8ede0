-- veild PostgreSQL schema 2: compactions of a session's context (CONTRACT §15), as the
-- SQLite store's migration 0006 builds them. One row per compaction, never changed;
-- every message stays in `messages`.
CREATE TABLE compactions (
    id                   BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id           TEXT NOT NULL REFERENCES sessions(id),
    turn_id              TEXT,     -- the turn that made it
    created_at           BIGINT NOT NULL,
    place                BIGINT NOT NULL,  -- messages stored when it was made
    covers_until         BIGINT NOT NULL,  -- the summary in force covers these first ones
    pruned_until         BIGINT NOT NULL,  -- tool results before this are placeholders
    summary              TEXT,     -- NULL: pruning was enough
    reason               TEXT NOT NULL,    -- threshold | overflow | manual
    before_tokens        BIGINT NOT NULL,
    after_tokens         BIGINT NOT NULL,
    pruned_tool_results  BIGINT NOT NULL
);
-- A session's records in order, its latest ones, and deleting a session's.
CREATE INDEX compactions_by_session ON compactions(session_id, id);
