"""The S3 store of the publish step: list with content hashes, read, and conditional (no-clobber) writes.

Every object we write carries its content sha256 in user metadata (`x-amz-meta-sha256`), so a later run
can prove a remote file unchanged without downloading it. Writes are conditional: a new path is written
with If-None-Match: * and a replaced one with If-Match: <the etag we were shown>, for single PUTs and for
CompleteMultipartUpload alike. s3transfer's managed upload cannot pass those headers (they are not in
`TransferManager.ALLOWED_UPLOAD_ARGS`), so multipart uploads are done here: the TransferConfig only
carries the sizes and the concurrency.

Credentials: the usual boto3 chain, or a prefect-aws AwsCredentials block (`upload.aws_credentials_block`).
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` (an S3-compatible store) is honoured by botocore itself.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from infra.config import UploadConfig
from infra.publish.base import LocalFile, OnSent, PublishError, Remote, RemoteConflict, RemoteFile, Target
from infra.publish.s3_client import make_client, transfer_config

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

#: Object metadata keys (S3 stores them as x-amz-meta-*, lower case).
SHA256_KEY = "sha256"
ROLE_KEY = "latentforge-role"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: Error codes of a failed write condition: 412, and 409 when a concurrent conditional write won the race.
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def make_s3_remote(target: Target, config: UploadConfig) -> S3Remote:
    """An S3Remote for `target`; a PublishError naming the extra when boto3 is not installed."""
    try:
        import boto3  # noqa: F401, PLC0415 - optional dependency, the `s3` extra
    except ImportError as exc:
        raise PublishError(f"uploading to {target.url} needs boto3: pip install latentforge[s3]") from exc
    return S3Remote(target, config)


class S3Remote(Remote):
    """`Remote` on an S3 bucket prefix (AWS, or any S3-compatible store through AWS_ENDPOINT_URL)."""

    def __init__(self, target: Target, config: UploadConfig, *, client: Any = None) -> None:
        if target.kind != "s3":
            raise ValueError(f"S3Remote needs an s3:// target, got {target.url!r}")
        self.target = target
        self._workers = config.workers
        self._transfer = transfer_config(config)
        self._client = client if client is not None else make_client(config)
        log.info("S3 target %s (endpoint %s)", target.url, self._client.meta.endpoint_url)

    def list(self) -> dict[str, RemoteFile]:
        """Every object under the prefix. The sha256 is in user metadata, which ListObjectsV2 does not return,
        so each object costs a HeadObject; they run in a pool of `workers`. (A ChecksumSHA256 would not do:
        for a multipart object S3 keeps a checksum of the part checksums, not of the content.)"""
        keys = self._keys()
        with ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="s3-head") as pool:
            heads = list(pool.map(self._head, keys))
        files = [head for head in heads if head is not None]
        log.info("%s: %d objects listed", self.target.url, len(files))
        return {f.path: f for f in files}

    def read(self, path: str) -> bytes | None:
        key = self.target.key(path)
        with _s3_errors(self._where(key)):
            try:
                response = self._client.get_object(Bucket=self.target.bucket, Key=key)
            except self._client.exceptions.NoSuchKey:
                return None
            return response["Body"].read()

    def send(self, files: Sequence[LocalFile], *, replace: Mapping[str, RemoteFile], on_sent: OnSent) -> None:
        """Store `files` in parallel (`workers` files at once). `on_sent` runs in the calling thread, one file at
        a time. On a failure no new file is started, the ones in flight finish (and are reported), then the
        first error is raised."""
        if len({f.path for f in files}) != len(files):
            raise PublishError(f"{self.target.url}: the same path was given twice in one send")
        parts = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="s3-part")
        slots = threading.BoundedSemaphore(self._workers)  # parts in memory at once, across files
        with parts, ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="s3-send") as pool:
            jobs = {pool.submit(self._send_one, f, replace.get(f.path), parts, slots): f for f in files}
            try:
                error = _collect(jobs, on_sent)
            finally:  # on any error (on_sent's, Ctrl-C) nothing new starts; the pools wait for those in flight
                for job in jobs:
                    job.cancel()
        if error is not None:
            raise error
        log.info("%s: %d files sent", self.target.url, len(files))

    # -- listing ---------------------------------------------------------------------------------------

    def _keys(self) -> list[str]:
        prefix = f"{self.target.prefix}/" if self.target.prefix else ""
        keys: list[str] = []
        with _s3_errors(f"listing {self.target.url}"):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.target.bucket, Prefix=prefix):
                keys.extend(o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/"))
        return keys

    def _head(self, key: str) -> RemoteFile | None:
        """Size, etag and sha256 from one HeadObject, so all three describe the same version of the object."""
        path = self.target.relative(key)
        if path is None:
            return None
        with _s3_errors(self._where(key)):
            try:
                head = self._client.head_object(Bucket=self.target.bucket, Key=key)
            except self._client.exceptions.ClientError as exc:
                if _code(exc) in _MISSING_CODES:  # deleted since it was listed
                    return None
                raise
        sha256 = head.get("Metadata", {}).get(SHA256_KEY)
        return RemoteFile(
            path=path,
            size=int(head["ContentLength"]),
            sha256=sha256 if sha256 and _HEX64.fullmatch(sha256) else None,
            etag=head.get("ETag"),
        )

    # -- sending ---------------------------------------------------------------------------------------

    def _send_one(
        self, file: LocalFile, old: RemoteFile | None, parts: ThreadPoolExecutor, slots: threading.Semaphore
    ) -> None:
        key = self.target.key(file.path)
        condition = _condition(self._where(key), old)
        metadata = {SHA256_KEY: file.sha256, ROLE_KEY: file.role}
        try:
            with _s3_errors(self._where(key)), self._conflicts(key, condition):
                if file.size >= self._transfer.multipart_threshold:
                    self._multipart(file, key, condition, metadata, parts, slots)
                else:
                    self._put(file, key, condition, metadata)
        except RemoteConflict:
            # A PUT retried after its reply was lost finds its own object and fails the condition. An object
            # that holds exactly our content (the core's own equality rule) is that, or an identical upload.
            if not self._holds(key, file):
                raise
            log.info("%s already holds this content (sha256 %s…): kept", self._where(key), file.sha256[:12])
        log.debug("stored %s (%d bytes)", self._where(key), file.size)

    def _holds(self, key: str, file: LocalFile) -> bool:
        found = self._head(key)
        return found is not None and found.size == file.size and found.sha256 == file.sha256

    def _put(self, file: LocalFile, key: str, condition: dict[str, str], metadata: dict[str, str]) -> None:
        data = file.read_bytes()
        digest = hashlib.sha256(data).digest()
        _check_unchanged(file, len(data), digest.hex())
        # ChecksumSHA256 makes S3 verify the body against the very hash the metadata claims.
        self._client.put_object(
            Bucket=self.target.bucket,
            Key=key,
            Body=data,
            Metadata=metadata,
            ChecksumSHA256=base64.b64encode(digest).decode(),
            **condition,
        )

    def _multipart(
        self,
        file: LocalFile,
        key: str,
        condition: dict[str, str],
        metadata: dict[str, str],
        parts: ThreadPoolExecutor,
        slots: threading.Semaphore,
    ) -> None:
        # Fail fast: refuse before sending gigabytes. This check is not atomic; the condition on
        # CompleteMultipartUpload is, where the store enforces it (AWS does for both; moto 5.2.5 only for
        # If-None-Match — there this check is the only If-Match guard).
        self._precheck(key, condition)
        bucket = self.target.bucket
        upload = self._client.create_multipart_upload(
            Bucket=bucket, Key=key, Metadata=metadata, ChecksumAlgorithm="SHA256"
        )["UploadId"]
        try:
            done = self._upload_parts(file, key, upload, parts, slots)
            self._client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done}, **condition
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
            except Exception as abort_error:  # noqa: BLE001 - the original error is the one to raise
                log.warning("%s: could not abort multipart upload %s: %s", self._where(key), upload, abort_error)
            raise

    def _upload_parts(
        self, file: LocalFile, key: str, upload: str, parts: ThreadPoolExecutor, slots: threading.Semaphore
    ) -> list[dict[str, Any]]:
        """Read the parts in order (hashing the whole content on the way) and upload them in the pool; at
        most `workers` parts are held in memory, and a failed part stops the reading. Waits for every started
        part, even after a failure, so the abort that follows leaves no part behind."""
        size = self._part_size(file.size)
        whole, read, failed = hashlib.sha256(), 0, threading.Event()
        jobs: list[Future[dict[str, Any]]] = []

        def send_part(number: int, chunk: bytes) -> dict[str, Any]:
            try:
                return self._part(key, upload, number, chunk)
            except BaseException:
                failed.set()
                raise
            finally:
                slots.release()

        try:
            with file.open() as fh:
                submitted = True
                while submitted:
                    slots.acquire()  # before reading: a part waiting for a slot is not held in memory
                    submitted = False
                    try:
                        chunk = b"" if failed.is_set() else fh.read(size)
                        if chunk:
                            whole.update(chunk)
                            read += len(chunk)
                            jobs.append(parts.submit(send_part, len(jobs) + 1, chunk))
                            submitted = True
                    finally:
                        if not submitted:  # the slot goes back here unless the part will release it
                            slots.release()
        finally:
            errors = [error for job in jobs if (error := job.exception()) is not None]
        if errors:
            raise errors[0]
        _check_unchanged(file, read, whole.hexdigest())
        return [job.result() for job in jobs]

    def _part(self, key: str, upload: str, number: int, chunk: bytes) -> dict[str, Any]:
        checksum = base64.b64encode(hashlib.sha256(chunk).digest()).decode()
        response = self._client.upload_part(
            Bucket=self.target.bucket, Key=key, UploadId=upload, PartNumber=number, Body=chunk, ChecksumSHA256=checksum
        )
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumSHA256": checksum}

    def _part_size(self, size: int) -> int:
        from s3transfer.utils import ChunksizeAdjuster  # noqa: PLC0415 - optional dependency

        return ChunksizeAdjuster().adjust_chunksize(self._transfer.multipart_chunksize, size)

    def _precheck(self, key: str, condition: dict[str, str]) -> None:
        try:
            etag = self._client.head_object(Bucket=self.target.bucket, Key=key)["ETag"]
        except self._client.exceptions.ClientError as exc:
            if _code(exc) not in _MISSING_CODES:
                raise
            etag = None
        expected = condition.get("IfMatch")
        holds = etag is None if expected is None else etag is not None and _bare(etag) == _bare(expected)
        if not holds:
            raise RemoteConflict(_conflict(self._where(key), condition, "found before the upload"))

    @contextmanager
    def _conflicts(self, key: str, condition: dict[str, str]) -> Iterator[None]:
        """A failed write condition as RemoteConflict naming the key (If-Match on a deleted key is a 404)."""
        from botocore.exceptions import ClientError  # noqa: PLC0415 - optional dependency

        try:
            yield
        except ClientError as exc:
            code = _code(exc)
            if code in _CONFLICT_CODES or ("IfMatch" in condition and code in _MISSING_CODES):
                raise RemoteConflict(_conflict(self._where(key), condition, f"S3 {code}")) from exc
            raise

    def _where(self, key: str) -> str:
        return f"s3://{self.target.bucket}/{key}"


# -- helpers -----------------------------------------------------------------------------------------------


def _collect(jobs: dict[Future[None], LocalFile], on_sent: OnSent) -> BaseException | None:
    """Report each stored file as it completes; on the first failure cancel what has not started."""
    first: BaseException | None = None
    for job in as_completed(jobs):
        if job.cancelled():
            continue
        if (error := job.exception()) is None:
            on_sent(jobs[job])
        elif first is None:
            first = error
            for pending in jobs:
                pending.cancel()
    return first


def _condition(where: str, old: RemoteFile | None) -> dict[str, str]:
    """The write condition: no object at all, or exactly the version that was listed."""
    if old is None:
        return {"IfNoneMatch": "*"}
    if not old.etag:
        raise PublishError(
            f"{where}: asked to replace an object listed without an etag; refusing an unconditional write"
        )
    return {"IfMatch": old.etag}


def _conflict(where: str, condition: dict[str, str], how: str) -> str:
    if "IfMatch" in condition:
        return (
            f"{where}: changed or deleted on the remote since it was listed (expected etag {condition['IfMatch']}); "
            f"not written ({how})"
        )
    return f"{where}: an object exists at this key and was not approved for replacement; not written ({how})"


def _check_unchanged(file: LocalFile, size: int, sha256: str) -> None:
    """What was read for sending is what was hashed: the sha256 in the metadata must be true of the bytes."""
    if (size, sha256) != (file.size, file.sha256):
        raise PublishError(
            f"{file.path}: changed since it was hashed (expected {file.size} bytes, sha256 {file.sha256[:12]}…; "
            f"read {size} bytes, sha256 {sha256[:12]}…)"
        )


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _bare(etag: str) -> str:
    return etag.strip('"')


@contextmanager
def _s3_errors(what: str) -> Iterator[None]:
    """botocore errors as PublishError naming what was being done (never the credentials)."""
    from botocore.exceptions import (  # noqa: PLC0415 - optional: the `s3` extra
        BotoCoreError,
        ClientError,
        NoCredentialsError,
    )

    try:
        yield
    except NoCredentialsError as exc:
        raise PublishError(
            f"{what}: no AWS credentials found (environment, profile, instance role), "
            "or name a prefect-aws AwsCredentials block in upload.aws_credentials_block"
        ) from exc
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        raise PublishError(f"{what}: S3 refused: {_code(exc)} (HTTP {status}): {exc}") from exc
    except BotoCoreError as exc:
        raise PublishError(f"{what}: {exc}") from exc
