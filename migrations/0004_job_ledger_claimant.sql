-- kind: expand
-- Who holds a running claim: one manager process (a node may run two during a rollout).
-- A claim is taken over only when it is not running or its lease has run out, and only
-- its claimant may renew, finish or release it.
ALTER TABLE job_ledger ADD COLUMN claimant VARCHAR(64);
