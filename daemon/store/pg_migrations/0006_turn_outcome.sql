-- veild PostgreSQL schema 6: how a turn ended, kept with its end (CONTRACT §14.1): the
-- terminal error's message (GET /sessions/{id}/turns `error: {code, message}`), why a
-- `done`'s last answer stopped (`finishReason`: stop, length, content_filter), and
-- whether its usage was estimated (a provider that reported none). NULL / FALSE for
-- older turns.
ALTER TABLE turns ADD COLUMN error_message TEXT;
ALTER TABLE turns ADD COLUMN finish_reason TEXT;
ALTER TABLE turns ADD COLUMN usage_estimated BOOLEAN NOT NULL DEFAULT FALSE;
