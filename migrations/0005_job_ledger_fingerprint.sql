-- kind: expand
-- The job an idempotency key was used for: "sha256:" and the hex digest of the canonical
-- JSON of its type and payload. A claim with another fingerprint is a conflict; NULL (rows
-- from before this column) matches any job. Nullable without a default: adding it rewrites
-- nothing, however large the table.
ALTER TABLE job_ledger ADD COLUMN fingerprint TEXT;
