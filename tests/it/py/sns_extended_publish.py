"""Publish one message to an SNS topic with AWS's SNS extended client for
Python (amazon-sns-extended-client), its body always through S3: what the
relay's messages through S3 are compared with.

usage: sns_extended_publish.py ENDPOINT TOPIC_ARN BUCKET BODY_BYTES
"""
import os
import sys

os.environ.setdefault("AWS_ACCESS_KEY_ID", "local")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import boto3  # noqa: E402
import sns_extended_client  # noqa: E402,F401  (extends boto3's SNS client)
from botocore.config import Config  # noqa: E402

endpoint, topic_arn, bucket, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
session = boto3.Session()
sns = session.client("sns", endpoint_url=endpoint)
sns.s3_client = session.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
sns.large_payload_support = bucket
sns.always_through_s3 = True
body = "theirs:" + "y" * (size - len("theirs:"))
sns.publish(TopicArn=topic_arn, Message=body, MessageAttributes={"kind": {"DataType": "String", "StringValue": "it"}})
