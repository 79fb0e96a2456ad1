-- kind: expand
-- Which manager process holds a node's row. A node may briefly run two during a rollout
-- (the new pod starts before the old one stops), and a newcomer may start a second one by
-- mistake: a row is taken over only from an instance that is leaving (draining or
-- offline) or has gone quiet, and an instance writes `draining` and `offline` only over
-- its own row, so a second instance never marks offline a node the first still serves.
ALTER TABLE worker_capabilities ADD COLUMN instance_id VARCHAR(64);
