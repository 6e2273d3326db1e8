"""Objects in an S3 bucket (or an S3-compatible store: MinIO, R2) through boto3.

Credentials come from the config when set, else from boto3's usual chain (environment, shared
files, instance roles). A put_object is atomic on S3: readers never see part of an object.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from datetime import UTC

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError
from loraplex.errors import ConfigError

from .config import StoreConfig
from .errors import BlobMissingError, StoreError
from .object_store import ObjectInfo, check_key

_MISSING = ("404", "NoSuchKey", "NotFound")


class S3ObjectStore:
    def __init__(self, bucket: str, prefix: str, config: StoreConfig):
        if not bucket:
            raise ConfigError("the S3 object store needs a bucket (s3://bucket/prefix)")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        session = boto3.session.Session(
            aws_access_key_id=config.s3_access_key_id,
            aws_secret_access_key=config.s3_secret_access_key,
            region_name=config.s3_region,
        )
        self._s3 = session.client(
            "s3",
            endpoint_url=config.s3_endpoint_url,
            config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=16),
        )

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
        try:
            # The store checks the body against this checksum, so a corrupted transfer is refused there.
            self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumSHA256=digest)
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"cannot write {key} to {self.url}: {e}") from e

    def get(self, key: str) -> bytes:
        try:
            return self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                raise BlobMissingError(f"object {key} is missing from {self.url}") from None
            raise StoreError(f"cannot read {key} from {self.url}: {e}") from e
        except BotoCoreError as e:
            raise StoreError(f"cannot read {key} from {self.url}: {e}") from e

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise StoreError(f"cannot stat {key} in {self.url}: {e}") from e
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].astimezone(UTC))

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"cannot delete {key} from {self.url}: {e}") from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.prefix):]
                    yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].astimezone(UTC))
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"cannot list {self.url}: {e}") from e

    def remove_partial_writes(self, older_than_s: float) -> int:
        return 0  # put_object is atomic; multipart uploads are not used
