"""Plain clients of the test object stores (boto3 for S3; the GCS JSON API over urllib; tensorstore specs written
by hand), so that tests check what is in a bucket without going through dist_ckpt."""

import json
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass

import boto3


@dataclass
class Bucket:
    """One fresh bucket on a test server, and plain ways to look into it."""

    server: object  # the conftest's ObjectStoreServer
    name: str

    @property
    def scheme(self) -> str:
        return self.server.scheme

    def url(self, path: str = "") -> str:
        return self.server.url(self.name, path)

    def keys(self, prefix: str = "") -> list[str]:
        """Every object name under `prefix`, as the server lists them."""
        if self.scheme == "s3":
            client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
            return sorted(item["Key"] for page in pages for item in page.get("Contents", []))
        query = urllib.parse.urlencode({"prefix": prefix})
        with urllib.request.urlopen(f"{self.server.endpoint}/storage/v1/b/{self.name}/o?{query}") as response:
            return sorted(item["name"] for item in json.load(response).get("items", []))

    def modified(self, prefix: str) -> dict[str, float]:
        """S3 only: each object's LastModified time."""
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        listed = client.list_objects_v2(Bucket=self.name, Prefix=prefix).get("Contents", [])
        return {item["Key"]: item["LastModified"].timestamp() for item in listed}

    def delete(self, key: str) -> None:
        if self.scheme == "s3":
            boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).delete_object(Bucket=self.name, Key=key)
            return
        quoted = urllib.parse.quote(key, safe="")
        request = urllib.request.Request(f"{self.server.endpoint}/storage/v1/b/{self.name}/o/{quoted}", method="DELETE")
        urllib.request.urlopen(request).read()

    def kvstore(self, path: str) -> dict:
        """A tensorstore kvstore spec of `path` in this bucket, written by hand from the server's address."""
        if self.scheme == "s3":
            return {
                "driver": "s3",
                "bucket": self.name,
                "path": path,
                "endpoint": self.server.endpoint,
                "aws_region": "us-east-1",
            }
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.server.endpoint
        return {"driver": "gcs", "bucket": self.name, "path": path}
