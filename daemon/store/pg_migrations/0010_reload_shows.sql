-- veild PostgreSQL schema 10: what a reload must show that the live view showed, as the
-- SQLite store's migration 0010 adds it. A message taken from a session's inbox says so,
-- and from which session (NULL: from outside), as its live `message` event did; a
-- turn's notes (its `turn.queued`/`turn.admitted` and `provider.retry` events, each with
-- when and after how many of the turn's messages it came; JSON, written with its end).
ALTER TABLE messages ADD COLUMN delivered BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE messages ADD COLUMN from_session_id TEXT;
ALTER TABLE turns ADD COLUMN notes TEXT;
