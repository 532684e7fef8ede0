-- veild PostgreSQL schema 5: every fence a sweep raised (CONTRACT §13.8, §13.9), kept
-- after the node's row is dropped. Redis holds the fences the append script checks; a
-- Redis that lost its data (a restart without persistence, FLUSHALL, a failover to an
-- empty replica) lost them too, so the writer that finds the seq counter gone raises
-- every fence here again before it recreates the counter (eventlog/redis.py): a swept
-- node that wakes after the loss is refused as it was before. Rows older than 30 days
-- are pruned by later sweeps.
CREATE TABLE node_fences (
    node_id    TEXT PRIMARY KEY,
    epoch      BIGINT NOT NULL,
    fenced_ms  BIGINT NOT NULL
);
