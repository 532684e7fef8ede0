-- veild schema 6: compactions of a session's context (CONTRACT §15). One row per
-- compaction, never changed; every message stays in `messages`. Positions count the
-- session's messages in id order (models.CompactionRecord): the context a turn starts
-- from is the latest summary (its `covers_until` messages are skipped, an OFFSET over
-- messages_by_session) and the latest row of all (whose `pruned_until` is in force).
CREATE TABLE compactions (
    id                   INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id           TEXT NOT NULL REFERENCES sessions(id),
    turn_id              TEXT,     -- the turn that made it
    created_at           INTEGER NOT NULL,
    place                INTEGER NOT NULL,  -- messages stored when it was made
    covers_until         INTEGER NOT NULL,  -- the summary in force covers these first ones
    pruned_until         INTEGER NOT NULL,  -- tool results before this are placeholders
    summary              TEXT,     -- NULL: pruning was enough
    reason               TEXT NOT NULL,     -- threshold | overflow | manual
    before_tokens        INTEGER NOT NULL,
    after_tokens         INTEGER NOT NULL,
    pruned_tool_results  INTEGER NOT NULL
);
-- A session's records in order, its latest ones, and deleting a session's.
CREATE INDEX compactions_by_session ON compactions(session_id, id);
