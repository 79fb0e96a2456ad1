-- kind: expand
-- Liveness judged by the database clock, and the query "which live nodes can run this".

-- Each node says how often it heartbeats, so "missed heartbeats" means the same thing
-- for a node configured at 10 s as for one at 30 s.
ALTER TABLE worker_capabilities
  ADD COLUMN heartbeat_interval_seconds INTEGER NOT NULL DEFAULT 30
  CHECK (heartbeat_interval_seconds > 0);

-- Capability containment (`capabilities @> '["embeddings"]'`) uses this index.
CREATE INDEX idx_worker_capabilities_capabilities
  ON worker_capabilities USING GIN (capabilities jsonb_path_ops);

-- online/draining as the node last said, unless it has gone quiet: suspect after two
-- missed heartbeats, offline after three. `at` defaults to the database clock; tests
-- pass their own.
CREATE FUNCTION worker_liveness(
  p_status TEXT, p_last_heartbeat TIMESTAMPTZ, p_interval_seconds INTEGER,
  p_at TIMESTAMPTZ DEFAULT now()
) RETURNS TEXT
LANGUAGE sql STABLE AS $$
  SELECT CASE
    WHEN p_status = 'offline' THEN 'offline'
    WHEN p_at - p_last_heartbeat > make_interval(secs => 3 * p_interval_seconds) THEN 'offline'
    WHEN p_at - p_last_heartbeat > make_interval(secs => 2 * p_interval_seconds) THEN 'suspect'
    ELSE p_status
  END
$$;

CREATE VIEW worker_liveness_now AS
  SELECT w.*,
         worker_liveness(w.status, w.last_heartbeat, w.heartbeat_interval_seconds) AS liveness,
         EXTRACT(EPOCH FROM now() - w.last_heartbeat) AS heartbeat_age_seconds
  FROM worker_capabilities w;

-- Live ('online') nodes that satisfy a job's requirements. NULL means "no requirement".
CREATE FUNCTION eligible_workers(
  p_tiers TEXT[] DEFAULT NULL,
  p_region TEXT DEFAULT NULL,
  p_trust_zone TEXT DEFAULT NULL,
  p_capabilities JSONB DEFAULT NULL,
  p_gpu BOOLEAN DEFAULT NULL,
  p_min_memory_gb NUMERIC DEFAULT NULL,
  p_min_cpu_count INTEGER DEFAULT NULL,
  p_at TIMESTAMPTZ DEFAULT now()
) RETURNS SETOF worker_capabilities
LANGUAGE sql STABLE AS $$
  SELECT w.*
  FROM worker_capabilities w
  WHERE worker_liveness(w.status, w.last_heartbeat, w.heartbeat_interval_seconds, p_at) = 'online'
    AND (p_tiers IS NULL OR w.tier = ANY (p_tiers))
    AND (p_region IS NULL OR w.region = p_region)
    AND (p_trust_zone IS NULL OR w.trust_zone = p_trust_zone)
    AND (p_capabilities IS NULL OR w.capabilities @> p_capabilities)
    AND (p_gpu IS NULL OR p_gpu = false OR (w.hardware ->> 'gpu')::boolean IS TRUE)
    AND (p_min_memory_gb IS NULL OR (w.hardware ->> 'memory_gb')::numeric >= p_min_memory_gb)
    AND (p_min_cpu_count IS NULL OR (w.hardware ->> 'cpu_count')::integer >= p_min_cpu_count)
  ORDER BY w.node_id
$$;
