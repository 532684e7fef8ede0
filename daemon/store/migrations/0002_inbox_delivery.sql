-- veild schema 2: inbox deliveries that wake or not, replies, turns that owe a reply.
-- wakes = 0: recorded but wakes nothing (it came from a cancelled turn, or was waiting
-- when its session's turn was stopped); drained with the next turn the session runs.
ALTER TABLE inbox ADD COLUMN wakes INTEGER NOT NULL DEFAULT 1;
-- The session that gets the final content of the turn that consumes this message
-- (an asyncInform to a session that was busy).
ALTER TABLE inbox ADD COLUMN reply_to TEXT;
-- The session a turn delivers its final content to when it ends (no-wait spawn,
-- async inform): kept so that a turn interrupted by a crash still answers.
ALTER TABLE turns ADD COLUMN reply_to TEXT;
CREATE INDEX inbox_waking ON inbox(session_id) WHERE consumed_by_turn IS NULL AND wakes = 1;
