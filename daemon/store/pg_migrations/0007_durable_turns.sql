-- veild PostgreSQL schema 6: durable turns (CONTRACT §18), as SQLite's schema 7: how
-- often an open turn was resumed, its budget, when its progress (with its usage so far)
-- was last stored, and the reason of a cancel that answered (never resumed).
ALTER TABLE turns ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN budget_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN progress_at BIGINT;
ALTER TABLE turns ADD COLUMN stop_reason TEXT;
