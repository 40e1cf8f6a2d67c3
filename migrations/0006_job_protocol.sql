-- The consumer's protocol as SQL functions: a worker in any language gets
-- the same guarantees with these few statements (the Rust library calls the
-- same functions). Every transition is a compare-and-set on the job's
-- status, attempt_count and redrive_generation, fenced by claimed_by.
--
--   1. received messages  -> outbox_claim_jobs (or outbox_claim_job): one row
--      per message saying what to do with it;
--   2. 'run'              -> in one transaction: the handler's writes, then
--      outbox_succeed_job (false: fenced, roll back); commit; delete the message.
--      A failure: roll back, then outbox_retry_job (hide the message for the
--      delay it returns) or outbox_dead_job (delete the message);
--   3. while running      -> outbox_renew_job_lease every lease/3 (and extend
--      the message's visibility): 'cancel' or 'fenced' means stop;
--   4. a DLQ message      -> outbox_dlq_job.

-- What a received message of job (p_job_id, p_kind, p_generation) does now.
--   run          claimed: run the handler (attempt, payload; rescued: took over an expired lease)
--   skip         the job is SUCCEEDED or DEAD: delete the message without running
--   not_due      a retry not yet due: hide the message for delay_secs
--   busy         another worker's lease is live: hide the message for delay_secs
--   fenced       the job changed under this claim: hide the message for delay_secs (the lease)
--   stale        a message of an older generation: rejected; delete it
--   dead         cancellation was requested: the job is now DEAD ('CANCELLED'); delete the message
--   unknown_job, wrong_wiring   neither run nor delete (reason): SQS's redrive moves it to the DLQ
CREATE OR REPLACE FUNCTION outbox_claim_job(
    p_job_id text, p_kind text, p_generation int, p_worker text, p_lease_secs float8
) RETURNS TABLE (action text, attempt int, payload jsonb, rescued boolean, delay_secs float8, reason text)
LANGUAGE plpgsql AS $$
DECLARE
    j jobs%ROWTYPE;
    v_generation int;
    v_attempt int;
    v_payload jsonb;
    v_cancel boolean;
BEGIN
    SELECT * INTO j FROM jobs WHERE job_id = p_job_id;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown_job', NULL::int, NULL::jsonb, false, NULL::float8, 'no such job';
        RETURN;
    END IF;
    IF j.kind IS DISTINCT FROM p_kind THEN
        RETURN QUERY SELECT 'wrong_wiring', NULL::int, NULL::jsonb, false, NULL::float8,
            format('message kind %s, job kind %s', p_kind, j.kind);
        RETURN;
    END IF;
    IF p_generation > j.redrive_generation THEN
        RETURN QUERY SELECT 'wrong_wiring', NULL::int, NULL::jsonb, false, NULL::float8,
            format('message generation %s is newer than the job''s %s', p_generation, j.redrive_generation);
        RETURN;
    END IF;
    IF p_generation < j.redrive_generation THEN
        -- Under FOR UPDATE: DEAD('STALE') only if the job is still on that
        -- generation (it is not, unless the redrive that made it stale rolled back).
        SELECT redrive_generation INTO v_generation FROM jobs WHERE job_id = p_job_id FOR UPDATE;
        IF v_generation = p_generation THEN
            UPDATE jobs SET status = 'DEAD', dead_reason = 'STALE', finished_at = now(), updated_at = now()
             WHERE job_id = p_job_id AND redrive_generation = p_generation AND status IN ('PENDING', 'CLAIMED');
        END IF;
        RETURN QUERY SELECT 'stale', NULL::int, NULL::jsonb, false, NULL::float8, NULL::text;
        RETURN;
    END IF;
    IF j.status IN ('SUCCEEDED', 'DEAD') THEN
        RETURN QUERY SELECT 'skip', NULL::int, NULL::jsonb, false, NULL::float8, NULL::text;
        RETURN;
    END IF;
    IF j.status = 'PENDING' AND j.next_attempt_at > now() THEN
        RETURN QUERY SELECT 'not_due', NULL::int, NULL::jsonb, false,
            extract(epoch FROM j.next_attempt_at - now())::float8, NULL::text;
        RETURN;
    END IF;
    IF j.status = 'CLAIMED' AND j.lease_expires_at > now() THEN
        RETURN QUERY SELECT 'busy', NULL::int, NULL::jsonb, false,
            extract(epoch FROM j.lease_expires_at - now())::float8 + 1, NULL::text;
        RETURN;
    END IF;
    -- The claim: status, attempt_count and generation as seen, and still claimable.
    UPDATE jobs
       SET status = 'CLAIMED', claimed_by = p_worker, attempt_count = attempt_count + 1,
           lease_expires_at = now() + make_interval(secs => p_lease_secs), next_attempt_at = NULL, updated_at = now()
     WHERE job_id = p_job_id AND status = j.status AND attempt_count = j.attempt_count
       AND redrive_generation = p_generation
       AND ((status = 'PENDING' AND (next_attempt_at IS NULL OR next_attempt_at <= now()))
         OR (status = 'CLAIMED' AND lease_expires_at <= now()))
 RETURNING jobs.attempt_count, jobs.payload, jobs.cancel_requested INTO v_attempt, v_payload, v_cancel;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'fenced', NULL::int, NULL::jsonb, false, p_lease_secs, NULL::text;
        RETURN;
    END IF;
    IF v_cancel THEN
        PERFORM outbox_dead_job(p_job_id, p_worker, v_attempt, p_generation, 'CANCELLED');
        RETURN QUERY SELECT 'dead', v_attempt, NULL::jsonb, j.status = 'CLAIMED', NULL::float8, 'CANCELLED'::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'run', v_attempt, v_payload, j.status = 'CLAIMED', NULL::float8, NULL::text;
END
$$;

-- Several messages in one statement (up to a receive's 10): one row per
-- message, `ord` its position (1-based) in the arrays. Claims are taken in
-- job_id order, so workers claiming overlapping batches do not deadlock.
CREATE OR REPLACE FUNCTION outbox_claim_jobs(
    p_job_ids text[], p_kinds text[], p_generations int[], p_worker text, p_lease_secs float8
) RETURNS TABLE (ord int, action text, attempt int, payload jsonb, rescued boolean, delay_secs float8, reason text)
LANGUAGE plpgsql AS $$
DECLARE
    m record;
BEGIN
    FOR m IN
        SELECT u.job_id, u.kind, u.generation, u.n::int AS n
          FROM unnest(p_job_ids, p_kinds, p_generations) WITH ORDINALITY AS u(job_id, kind, generation, n)
         ORDER BY u.job_id, u.n
    LOOP
        RETURN QUERY SELECT m.n, c.* FROM outbox_claim_job(m.job_id, m.kind, m.generation, p_worker, p_lease_secs) c;
    END LOOP;
END
$$;

-- The fence: this worker's claim of this attempt and generation, still held.
CREATE OR REPLACE FUNCTION outbox_job_fenced(p_job_id text, p_worker text, p_attempt int, p_generation int)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT NOT EXISTS (
        SELECT 1 FROM jobs WHERE job_id = p_job_id AND claimed_by = p_worker AND status = 'CLAIMED'
           AND attempt_count = p_attempt AND redrive_generation = p_generation)
$$;

-- In the handler's transaction, after its writes: SUCCEEDED. False: fenced
-- (the lease was taken over or the job redriven): roll the transaction back.
CREATE OR REPLACE FUNCTION outbox_succeed_job(p_job_id text, p_worker text, p_attempt int, p_generation int)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs SET status = 'SUCCEEDED', finished_at = now(), lease_expires_at = NULL, last_error = NULL, updated_at = now()
     WHERE job_id = p_job_id AND claimed_by = p_worker AND status = 'CLAIMED'
       AND attempt_count = p_attempt AND redrive_generation = p_generation;
    RETURN FOUND;
END
$$;

-- The retry backoff: base x 2^(attempt-1), at most 20 doublings, capped at
-- max, jittered over its upper half so retries of many jobs spread out.
-- Seconds. The relay's backoff (policy::retry::backoff) is the same formula
-- on its failure count, without the jitter.
CREATE OR REPLACE FUNCTION outbox_job_backoff(p_attempt int, p_base_secs float8, p_max_secs float8)
RETURNS float8 LANGUAGE sql VOLATILE AS $$
    SELECT e / 2 + random() * e / 2
      FROM (SELECT least(p_base_secs * power(2, greatest(least(p_attempt - 1, 20), 0)), p_max_secs) AS e) b
$$;

-- After a failed attempt (its transaction rolled back): PENDING until the
-- backoff has passed. Returns that delay in seconds (hide the message as
-- long), NULL when fenced.
CREATE OR REPLACE FUNCTION outbox_retry_job(
    p_job_id text, p_worker text, p_attempt int, p_generation int, p_error text, p_base_secs float8, p_max_secs float8
) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    v_after float8 := outbox_job_backoff(p_attempt, p_base_secs, p_max_secs);
BEGIN
    UPDATE jobs SET status = 'PENDING', next_attempt_at = now() + make_interval(secs => v_after),
           lease_expires_at = NULL, last_error = p_error, updated_at = now()
     WHERE job_id = p_job_id AND claimed_by = p_worker AND status = 'CLAIMED'
       AND attempt_count = p_attempt AND redrive_generation = p_generation;
    RETURN CASE WHEN FOUND THEN v_after END;
END
$$;

-- It will never work: DEAD with the reason. False: fenced.
CREATE OR REPLACE FUNCTION outbox_dead_job(p_job_id text, p_worker text, p_attempt int, p_generation int, p_reason text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs SET status = 'DEAD', dead_reason = p_reason, last_error = p_reason, finished_at = now(),
           lease_expires_at = NULL, updated_at = now()
     WHERE job_id = p_job_id AND claimed_by = p_worker AND status = 'CLAIMED'
       AND attempt_count = p_attempt AND redrive_generation = p_generation;
    RETURN FOUND;
END
$$;

-- The lease heartbeat: 'held' (extended), 'cancel' (extended, but
-- cancellation was requested: stop), 'fenced' (the claim is gone: stop).
CREATE OR REPLACE FUNCTION outbox_renew_job_lease(
    p_job_id text, p_worker text, p_attempt int, p_generation int, p_lease_secs float8
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_cancel boolean;
BEGIN
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => p_lease_secs), updated_at = now()
     WHERE job_id = p_job_id AND claimed_by = p_worker AND status = 'CLAIMED'
       AND attempt_count = p_attempt AND redrive_generation = p_generation
 RETURNING cancel_requested INTO v_cancel;
    RETURN CASE WHEN NOT FOUND THEN 'fenced' WHEN v_cancel THEN 'cancel' ELSE 'held' END;
END
$$;

-- A message SQS moved to the dead-letter queue: 'marked_dead' (the job was
-- PENDING, or CLAIMED with an expired lease: now DEAD('DLQ'); delete the
-- message), 'already_terminal' (delete it), 'lease_live' (leave it for a
-- later look), 'unrecognised' (no such job: leave it for a human).
CREATE OR REPLACE FUNCTION outbox_dlq_job(p_job_id text, p_generation int) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    j jobs%ROWTYPE;
BEGIN
    SELECT * INTO j FROM jobs WHERE job_id = p_job_id;
    IF NOT FOUND THEN
        RETURN 'unrecognised';
    END IF;
    IF j.status IN ('SUCCEEDED', 'DEAD') OR p_generation < j.redrive_generation THEN
        RETURN 'already_terminal';
    END IF;
    UPDATE jobs SET status = 'DEAD', dead_reason = 'DLQ', last_error = coalesce(last_error, 'moved to the DLQ'),
           finished_at = now(), lease_expires_at = NULL, updated_at = now()
     WHERE job_id = p_job_id AND redrive_generation = p_generation
       AND (status = 'PENDING' OR (status = 'CLAIMED' AND lease_expires_at <= now()));
    RETURN CASE WHEN FOUND THEN 'marked_dead' ELSE 'lease_live' END;
END
$$;
