"""URLs as latentforge takes and shows them: a URL names a place, never a key (credentials come from each store's own
chain: docs/object-storage.md).

* `secret_in`: what in a setting (a URL, or ``KIND:URL``) carries a credential: a ``user:password@`` (or ``token@``)
  part, or a query, fragment or matrix parameter whose name signs or authenticates (``X-Amz-Signature``,
  ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``X-Goog-Signature``, ``sig``, ``token``, ``access_token``,
  ``api_key``, ``password``, ...; percent-encoded names too). Such a setting is refused, and never printed.
* `redacted`: a text with every URL in it shown without a credential of any shape: its userinfo as ``***@`` and the
  value of every ``name=value`` parameter after ``?``, ``&``, ``#`` or ``;`` as ``***`` (a glob's ``?`` stays). Every
  line that may hold a URL goes through it: the ``error:`` line, the terminal's log lines, a store's messages.
* `bucket_problem`: what breaks S3's bucket naming rules; `endpoint_problem`: what is wrong with an endpoint URL
  setting (``AWS_ENDPOINT_URL``, ``HF_ENDPOINT``). Both are found before anything starts, as one line naming the
  setting (`infra.config`, `flows.preflight`), instead of a store library's traceback.

Imports nothing of the project: every floor may use it.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import unquote, urlsplit

#: A URL in a text: its scheme, then what a URL may hold up to a space or a quote.
_IN_TEXT = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s\"'<>`]*)")
#: A parameter ``name=`` after ``?``, ``&``, ``#`` or ``;``.
_PARAM = re.compile(r"(?P<sep>[?&#;])(?P<name>[^=?&#;/]*)=(?P<value>[^&#;]*)")
#: Names of parameters that carry a credential (matched in the name, case-insensitive, percent-decoded).
_SECRET_NAME = re.compile(
    r"sig|token|key|secret|pass|pwd|credential|auth|session|sas|jwt|policy|code|otp|bearer|cookie", re.IGNORECASE
)
#: S3's rules: 3-63 of lowercase letters, digits, dots and hyphens, a letter or digit at each end.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: Prefixes and suffixes S3 reserves.
_RESERVED = (("xn--", "sthree-", "amzn-s3-demo-"), ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3"))
#: The schemes whose URLs start with an S3 bucket.
S3_SCHEMES = ("s3", "s3a")


def _urls(value: str) -> list[tuple[str, str]]:
    """(scheme, what follows ``://``) of every URL in `value`."""
    return [(m["scheme"][:-3].lower(), m["rest"]) for m in _IN_TEXT.finditer(value)]


def _authority(rest: str) -> tuple[str, str]:
    """(the authority, the rest from its first ``/``, ``?`` or ``#``) of what follows ``://``."""
    cut = re.search(r"[/?#]", rest)
    return (rest[: cut.start()], rest[cut.start() :]) if cut else (rest, "")


def _has_userinfo(authority: str) -> bool:
    """A ``user@`` / ``user:password@`` part, or a ``user:password`` cut short by a ``/`` in the password: a colon
    that is not a port's (a bucket or a host never holds one)."""
    host = authority.rsplit("]", 1)[-1]  # an IPv6 literal's colons are its own
    return "@" in authority or (":" in host and not host.rpartition(":")[2].isdigit())


def secret_in(value: str) -> str | None:
    """What makes a setting carry a credential (see the module), in words that never quote it; None: nothing."""
    for _, rest in _urls(value):
        if _has_userinfo(_authority(rest)[0]):
            return "a user:password@ (or token@) part"
        for param in _PARAM.finditer(rest):
            name = unquote(param["name"])
            if _SECRET_NAME.search(name):
                return f"a {name[:40]!r} parameter (a signature, token or key)"
    return None


def _redact_one(match: re.Match[str]) -> str:
    rest = match["rest"]
    authority, tail = _authority(rest)
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    elif _has_userinfo(authority):  # a password with a "/" in it: hidden up to the "@" that ends it, if any
        head = re.split(r"[?#]", rest, maxsplit=1)[0]
        authority, tail = ("***@", rest[head.index("@") + 1 :]) if "@" in head else ("***", tail)
    return match["scheme"] + authority + _PARAM.sub(lambda p: f"{p['sep']}{p['name']}=***", tail)


def redacted(text: str) -> str:
    """`text` with every URL's credentials hidden, whatever their shape (see the module)."""
    return _IN_TEXT.sub(_redact_one, text) if "://" in text else text


def bucket_problem(name: str) -> str | None:
    """Why `name` is not a valid S3 bucket name (S3's naming rules), or None."""
    if not 3 <= len(name) <= 63:
        return f"a bucket name has 3 to 63 characters, this one {len(name)}"
    if not _BUCKET.match(name):
        return "a bucket name holds lowercase letters, digits, dots and hyphens only, a letter or digit at each end"
    if ".." in name:
        return "a bucket name has no two dots in a row"
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        pass
    else:
        return "a bucket name is not an IP address"
    starts, ends = _RESERVED
    if name.startswith(starts) or name.endswith(ends):
        return f"a bucket name does not start with {', '.join(starts)} or end with {', '.join(ends)} (reserved)"
    return None


def s3_bucket(value: str) -> tuple[str, str] | None:
    """(the URL, its bucket) of the first ``s3://`` (``s3a://``) URL in a setting (``KIND:URL`` too); None if none."""
    for scheme, rest in _urls(value):
        if scheme in S3_SCHEMES:
            return f"{scheme}://{rest}", re.split(r"[/?#]", rest, maxsplit=1)[0]
    return None


def endpoint_problem(value: str) -> str | None:
    """Why `value` cannot be an endpoint URL (``http(s)://HOST[:PORT][/PATH]``), or None."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    if not parts.hostname:
        return "names no host"
    if any(ch.isspace() for ch in value):
        return "holds a space"
    if parts.username or parts.password:
        return "holds a user:password@ part (credentials come from the store's own chain)"
    if port is not None and not 0 < port < 65536:
        return f"port {port} is out of range"
    return None


#: botocore's rule for a region name (a host label).
_REGION = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")
#: The store settings read from the environment, per scheme: (variable, what it must be).
STORE_SETTINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "s3": (("AWS_ENDPOINT_URL_S3", "endpoint"), ("AWS_ENDPOINT_URL", "endpoint"), ("AWS_REGION", "region"),
           ("AWS_DEFAULT_REGION", "region")),
    "hf": (("HF_ENDPOINT", "endpoint"),),
}  # fmt: skip


def url_problem(value: str) -> str | None:
    """Why a setting that may be a URL (``KIND:URL`` too) cannot be taken: credentials in it (`secret_in`, the value
    never quoted), or an S3 bucket name S3 refuses; None: nothing."""
    if (secret := secret_in(value)) is not None:
        return f"a URL with credentials ({secret}) is refused: credentials come from the store's own chain"
    found = s3_bucket(value)
    if found is not None and (why := bucket_problem(found[1])) is not None:
        return f"bucket {found[1]!r}: {why}"
    return None


def store_settings_problem(values: list[str], environ: dict[str, str]) -> str | None:
    """Why a store setting of the environment (`STORE_SETTINGS`) that a URL among `values` would use is malformed
    (``AWS_ENDPOINT_URL='not a url': not an http:// or https:// URL``), or None."""
    schemes = {"s3" if scheme in S3_SCHEMES else scheme for value in values for scheme, _ in _urls(value)}
    for scheme in sorted(schemes & set(STORE_SETTINGS)):
        for name, kind in STORE_SETTINGS[scheme]:
            value = environ.get(name)
            if value is None:
                continue
            why = endpoint_problem(value) if kind == "endpoint" else None
            if kind == "region" and not _REGION.match(value):
                why = "not a region name (letters, digits and hyphens)"
            if why is not None:
                return f"{name}={redacted(value)!r}: {why}"
    return None
