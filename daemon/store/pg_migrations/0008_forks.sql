-- veild PostgreSQL schema 6: rewind and fork (CONTRACT §19). A fork names where it came from
-- (`forked_*`, NULL unless forked); a rewind under way marks its session with the turn
-- it goes back before and the fork that keeps what it held (`rewind_*`): set with the
-- fork's rows, cleared with the truncation, in one transaction each, so the start after
-- a crash finishes or undoes it (runtime/rewind.py).
ALTER TABLE sessions ADD COLUMN forked_session_id TEXT;
ALTER TABLE sessions ADD COLUMN forked_turn_id TEXT;
ALTER TABLE sessions ADD COLUMN forked_at TEXT;
ALTER TABLE sessions ADD COLUMN rewind_turn TEXT;
ALTER TABLE sessions ADD COLUMN rewind_fork TEXT;
