"""Read messages with AWS's own SQS extended client for Python
(amazon-sqs-extended-client), as a consumer would: pointers to S3 are
resolved by the library. Prints one JSON line per message: its body's size
and SHA-256, its attributes and its group id.

usage: extended_client_read.py ENDPOINT QUEUE_URL BUCKET COUNT [DEADLINE_SECONDS]
"""
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("AWS_ACCESS_KEY_ID", "local")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import boto3  # noqa: E402
import sqs_extended_client  # noqa: E402,F401  (replaces boto3's Session)
from botocore.config import Config  # noqa: E402

endpoint, queue_url, bucket, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
deadline = time.time() + (float(sys.argv[5]) if len(sys.argv) > 5 else 60)
session = boto3.Session()
sqs = session.client("sqs", endpoint_url=endpoint)
# The library's S3 client points at AWS; the local server takes path-style.
sqs.s3_client = session.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
# Needed by delete_message to take the S3 pointer back out of the receipt
# handle; the object is kept (delete_payload_from_s3 is off by default).
sqs.large_payload_support = bucket
seen = 0
while seen < count and time.time() < deadline:
    out = sqs.receive_message(
        QueueUrl=queue_url,
        MaxNumberOfMessages=10,
        WaitTimeSeconds=1,
        MessageAttributeNames=["All"],
        AttributeNames=["All"],
    )
    for m in out.get("Messages", []):
        body = m["Body"].encode()
        attrs = {k: v.get("StringValue") for k, v in m.get("MessageAttributes", {}).items()}
        print(json.dumps({
            "len": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "attributes": attrs,
            "group": m.get("Attributes", {}).get("MessageGroupId"),
        }), flush=True)
        # The library embeds the pointer in the receipt handle and takes the
        # original back as the text after its last '-', which holds for
        # SQS's handles but not for ministack's (they have dashes): take it
        # after the library's last marker instead.
        handle = m["ReceiptHandle"].rsplit("-..s3Key..-", 1)[-1]
        sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=handle)
        seen += 1
sys.exit(0 if seen >= count else 1)
