-- Migration 12: `outbox_enqueue_job` takes the producer's trace context. The
-- five-argument function is replaced by the six-argument one (its sixth has a
-- default, so every call made before works unchanged); the rest of migration 4
-- (0004_jobs.sql, idempotent) runs again after this statement.
DROP FUNCTION IF EXISTS outbox_enqueue_job(text, jsonb, text, text, text);
