"""A store's transient errors, retried and counted: what the run report's ``store_retries`` says.

Two kinds of retry happen. botocore's own (s3fs's client) retries a ``503 SlowDown``, a 5xx and a reset or timed-out
connection with backoff; it says so only through its public events, so `watch_s3` registers two handlers on each S3
client: ``needs-retry`` names what went wrong with an attempt (in the request's context), ``request-created`` counts
an attempt after the first, by that name. A short answer (a range response with fewer bytes than asked, which no
store library checks) is asked again here for the rest, with backoff (`read_rest`).

huggingface_hub (``hf://``) asks again itself after a 408, a 429 or a 5xx (which of them depends on the call,
`HUB_RETRIED`); its shared client (`huggingface_hub.get_session()`, an httpx client) shows each request and answer to
httpx's public event hooks, so `watch_hub` adds two: an answer the Hub may be asked again for is noted (per thread),
and counted when the next request on that thread asks the same method and URL again, so an answer not asked again
(a listing's 503, the last of a read that gives up, a 404) is not counted. The Hub's retries after a connection
error (no answer to see) are not counted, nor gcsfs's (no public hook); their short answers are.

The counts are this process's (`take` hands them over and starts again at zero): a shard task takes what its reads
cost when it ends, the flow what its own reads (listing, the sanity sample) cost before the summary, so each retry
is counted once whichever process or thread made it.
OUT in S3 (`infra.outstore.StoreOut`) has its client watched the same way (`outstore.S3_WATCHERS`): its puts'
retries are counted with the reads'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from infra import outstore

logger = logging.getLogger(__name__)

#: The kinds counted: a throttling answer (503 SlowDown, 429), another 5xx, a connection reset or timed out (the Hub's
#: 408), a short range answer; "other" for a retry botocore made for a reason it did not show.
SLOW_DOWN, SERVER_ERROR, CONNECTION = "slow_down", "server_error", "connection"
SHORT_READ, OTHER = "short_read", "other"
#: The waits before asking again for the rest of a short answer (then the read is an error).
SHORT_READ_DELAYS = (0.05, 0.2, 0.8)
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
_CONTEXT_KEY = "latentforge_retry_kind"
_HOOK_ID = "latentforge-store-retries"
#: The answers huggingface_hub asks again for, by kind (checked in huggingface_hub 2.4.0, utils/_http.py): the default
#: statuses of its http_backoff, which HfFileSystem's range reads and streams and hf_hub_download's metadata HEAD (its
#: second try) retry on; hf_hub_download's GET retries 408 and 429 only, HfApi's listings none. Counted if asked again.
HUB_RETRIED = {408: CONNECTION, 429: SLOW_DOWN, 503: SLOW_DOWN, 500: SERVER_ERROR, 502: SERVER_ERROR, 504: SERVER_ERROR}

_counts: Counter[str] = Counter()
_lock = threading.Lock()
_hub_answer = threading.local()  # .last: (method, URL, kind) of this thread's last Hub answer in `HUB_RETRIED`


def count(kind: str, n: int = 1) -> None:
    with _lock:
        _counts[kind] += n


def take() -> dict[str, int]:
    """The retries counted in this process since the last `take`, by kind (sorted); the count starts again at 0."""
    with _lock:
        taken = dict(sorted(_counts.items()))
        _counts.clear()
    return taken


def add(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Two counts by kind added up (sorted by kind)."""
    summed = Counter(total)
    summed.update(more)
    return dict(sorted(summed.items()))


def watch_s3(fs: Any) -> None:
    """Count the retries of the S3 client of `fs` (an `s3fs.S3FileSystem`); registering again is a no-op."""
    events = fs.s3.meta.events  # s3fs's client (created on first use); its public event system
    events.register("needs-retry.s3", _name_the_fault, unique_id=f"{_HOOK_ID}-needs-retry")
    events.register("request-created.s3", _count_a_retry, unique_id=f"{_HOOK_ID}-request-created")


def watch_hub() -> None:
    """Count the retries of huggingface_hub's shared client; registering again is a no-op. huggingface_hub makes a new
    client after a fork, `close_session()` or a failed connection: it is watched from the next call."""
    from huggingface_hub import get_session  # noqa: PLC0415 - with the hub extra only

    # httpx's public hooks on the client huggingface_hub (>= 1.0) shares; it offers no public hook of its own (a
    # client factory, `set_client_factory`, would replace a user's, which is not readable back)
    hooks = getattr(get_session(), "event_hooks", None)
    if hooks is None:  # huggingface_hub < 1.0: a requests session, not watched
        return
    with _lock:
        for event, hook in (("request", _hub_request), ("response", _hub_response)):
            if hook not in hooks[event]:
                hooks[event].append(hook)


def _hub_response(response: Any) -> None:
    kind = HUB_RETRIED.get(response.status_code)
    _hub_answer.last = (response.request.method, str(response.request.url), kind) if kind else None


def _hub_request(request: Any) -> None:
    last, _hub_answer.last = getattr(_hub_answer, "last", None), None
    if last is not None and last[:2] == (request.method, str(request.url)):  # the same request again: a retry
        count(last[2])
        logger.debug("store: retrying after %s", last[2])


def fault_kind(response: Any, caught_exception: BaseException | None) -> str | None:
    """What went wrong with an attempt (None: nothing a retry is for): `response` is botocore's (HTTP response,
    parsed body) pair, `caught_exception` the error the attempt raised instead."""
    if caught_exception is not None:
        from botocore.exceptions import ConnectionError as Unreachable  # noqa: PLC0415 - with s3fs only
        from botocore.exceptions import HTTPClientError  # noqa: PLC0415

        return CONNECTION if isinstance(caught_exception, Unreachable | HTTPClientError) else OTHER
    if not response:
        return None
    http, parsed = response
    status = getattr(http, "status_code", 200)
    code = (parsed or {}).get("Error", {}).get("Code", "") if isinstance(parsed, dict) else ""
    if status in (429, 503) or code in _THROTTLED:
        return SLOW_DOWN
    return SERVER_ERROR if status >= 500 else None


def _name_the_fault(
    response: Any = None, caught_exception: BaseException | None = None, request_dict: Any = None, **_: Any
) -> None:
    kind = fault_kind(response, caught_exception)
    if kind is not None and isinstance(request_dict, dict):
        request_dict.setdefault("context", {})[_CONTEXT_KEY] = kind
    # returns None: whether and when to retry stays botocore's decision


def _count_a_retry(request: Any = None, **_: Any) -> None:
    context = getattr(request, "context", None) or {}
    if context.get("retries", {}).get("attempt", 1) > 1:  # botocore numbers the attempts of one call from 1
        kind = context.pop(_CONTEXT_KEY, OTHER)
        count(kind)
        logger.debug("store: retrying after %s", kind)


def read_rest(read: Callable[[int, int], bytes], start: int, want: int, where: str) -> bytes:
    """`want` bytes from `start` by `read(start, n)`: a short answer (or one its checksum refutes, `damaged`) is asked
    again for the rest after each of `SHORT_READ_DELAYS`, counted; OSError when the rest does not come."""
    data, problem = b"", None
    for delay in (*SHORT_READ_DELAYS, None):
        try:
            data += read(start + len(data), want - len(data))
            problem = None
        except Exception as exc:  # only a damaged answer is asked again; any other error is raised as it is
            if not damaged(exc):
                raise
            problem = exc
        if len(data) >= want or delay is None:
            break
        count(SHORT_READ)
        logger.debug("%s: %d of %d bytes at %d: the rest asked again (%s)", where, len(data), want, start, problem)
        time.sleep(delay)
    if len(data) < want:
        why = f": {problem}" if problem is not None else ""
        raise OSError(f"{where}: the store answered {len(data)} of {want} bytes at {start}{why}") from problem
    return data


def damaged(exc: BaseException) -> bool:
    """True for an answer whose body its own length or checksum refutes (botocore checks the whole object's checksum
    where the store sends one: a short answer of a whole object is one)."""
    try:
        from botocore.exceptions import FlexibleChecksumError, IncompleteReadError  # noqa: PLC0415 - with s3fs only
    except ImportError:
        return False
    return isinstance(exc, FlexibleChecksumError | IncompleteReadError)


outstore.S3_WATCHERS.append(watch_s3)  # OUT in S3: its client's retries counted too
