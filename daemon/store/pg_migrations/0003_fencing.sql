-- veild PostgreSQL schema 3: fencing (CONTRACT §13.8). Each registration of a node gets
-- a new epoch from one sequence (so an epoch is never reused, across node ids too); a
-- sweeper first marks the node's row `swept` (under the row's lock), and every write of
-- a turn checks, in its own transaction and under a share lock on that row, that its
-- node's row still has the writer's epoch and is not swept. Leases are on the store's
-- clock: lease_until is compared with the server's clock_timestamp(), never a node's.
CREATE SEQUENCE node_epochs;
ALTER TABLE nodes ADD COLUMN epoch BIGINT NOT NULL DEFAULT nextval('node_epochs');
ALTER TABLE nodes ADD COLUMN swept BOOLEAN NOT NULL DEFAULT FALSE;
-- Unique, so that an UPDATE of `epoch` (the fence) takes the row's FOR UPDATE lock and
-- waits for every write that holds it FOR KEY SHARE (postgres.py's _LIVE).
CREATE UNIQUE INDEX nodes_epoch ON nodes(epoch);
