-- veild schema 3: what GET /sessions/{id}/turns reports, and which turn stored a message.
-- The session (if any) whose tool or delivery caused the turn.
ALTER TABLE turns ADD COLUMN from_session_id TEXT;
-- The bus seq of the turn's `turn.start`: where a client replays a running turn from.
ALTER TABLE turns ADD COLUMN start_seq INTEGER;
ALTER TABLE turns ADD COLUMN cancel_reason TEXT;
ALTER TABLE turns ADD COLUMN model TEXT;
ALTER TABLE turns ADD COLUMN input_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN output_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN cache_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN cost REAL NOT NULL DEFAULT 0;
CREATE INDEX turns_by_session ON turns(session_id, started_at);
-- Messages stored before this migration have no turn (NULL).
ALTER TABLE messages ADD COLUMN turn_id TEXT;
