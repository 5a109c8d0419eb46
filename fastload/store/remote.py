"""Object storage: URLs, and thin retried operations through one client (``obstore``).

Owns: telling a remote URL from a local path (``is_remote``: the one test every room uses; anything of
the form ``scheme://`` is a supported URL with a bucket or an error naming the schemes, never a local
path), parsing it (``RemoteLocation``),
and the few operations the rest of fastload needs (``get_bytes``, ``put_bytes``,
``upload_file``, ``download_file``, ``head``, ``list_prefix``, ``delete``). Every failure
becomes one ``RemoteStoreError`` naming the URL, with a HINT for the usual causes (wrong
credentials, missing bucket, unreachable endpoint).

Client: ``obstore`` (the Rust ``object_store`` crate: S3, GCS, Azure in one wheel; the
choice is argued in docs/object-storage.md). Credentials and endpoint come only from the
standard environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``GOOGLE_*``, ``AZURE_*``), read when a bucket is first used in a process.
An ``http://`` endpoint is allowed because the user named it (``AWS_ALLOW_HTTP`` is then not
needed). For ``s3://``, when no credential source is set (``AWS_CREDENTIAL_VARS``) and the machine is
not an EC2 instance (whose role obstore would ask its metadata endpoint for), the first use of a bucket
fails at once with reason "credentials", naming the variables read: obstore would otherwise ask the
metadata endpoint for ~10 s and report "cannot reach the endpoint".
Retries: on transient errors (connection failures, 5xx, throttling; never on 4xx
answers) each operation keeps retrying, with jittered exponential backoff (0.1 s growing to at
most 2 s between tries), for a **retry budget** of ``RETRY_BUDGET_S`` seconds (30: an endpoint
gone for 10-20 s, a server restart, is ridden out), then raises naming the URL. The budget comes
from ``FASTLOAD_REMOTE_RETRY_S`` when set (an environment variable, like the endpoint: it reaches
DataLoader workers and the download child processes unchanged). obstore retries each request;
``download_file`` (the shard downloads) instead asks obstore for 2 s per request and tries again
itself, on a new client, until the budget is spent (a body broken mid-way too): see ``_drop_store``.
Reads (GET, HEAD, LIST: ``_store(reads=True)``) also give up on a connection the server accepted but
sends nothing on for the stall limit (``STALL_S``, 10 s: obstore's ``read_timeout``; from
``FASTLOAD_REMOTE_STALL_S`` when set, as the budget), and ask again on a new
one: without it such a request waits for the whole request timeout with no retry, as a request that
connected while a restarted endpoint came back did. With the stall limit, a read's whole-request
limit is lifted (a big shard on a slow link may stream for longer than 300 s). Writes have no
such limit (a server may take longer than that to answer a large upload's last part).

Must not: know about LMDB, shards or images (``manifest.py`` and ``pack/`` do).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastload.errors import MissingDependencyError, RemoteStoreError

__all__ = ["SCHEMES", "AWS_CREDENTIAL_VARS", "is_remote", "RemoteLocation", "get_bytes", "get_range", "open_reader",
           "put_bytes", "upload_file", "download_file", "head", "stat", "list_prefix", "list_objects", "listed_once",
           "delete", "RETRY_BUDGET_S", "RETRY_ENV", "retry_budget", "retry_config", "STALL_S", "STALL_ENV",
           "stall_limit"]

#: URL schemes handled here (obstore's names); only s3:// is tested against a real server.
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss")
_URL_RE = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<bucket>[^/]+)/?(?P<prefix>.*)$")
#: anything of the form ``scheme://`` (RFC 3986 scheme characters): a URL, never a local path
_LOOKS_LIKE_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://")

_SUPPORTED = ", ".join(f"{sch}://" for sch in SCHEMES)

#: Seconds one operation keeps retrying transient failures before it raises (``FASTLOAD_REMOTE_RETRY_S``).
RETRY_BUDGET_S = 30.0
RETRY_ENV = "FASTLOAD_REMOTE_RETRY_S"
#: Reads: seconds without a byte from the server before the request is given up and asked again (a request
#: whose connection the server accepted and then never answered: a restarting endpoint, a hung server);
#: ``FASTLOAD_REMOTE_STALL_S`` when set.
STALL_S = 10.0
STALL_ENV = "FASTLOAD_REMOTE_STALL_S"
_BACKOFF = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2), "base": 2.0}


def _seconds(env: str, default: float, *, zero: bool) -> float:
    """Seconds from the environment variable ``env`` when set, else ``default``; ``zero``: 0 is allowed."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero else value > 0) or value == float("inf"):
        raise ValueError(f"Unknown value {raw!r} for {env}. Valid values are a number of seconds "
                         f"{'>= 0' if zero else '> 0'} (default {default:g}).")
    return value


def retry_budget() -> float:
    """The retry budget in seconds: ``FASTLOAD_REMOTE_RETRY_S`` when set, else ``RETRY_BUDGET_S``.

    Raises:
        ValueError: the variable is not a number of seconds >= 0.
    """
    return _seconds(RETRY_ENV, RETRY_BUDGET_S, zero=True)


def stall_limit() -> float:
    """The reads' stall limit in seconds: ``FASTLOAD_REMOTE_STALL_S`` when set, else ``STALL_S``.

    Raises:
        ValueError: the variable is not a number of seconds > 0.
    """
    return _seconds(STALL_ENV, STALL_S, zero=False)


def retry_config(budget: float) -> dict:
    """obstore's retry policy for a budget of ``budget`` seconds: the time bounds it, not a count
    (the backoff is jittered, so a count of tries says little about the time they cover)."""
    return {"max_retries": 10 + int(budget * 10), "backoff": dict(_BACKOFF),
            "retry_timeout": timedelta(seconds=budget)}


#: Where obstore takes S3 credentials from (besides an EC2 instance's metadata endpoint): a key pair, a web
#: identity token (EKS), a container's credentials endpoint (ECS), a metadata endpoint the user named, or
#: unsigned requests to a public bucket.
AWS_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                       "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                       "AWS_METADATA_ENDPOINT", "AWS_SKIP_SIGNATURE")
#: Files that say "this is an EC2 instance" without a request (Nitro: DMI vendor; Xen: hypervisor uuid "ec2…").
_EC2_MARKS = ("/sys/devices/virtual/dmi/id/sys_vendor", "/sys/devices/virtual/dmi/id/board_vendor",
               "/sys/hypervisor/uuid")


def _on_ec2() -> bool:
    for mark in _EC2_MARKS:
        with contextlib.suppress(OSError):
            text = Path(mark).read_text().strip().lower()
            if "amazon" in text or text.startswith("ec2"):
                return True
    return False


def _no_credentials(loc: RemoteLocation) -> RemoteStoreError | None:
    """The error for an ``s3://`` bucket with no credential source at all, or None (checked with no request)."""
    if loc.scheme not in ("s3", "s3a"):
        return None
    env = {k: os.environ.get(k, "").strip() for k in AWS_CREDENTIAL_VARS}
    if (env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]) or any(
            env[k] for k in AWS_CREDENTIAL_VARS[3:7]) or env["AWS_SKIP_SIGNATURE"].lower() in ("true", "1") \
            or _on_ec2():
        return None
    missing = "AWS_SECRET_ACCESS_KEY is not set" if env["AWS_ACCESS_KEY_ID"] else (
        "AWS_ACCESS_KEY_ID is not set" if env["AWS_SECRET_ACCESS_KEY"] else "none of them is set")
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "the provider's default endpoint"
    return RemoteStoreError(
        f"{loc}: no credentials found: fastload (through obstore) reads them only from the environment, "
        f"{', '.join(AWS_CREDENTIAL_VARS)}; {missing}, and this machine is not an EC2 instance (no role to ask "
        f"for).\nHINT: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for {endpoint} (~/.aws/credentials "
        "is not read); AWS_SKIP_SIGNATURE=true for a public bucket", url=str(loc), reason="credentials")


_CLIENT = {"connect_timeout": "5s", "timeout": "300s"}
#: Reads: the whole request's limit (a 1 GB shard at 2.5 MB/s takes 400 s: over the 300 s writes have).
_READS_TIMEOUT = "24h"
_MULTIPART = 16 << 20  # upload_file: parts of this size above it

_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()


def is_remote(path: object) -> bool:
    """True for ``s3://``, ``gs://``, ``az://`` (and obstore's aliases) URLs with a bucket; False for a
    local path (relative, absolute, Windows-like ``C:\\data``: nothing of the form ``scheme://``).

    The one test every room uses to tell a URL from a path, so that a string that looks like a URL is
    never taken for a local folder (``s3:`` would be created in the working directory).

    Raises:
        RemoteStoreError: ``path`` looks like a URL (``scheme://...``) but is not a supported scheme
            (``http://``, ``file://``, upper-case ``S3://``) or has no bucket (``s3://``, ``s3:///x``);
            the message names the supported schemes.
    """
    if not isinstance(path, str):
        return False
    m = _LOOKS_LIKE_URL.match(path)
    if m is None:
        return False
    RemoteLocation.parse(path)  # raises, naming the supported schemes
    return True


@dataclass(frozen=True)
class RemoteLocation:
    """A parsed object URL: ``scheme://bucket/prefix`` (``prefix`` without leading or trailing ``/``)."""

    scheme: str
    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str | RemoteLocation) -> RemoteLocation:
        if isinstance(url, RemoteLocation):
            return url
        text = str(url)
        m = _URL_RE.match(text)
        if m is None or m.group("scheme") not in SCHEMES:
            seen = _LOOKS_LIKE_URL.match(text)
            if seen is None:
                why = "not of the form scheme://BUCKET/PREFIX"
            elif seen.group("scheme").lower() in SCHEMES and seen.group("scheme") not in SCHEMES:
                scheme = seen.group("scheme")
                why = f"schemes are written in lower case: {scheme.lower()}://, not {scheme}://"
            elif seen.group("scheme") in SCHEMES:
                why = "no bucket after " + seen.group("scheme") + "://"
            else:
                why = f"{seen.group('scheme')}:// is not a supported scheme (supported: {_SUPPORTED})"
            raise RemoteStoreError(
                f"{text}: not an object-store URL ({why}); it is not read or written as a local path "
                "either.\nHINT: use "
                f"{', '.join(sch + '://BUCKET/PREFIX' for sch in SCHEMES[::2])} (supported schemes: "
                f"{_SUPPORTED}), or a local path without '://' (e.g. ./data)", url=text, reason="other")
        return cls(m.group("scheme"), m.group("bucket"), m.group("prefix").strip("/"))

    def child(self, name: str) -> RemoteLocation:
        name = name.strip("/")
        return RemoteLocation(self.scheme, self.bucket, f"{self.prefix}/{name}" if self.prefix else name)

    @property
    def name(self) -> str:
        """The last part of the key (like ``Path.name``)."""
        return self.prefix.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def _store(loc: RemoteLocation, attempt_s: float | None = None, *, reads: bool = False):
    """This process's client for one bucket (built on first use, from the environment); obstore retries
    each request for the retry budget, or for ``attempt_s`` at most (the caller then retries itself).
    ``reads``: the client for GET, HEAD and LIST, which also gives up on a silent server (``stall_limit()``)."""
    # the environment is part of the key: credentials changed in this process take effect
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "AZURE_"))))
    budget = retry_budget() if attempt_s is None else min(retry_budget(), attempt_s)
    key = (os.getpid(), loc.scheme, loc.bucket, env, budget, reads)
    hit = _STORES.get(key)
    if hit is not None:
        return hit
    missing = _no_credentials(loc)
    if missing is not None:
        raise missing
    try:
        from obstore.store import from_url
    except ImportError:
        raise MissingDependencyError(f"{loc}: object storage needs obstore.\nHINT: pip install 'fastload[s3]'") \
            from None
    client = dict(_CLIENT)
    if reads:  # a silent server is caught by the stall limit, so a body that keeps flowing may take its time
        client.update(read_timeout=f"{round(stall_limit() * 1000)}ms", timeout=_READS_TIMEOUT)
    if loc.scheme in ("s3", "s3a") and os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        client["allow_http"] = True  # the user named a plain-http endpoint (a local MinIO or SeaweedFS)
    with _STORES_LOCK:
        try:
            store = from_url(f"{loc.scheme}://{loc.bucket}", client_options=client, retry_config=retry_config(budget))
        except Exception as exc:
            raise _error(loc, "cannot set up the client", exc) from None
        _STORES[key] = store
    return store


#: An HTTP 404 named in an error's text. Not any "404": every message holds the URL, whose port or bucket
#: name may contain those digits (a timeout against port 40412 read as "no such object" and was not retried).
_STATUS_404 = re.compile(r"\b404 Not Found\b|\bstatus(?: code)?[:= ]+404\b|\bHTTP(?:/[\d.]+)? 404\b", re.IGNORECASE)


def _error(loc: RemoteLocation | str, doing: str, exc: BaseException) -> RemoteStoreError:
    """One line naming the URL and the cause, and a HINT for the causes people meet."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "the provider's default endpoint"
    bucket = loc.bucket if isinstance(loc, RemoteLocation) else "?"
    if any(w in text for w in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                                "InvalidToken", "Unauthenticated", "AuthorizationHeaderMalformed")) or \
            type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        reason, what = "credentials", "access denied (wrong or missing credentials)"
        hint = ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*) "
                f"for {endpoint}, with read and write rights on bucket {bucket!r}")
    elif "NoSuchBucket" in text or "ContainerNotFound" in text or "bucket does not exist" in text.lower():
        reason, what = "bucket", f"bucket {bucket!r} does not exist"
        hint = f"create the bucket first, or check the bucket name and the endpoint ({endpoint})"
    elif isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or _STATUS_404.search(text):
        reason, what = "missing", "no such object"
        hint = "check the URL; a store is complete only once its manifest.json exists"
    elif any(w in text.lower() for w in ("connection refused", "error sending request", "dns error", "timed out",
                                          "connect error", "tcp connect", "failed to lookup")):
        # the node that could not reach it: on a cluster, which node's link or firewall to look at
        reason, what = "endpoint", (f"cannot reach the endpoint ({endpoint}) from node {socket.gethostname()}, "
                                    f"retried for {_budget_text()}")
        hint = ("check AWS_ENDPOINT_URL (scheme, host, port) and that the server is running and reachable from "
                f"here; {RETRY_ENV}=SECONDS retries longer")
    else:
        reason, what = "other", first[:300]
        hint = "rerun the same command: interrupted work resumes; if it persists, check the endpoint and bucket"
    url = str(loc)
    return RemoteStoreError(f"{url}: {doing} failed: {what}.\nHINT: {hint}", url=url, reason=reason)


@contextlib.contextmanager
def _failing(loc: RemoteLocation, doing: str) -> Iterator[None]:
    """Every failure inside the block is one ``RemoteStoreError`` naming ``loc`` and what was being done
    (one already worded passes through)."""
    try:
        yield
    except RemoteStoreError:
        raise
    except Exception as exc:
        raise _error(loc, doing, exc) from None


def _budget_text() -> str:
    try:
        return f"{retry_budget():g} s"
    except ValueError:
        return f"? s ({RETRY_ENV} is invalid)"


def get_bytes(url: str | RemoteLocation) -> bytes:
    """The whole object at ``url``."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, "reading"):
        return bytes(obstore.get(_store(loc, reads=True), loc.prefix).bytes())


def get_range(url: str | RemoteLocation, start: int, length: int) -> bytes:
    """``length`` bytes of the object at ``url`` from offset ``start`` (one ranged GET)."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, f"reading bytes {start}..{start + length}"):
        return bytes(obstore.get_range(_store(loc, reads=True), loc.prefix, start=start, length=length))


def open_reader(url: str | RemoteLocation):
    """A seekable, read-only file object over the object at ``url`` (ranged GETs, buffered)."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, "opening"):
        return _Reader(obstore.open_reader(_store(loc, reads=True), loc.prefix, buffer_size=4 << 20))


class _Reader(io.RawIOBase):
    """obstore's ``ReadableFile`` as a standard binary file (``read`` returns ``bytes``, as tarfile and
    pyarrow expect)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self._inner = inner

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return bytes(self._inner.read() if size is None or size < 0 else self._inner.read(size))

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


def put_bytes(url: str | RemoteLocation, data: bytes) -> None:
    """Write ``data`` as the object at ``url`` (one request: it appears whole or not at all)."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, "writing"):
        obstore.put(_store(loc), loc.prefix, data)


def upload_file(path: str | os.PathLike[str], url: str | RemoteLocation) -> None:
    """Upload a local file to ``url``; multipart above 16 MiB. The object appears only once complete."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, f"uploading {path}"):
        obstore.put(_store(loc), loc.prefix, Path(path), chunk_size=_MULTIPART, use_multipart=None)


class _BodyBroken(Exception):
    """The answer's body stopped mid-way (the connection dropped): the download starts again."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


#: download_file: how long obstore retries one request before download_file asks again with a fresh one.
#: One long obstore retry does not always see a restarted endpoint: two downloads retrying through one
#: outage (10 s, SeaweedFS restarted on the same port), one got through at once after the restart and the
#: other kept failing to connect for its whole 30 s (obstore 0.12.1, intermittent); fresh requests get through.
_ATTEMPT_S = 2.0
_TRANSIENT = ("500 Internal", "502 Bad Gateway", "503 Service", "504 Gateway", "SlowDown", "RequestTimeout")


def _drop_store(loc: RemoteLocation, attempt_s: float) -> None:
    """Forget this process's download client of ``loc``'s bucket: after an endpoint restart, requests on
    the old one kept failing to connect for the whole budget in one of three test runs (obstore 0.12.1;
    not explained), while a new client got through at once."""
    budget = min(retry_budget(), attempt_s)
    with _STORES_LOCK:
        for key in [k for k in _STORES if k[0] == os.getpid() and k[1:3] == (loc.scheme, loc.bucket)
                    and k[4] == budget and k[5]]:
            del _STORES[key]


def _transient(loc: RemoteLocation, exc: BaseException) -> bool:
    """Worth asking again: the endpoint unreachable, a 5xx answer, throttling (never a 4xx answer)."""
    if isinstance(exc, _BodyBroken):
        return True
    return _error(loc, "", exc).reason == "endpoint" or any(w in str(exc) for w in _TRANSIENT)


def _stream_to(loc: RemoteLocation, tmp: Path) -> int:
    """One GET of ``loc`` into ``tmp``: its size. obstore retries the request for ``_ATTEMPT_S``; an error
    while the body streams is ``_BodyBroken``."""
    import obstore

    result = obstore.get(_store(loc, _ATTEMPT_S, reads=True), loc.prefix)
    size = 0
    with open(tmp, "wb") as f:
        chunks = iter(result.stream(min_chunk_size=8 << 20))
        while True:
            try:
                chunk = next(chunks)
            except StopIteration:
                return size
            except Exception as exc:
                raise _BodyBroken(exc) from exc
            f.write(chunk)
            size += len(chunk)


def _no_such_object(exc: BaseException) -> bool:
    """obstore's answer for a missing object (not a local file missing)."""
    return isinstance(exc, FileNotFoundError) and "not found" in str(exc).lower() and "Object" in str(exc)


def download_file(url: str | RemoteLocation, path: str | os.PathLike[str]) -> int:
    """Stream the object at ``url`` into ``path`` (written beside it, renamed when whole); returns its size.

    A transient failure (the endpoint unreachable, a 5xx answer, a body that breaks mid-way) is asked
    again, from the start, until the retry budget (from the first try) is spent; the partial file is
    never kept. "No such object" is final at once, unless this download met the endpoint away before:
    a server coming back may answer so for objects it holds (SeaweedFS did, for a second after a
    restart), so it is asked again within the same budget."""
    loc = RemoteLocation.parse(url)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    deadline, pause, met_outage = time.monotonic() + retry_budget(), 0.1, False
    try:
        while True:
            try:
                size = _stream_to(loc, tmp)
                break
            except Exception as exc:
                now = time.monotonic()
                transient = not isinstance(exc, RemoteStoreError) and _transient(loc, exc)
                recovering = met_outage and _no_such_object(exc)
                if now >= deadline or not (transient or recovering):
                    # the body's own error as it was raised: ``from`` would overwrite the cause it carries
                    raise exc.exc if isinstance(exc, _BodyBroken) else exc  # noqa: B904
                met_outage = met_outage or transient
                _drop_store(loc, _ATTEMPT_S)  # the next try on a new client (a new connection pool)
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, 2.0)
        os.replace(tmp, path)
    except RemoteStoreError:
        raise
    except OSError as exc:
        if _no_such_object(exc):
            raise _error(loc, "downloading", exc) from None
        raise RemoteStoreError(f"{loc}: downloading to {path} failed: {exc}.\nHINT: check that the local folder "
                               "exists, is writable and has space", url=str(loc), reason="other") from None
    except Exception as exc:
        raise _error(loc, "downloading", exc) from None
    finally:
        tmp.unlink(missing_ok=True)
    return size


def _version(meta) -> str:
    """What changes when an object is overwritten: its ETag, else its last-modified time."""
    tag = meta.get("e_tag") or meta.get("version")
    if tag:
        return str(tag)
    when = meta.get("last_modified")
    return when.isoformat() if when is not None else ""


def stat(url: str | RemoteLocation) -> tuple[int, str] | None:
    """``(size, version)`` of the object at ``url`` (version: ETag, else last-modified), or None when
    there is none. S3 answers a HEAD on a missing bucket with a bare 404 (no body), so on None the
    prefix is listed too: that raises the bucket error (names it) instead of "no such object"."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, "looking up"):
        try:
            meta = obstore.head(_store(loc, reads=True), loc.prefix)
            return int(meta["size"]), _version(meta)
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise
    parent = RemoteLocation(loc.scheme, loc.bucket, loc.prefix.rsplit("/", 1)[0] if "/" in loc.prefix else "")
    with _failing(loc, "looking up"):  # one page of one key is enough to raise NoSuchBucket
        next(iter(obstore.list(_store(loc, reads=True), prefix=parent.prefix or None, chunk_size=1)), None)
    return None


def head(url: str | RemoteLocation) -> int | None:
    """The size of the object at ``url``, or None when there is none (a missing bucket raises)."""
    found = stat(url)
    return None if found is None else found[0]


_LISTED: dict[str, list[tuple[str, int, str]]] | None = None


@contextlib.contextmanager
def listed_once() -> Iterator[None]:
    """Within this block each prefix is listed once (later ``list_objects`` of it reuse the answer):
    opening a source asks "is it tar shards?", "which images?", "which sizes?" of one listing."""
    global _LISTED
    outer = _LISTED
    if outer is None:
        _LISTED = {}
    try:
        yield
    finally:
        if outer is None:
            _LISTED = None


def list_objects(url: str | RemoteLocation) -> list[tuple[str, int, str]]:
    """``(url, size, version)`` of every object under ``url`` (a folder-like prefix), sorted by URL;
    ``version``: the ETag (else last-modified), which changes when an object is overwritten."""
    import obstore

    loc = RemoteLocation.parse(url)
    memo = _LISTED
    if memo is not None and str(loc) in memo:
        return memo[str(loc)]
    with _failing(loc, "listing"):
        store = _store(loc, reads=True)
        out = []
        for batch in obstore.list(store, prefix=loc.prefix or None, chunk_size=1000):
            for meta in batch:
                out.append((str(RemoteLocation(loc.scheme, loc.bucket, meta["path"])), int(meta["size"]),
                            _version(meta)))
    out.sort()
    if memo is not None:
        memo[str(loc)] = out
    return out


def list_prefix(url: str | RemoteLocation) -> list[tuple[str, int]]:
    """``(url, size)`` of every object under ``url`` (a folder-like prefix), sorted by URL."""
    return [(u, size) for u, size, _ in list_objects(url)]


def delete(url: str | RemoteLocation) -> None:
    """Delete the object at ``url`` (no error when it is already gone)."""
    import obstore

    loc = RemoteLocation.parse(url)
    with _failing(loc, "deleting"):
        try:
            obstore.delete(_store(loc), loc.prefix)
        except FileNotFoundError:
            return
