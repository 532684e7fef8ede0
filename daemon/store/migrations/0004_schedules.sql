-- veild schema 4: schedules (CONTRACT §11). One row per schedule name, written by the
-- scheduler: what persists across restarts (paused, lastRunAt, the last run) and the
-- planned next tick, which tells a restart whether a tick was missed (catch-up).
CREATE TABLE schedules (
    name TEXT PRIMARY KEY,
    paused INTEGER NOT NULL DEFAULT 0,
    last_run_at INTEGER,
    -- the planned time of the next tick; NULL while nothing is planned (paused, disabled)
    next_run_at INTEGER,
    last_session_id TEXT,  -- for session = "same": the session every run continues
    last_turn_id TEXT,
    last_outcome TEXT,     -- "done" or the error code of the last run that ended
    skipped INTEGER NOT NULL DEFAULT 0
);
-- The schedule that started a turn (trigger `schedule`), NULL for any other turn.
ALTER TABLE turns ADD COLUMN schedule TEXT;
