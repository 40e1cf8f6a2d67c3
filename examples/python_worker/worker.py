"""A worker for outbox-relay's jobs, in Python (boto3 + psycopg 3).

The protocol lives in PostgreSQL (migration 6, `migrations/0006_job_protocol.sql`);
this worker is only the statements around it, so it gets the same guarantees
as the Rust library: a message is judged by the job row, never by itself, and
the handler's writes commit in the same transaction as the job's success.

    python worker.py --database-url postgres://app@db/app --queue-url URL \
        [--endpoint-url http://127.0.0.1:4566] [--worker-id w1] [--lease 30]

The handler below writes one `business_effects` row per job; put yours there.
"""

import argparse
import json
import signal
import sys
import threading
import time

import boto3
import botocore.config
import psycopg

RUNNING = True


def handle(cur, job_id, kind, payload, attempt, generation, args):
    """The business effect, in the job's transaction (`cur`)."""
    if args.handler_sleep:
        time.sleep(args.handler_sleep)
    cur.execute(
        "INSERT INTO business_effects (job_id, generation, attempt) VALUES (%s, %s, %s)",
        (job_id, generation, attempt),
    )


SIZE_ATTRIBUTES = ["ExtendedPayloadSize", "SQSLargePayloadSize"]
POINTER_CLASS = "software.amazon.payloadoffloading.PayloadS3Pointer"


def resolve(s3, msg):
    """The message's body; one the relay put in S3 (the SQS Extended Client's
    pointer and ExtendedPayloadSize attribute) is read from there. The object
    is not deleted: a duplicate delivery may still point at it (a bucket
    lifecycle rule removes it). Raises if it cannot be read: the message then
    comes back after its visibility timeout."""
    body = msg["Body"]
    if not set(SIZE_ATTRIBUTES) & set(msg.get("MessageAttributes", {})):
        return body
    try:
        cls, ptr = json.loads(body)
    except ValueError:
        return body
    if cls != POINTER_CLASS:
        return body
    return s3().get_object(Bucket=ptr["s3BucketName"], Key=ptr["s3Key"])["Body"].read().decode()


def parse(body):
    """(job_id, kind, generation) of a job message, or None."""
    try:
        m = json.loads(body)
        job_id, kind, generation = m["job_id"], m["kind"], int(m["generation"])
    except (ValueError, KeyError, TypeError):
        return None
    if not job_id or not kind or generation < 0:
        return None
    return job_id, kind, generation


def batch(sqs, call, queue_url, entries):
    """A batch call (delete or change visibility); a failed entry is retried alone."""
    if not entries:
        return
    out = getattr(sqs, call + "_batch")(QueueUrl=queue_url, Entries=entries)
    for failed in out.get("Failed", []):
        entry = next(e for e in entries if e["Id"] == failed["Id"])
        single = {k: v for k, v in entry.items() if k != "Id"}
        getattr(sqs, call)(QueueUrl=queue_url, **single)


class Lease(threading.Thread):
    """The lease heartbeat: every lease/3, renew the lease and the message's
    visibility; `stop` is set when the job was cancelled or the claim fenced."""

    def __init__(self, args, sqs, job, receipt):
        super().__init__(daemon=True)
        self.args, self.sqs, self.job, self.receipt = args, sqs, job, receipt
        self.done = threading.Event()
        self.stop = threading.Event()

    def run(self):
        with psycopg.connect(self.args.database_url, autocommit=True) as conn:
            while not self.done.wait(self.args.lease / 3):
                (state,) = conn.execute(
                    "SELECT outbox_renew_job_lease(%s, %s, %s, %s, %s)", (*self.job, self.args.lease)
                ).fetchone()
                if state != "fenced":
                    self.sqs.change_message_visibility(
                        QueueUrl=self.args.queue_url, ReceiptHandle=self.receipt,
                        VisibilityTimeout=int(self.args.lease) + 5,
                    )
                if state != "held":
                    self.stop.set()


def run_job(args, conn, sqs, worker_id, msg, row):
    """A claimed job: the handler and the success in one transaction.
    Returns the queue action: ("delete",), ("hide", seconds) or None."""
    _, _, attempt, payload, _, _, _ = row
    job_id, kind, generation = parse(msg["Body"])
    fence = (job_id, worker_id, attempt, generation)
    lease = Lease(args, sqs, fence, msg["ReceiptHandle"])
    lease.start()
    try:
        try:
            with conn.transaction():
                with conn.cursor() as cur:
                    handle(cur, job_id, kind, payload, attempt, generation, args)
                    (held,) = cur.execute("SELECT outbox_succeed_job(%s, %s, %s, %s)", fence).fetchone()
                    if not held:
                        raise Fenced()
            return ("delete",)
        except Fenced:
            return None  # the job changed under us: effects rolled back
        except Exception as e:  # a failed attempt: retry with the protocol's backoff
            (after,) = conn.execute(
                "SELECT outbox_retry_job(%s, %s, %s, %s, %s, %s, %s)",
                (*fence, str(e), args.retry_base, args.retry_max),
            ).fetchone()
            return None if after is None else ("hide", after)
    finally:
        lease.done.set()


class Fenced(Exception):
    pass


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", required=True)
    p.add_argument("--queue-url", required=True)
    p.add_argument("--endpoint-url")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--worker-id", default="py-worker")
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--retry-base", type=float, default=2.0)
    p.add_argument("--retry-max", type=float, default=3600.0)
    p.add_argument("--wait", type=int, default=1, help="long-poll seconds")
    p.add_argument("--handler-sleep", type=float, default=0.0, help="seconds each job takes (tests)")
    p.add_argument("--kind", action="append", default=["effect"], help="job kinds this worker runs")
    args = p.parse_args()

    def stop(*_):
        global RUNNING
        RUNNING = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sqs = boto3.client("sqs", endpoint_url=args.endpoint_url, region_name=args.region)
    s3_client = []

    def s3():
        if not s3_client:
            path_style = botocore.config.Config(s3={"addressing_style": "path"}) if args.endpoint_url else None
            s3_client.append(boto3.client("s3", endpoint_url=args.endpoint_url, region_name=args.region, config=path_style))
        return s3_client[0]

    conn = psycopg.connect(args.database_url, autocommit=True)
    print("ready", flush=True)
    while RUNNING:
        msgs = sqs.receive_message(
            QueueUrl=args.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=args.wait,
            MessageAttributeNames=SIZE_ATTRIBUTES,
        ).get("Messages", [])
        readable = []
        for m in msgs:
            try:
                m["Body"] = resolve(s3, m)
                readable.append(m)
            except Exception as e:  # left to come back after its visibility timeout
                print(f"body in S3 not readable: {e}", file=sys.stderr, flush=True)
        msgs = readable
        # Unparseable messages and kinds this worker does not run are left
        # alone: SQS's redrive policy moves them to the DLQ.
        asked = [(m, parse(m["Body"])) for m in msgs]
        asked = [(m, j) for m, j in asked if j is not None and j[1] in args.kind]
        if not asked:
            continue
        rows = conn.execute(
            "SELECT ord, action, attempt, payload, rescued, delay_secs, reason FROM outbox_claim_jobs(%s, %s, %s, %s, %s)",
            ([j[0] for _, j in asked], [j[1] for _, j in asked], [j[2] for _, j in asked], args.worker_id, args.lease),
        ).fetchall()
        deletes, hides = [], []
        for row in rows:
            msg = asked[row[0] - 1][0]
            action, delay = row[1], row[5]
            if action == "run":
                todo = run_job(args, conn, sqs, args.worker_id, msg, row)
            elif action in ("skip", "stale", "dead"):
                todo = ("delete",)
            elif action in ("not_due", "busy"):
                todo = ("hide", delay)
            elif action == "fenced":
                todo = ("hide", args.lease)
            else:  # unknown_job, wrong_wiring: leave for the DLQ
                print(f"left for the DLQ: {action} {row[6]}", file=sys.stderr, flush=True)
                todo = None
            if todo and todo[0] == "delete":
                deletes.append({"Id": str(len(deletes)), "ReceiptHandle": msg["ReceiptHandle"]})
            elif todo:
                hides.append({
                    "Id": str(len(hides)), "ReceiptHandle": msg["ReceiptHandle"],
                    "VisibilityTimeout": min(int(todo[1] + 0.999), 43200),
                })
        batch(sqs, "delete_message", args.queue_url, deletes)
        batch(sqs, "change_message_visibility", args.queue_url, hides)
    conn.close()


if __name__ == "__main__":
    main()
