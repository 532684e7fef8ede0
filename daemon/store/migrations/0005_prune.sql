-- veild: outside a transaction
-- veild schema 5: history that does not grow forever (CONTRACT §12).
-- (0004 is the schedules' migration, landing from another branch.)
-- Pruning asks "which trees were last updated before T": by root, then by update time.
CREATE INDEX IF NOT EXISTS sessions_by_root ON sessions(root_session_id, updated_at);
-- Deleting a tree removes its inbox and turns by session.
CREATE INDEX IF NOT EXISTS inbox_by_session ON inbox(session_id);
-- Free pages go back to the file system (PRAGMA incremental_vacuum after each delete)
-- instead of staying in the file. auto_vacuum can only change with a VACUUM, which
-- cannot run inside a transaction: hence this migration runs outside one. Both
-- statements may run twice (a crash before user_version is set) without harm.
PRAGMA auto_vacuum = INCREMENTAL;
VACUUM;
