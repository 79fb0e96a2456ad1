-- kind: expand
-- The job worker's idempotency ledger: one row per idempotency key, claimed with a lease.
CREATE TABLE job_ledger (
  idempotency_key VARCHAR(255) PRIMARY KEY,
  job_id UUID NOT NULL,
  job_type VARCHAR(128) NOT NULL,
  node_id VARCHAR(255) NOT NULL,
  status VARCHAR(20) NOT NULL CHECK (status IN ('running', 'retrying', 'completed', 'dead')),
  attempts INTEGER NOT NULL DEFAULT 1,
  lease_until TIMESTAMPTZ,
  result JSONB,
  error TEXT,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  completed_at TIMESTAMPTZ
);
CREATE INDEX idx_job_ledger_status ON job_ledger(status, updated_at);
CREATE INDEX idx_job_ledger_node ON job_ledger(node_id) WHERE status = 'running';
