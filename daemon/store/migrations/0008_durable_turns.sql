-- veild schema 7: durable turns (CONTRACT §18). What a resume needs of an open turn's
-- row: how often it was resumed (`attempt`), the budget it was given, when its progress
-- was last stored (with its usage so far, in the same transaction as the message that
-- carries it), and why its gate was shut when a cancel answered (such a turn is never
-- resumed: it ends CANCELLED with that reason).
ALTER TABLE turns ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN budget_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN progress_at INTEGER;
ALTER TABLE turns ADD COLUMN stop_reason TEXT;
