-- Migration 12: `outbox_enqueue_job` takes the producer's trace context. The
-- five-argument function is replaced by the six-argument one (its sixth has a
-- default, so every call made before works unchanged); the definitions of
-- migration 4 as they stood when this migration was written (idempotent)
-- follow, copied: an applied migration's SQL never changes.
DROP FUNCTION IF EXISTS outbox_enqueue_job(text, jsonb, text, text, text);
-- The consumer library's jobs: PostgreSQL decides whether a received message
-- runs, never the message. Every transition is a compare-and-set.
CREATE TABLE IF NOT EXISTS jobs (
    job_id             text PRIMARY KEY,    -- sha256 hex of the canonical JSON of (kind, payload)
    kind               text NOT NULL,
    payload            jsonb NOT NULL,
    destination        text NOT NULL,       -- the outbox lane its messages go to
    group_key          text,                -- FIFO MessageGroupId, if the queue is FIFO
    status             text NOT NULL DEFAULT 'PENDING'
                       CHECK (status IN ('PENDING', 'CLAIMED', 'SUCCEEDED', 'DEAD')),
    attempt_count      int NOT NULL DEFAULT 0,
    redrive_generation int NOT NULL DEFAULT 0,
    claimed_by         text,
    lease_expires_at   timestamptz,
    next_attempt_at    timestamptz,         -- a retry waits until then (status PENDING)
    cancel_requested   boolean NOT NULL DEFAULT false,
    last_error         text,
    dead_reason        text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz
);

CREATE INDEX IF NOT EXISTS jobs_claimed_lease ON jobs (lease_expires_at) WHERE status = 'CLAIMED';

-- job_id of a job: sha256 of jsonb_build_object('kind', kind, 'payload', payload)::text.
-- jsonb's text form is canonical: keys in a fixed order, one spacing, no
-- duplicates; so equal work always gets the same id, in any language.
CREATE OR REPLACE FUNCTION outbox_job_id(p_kind text, p_payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT encode(sha256(convert_to(jsonb_build_object('kind', p_kind, 'payload', p_payload)::text, 'UTF8')), 'hex')
$$;

-- The message that wakes a job's consumer: identity only; the job row is the truth.
CREATE OR REPLACE FUNCTION outbox_job_message(p_job_id text, p_kind text, p_generation int) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT jsonb_build_object('job_id', p_job_id, 'kind', p_kind, 'generation', p_generation)::text
$$;

-- Enqueue a job and its outbox event in the caller's transaction. Both
-- inserts are ON CONFLICT DO NOTHING: enqueueing identical work again is a
-- no-op. The same job_id with a different kind or payload is an error.
-- Returns the job_id. p_traceparent (a W3C traceparent) goes with the
-- message as its `traceparent` attribute (the relay also sends it as
-- AWSTraceHeader), so the consumer continues the producer's trace.
CREATE OR REPLACE FUNCTION outbox_enqueue_job(
    p_kind text, p_payload jsonb, p_destination text,
    p_group_key text DEFAULT NULL, p_job_id text DEFAULT NULL, p_traceparent text DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_job_id text := coalesce(p_job_id, outbox_job_id(p_kind, p_payload));
    v_kind text;
    v_payload jsonb;
    v_inserted int;
BEGIN
    IF p_kind IS NULL OR p_kind = '' OR p_payload IS NULL OR p_destination IS NULL OR p_destination = '' THEN
        RAISE EXCEPTION 'outbox_enqueue_job: kind, payload and destination are required' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO jobs (job_id, kind, payload, destination, group_key)
    VALUES (v_job_id, p_kind, p_payload, p_destination, p_group_key)
    ON CONFLICT (job_id) DO NOTHING;
    GET DIAGNOSTICS v_inserted = ROW_COUNT;
    IF v_inserted = 0 THEN
        SELECT kind, payload INTO v_kind, v_payload FROM jobs WHERE job_id = v_job_id;
        IF v_kind IS DISTINCT FROM p_kind OR v_payload IS DISTINCT FROM p_payload THEN
            RAISE EXCEPTION 'job % already exists with a different kind or payload', v_job_id
                USING ERRCODE = 'unique_violation', HINT = 'a job_id names one piece of work; use a new id for different work';
        END IF;
        RETURN v_job_id;
    END IF;
    INSERT INTO outbox (event_id, destination, body, group_key, attributes)
    VALUES (p_kind || ':' || v_job_id || ':0', p_destination, outbox_job_message(v_job_id, p_kind, 0), p_group_key,
            CASE WHEN p_traceparent IS NOT NULL THEN jsonb_build_object('traceparent', p_traceparent) END)
    ON CONFLICT (event_id) DO NOTHING;
    RETURN v_job_id;
END
$$;

-- Redrive: bump the generation, reset the job, emit a new outbox event, in
-- the caller's transaction. Messages of older generations can no longer
-- claim or close it. Returns the new generation.
CREATE OR REPLACE FUNCTION outbox_redrive_job(p_job_id text) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_kind text;
    v_destination text;
    v_group text;
    v_generation int;
BEGIN
    UPDATE jobs
       SET redrive_generation = redrive_generation + 1, status = 'PENDING', attempt_count = 0,
           claimed_by = NULL, lease_expires_at = NULL, next_attempt_at = NULL, cancel_requested = false,
           last_error = NULL, dead_reason = NULL, finished_at = NULL, updated_at = now()
     WHERE job_id = p_job_id
 RETURNING kind, destination, group_key, redrive_generation INTO v_kind, v_destination, v_group, v_generation;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no job %', p_job_id USING ERRCODE = 'no_data_found';
    END IF;
    INSERT INTO outbox (event_id, destination, body, group_key)
    VALUES (v_kind || ':' || p_job_id || ':' || v_generation, v_destination,
            outbox_job_message(p_job_id, v_kind, v_generation), v_group)
    ON CONFLICT (event_id) DO NOTHING;
    RETURN v_generation;
END
$$;
