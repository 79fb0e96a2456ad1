-- kind: expand
-- The capability registry table, exactly as the fleet's seed defines it.
CREATE TABLE worker_capabilities (
  node_id VARCHAR(255) PRIMARY KEY,
  tier VARCHAR(10) NOT NULL,
  region VARCHAR(50),
  trust_zone VARCHAR(50),
  hardware JSONB NOT NULL,
  capabilities JSONB NOT NULL,
  status VARCHAR(20) NOT NULL,
  last_heartbeat TIMESTAMP WITH TIME ZONE NOT NULL,
  created_at TIMESTAMP WITH TIME ZONE DEFAULT CURRENT_TIMESTAMP,
  updated_at TIMESTAMP WITH TIME ZONE DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX idx_worker_capabilities_tier ON worker_capabilities(tier);
CREATE INDEX idx_worker_capabilities_status ON worker_capabilities(status);
CREATE INDEX idx_worker_capabilities_heartbeat ON worker_capabilities(last_heartbeat);
