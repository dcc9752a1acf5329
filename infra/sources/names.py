"""Names from a source, as text and as path components.

A file or tar member name arrives as bytes: `os` and `tarfile` hand over the bytes that are not UTF-8 as lone
surrogates (``surrogateescape``), which no UTF-8 file can hold. Three rules:

* `name_key`: a name as the text a ledger row holds (key, id, group, member names): itself when it is UTF-8 text
  without a backslash, else `escaped` (backslashes doubled, each undecodable byte ``\\xNN``): deterministic, and
  two names never share a key (an escaped key always holds a backslash, an unescaped one never does).
* `output_part`: a name that is UTF-8 text as one safe path component under OUT. A name that is already safe
  (`SAFE_NAME`) is itself, so caches of safe names keep their paths and bytes; any other becomes an ASCII slug of
  it plus ``-`` and 8 hex digits of the sha256 of its NFC form (``sample 1080p`` → ``sample_1080p-…``,
  ``Straße`` → ``Strasse-…``): the NFC and NFD spellings of a name give the same part.
* `collision_key`: what two output names are compared by at plan time: case-folded and NFC, so that two samples
  never share a file on a case-insensitive or normalising file system either.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable

#: Groups, ids and shard ids become path components: only these characters, never "." or "..".
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}$")
#: The longest slug kept before the hash (the whole part stays far under a file system's 255 bytes).
SLUG_CHARS = 64
HASH_DIGITS = 8
#: Letters that NFKD does not split into an ASCII letter and marks.
_ASCII_FOR = str.maketrans({"ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "ł": "l"})
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9.+=@-]+")


def is_safe_name(name: str) -> bool:
    """True when `name` can be used as one path component under OUT as it is."""
    return bool(SAFE_NAME.fullmatch(name)) and ".." not in name


def is_text(text: str) -> bool:
    """True when `text` is valid Unicode text (no lone surrogate: what a name not UTF-8 leaves behind)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escape(char: str, backslash: str) -> str:
    code = ord(char)
    if char == "\\":
        return backslash
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as surrogateescape hands it over
        return f"\\x{code - 0xDC00:02x}"
    if 0xD800 <= code <= 0xDFFF:  # any other lone surrogate (a JSON "\ud800")
        return f"\\u{code:04x}"
    return char


def escaped(text: str) -> str:
    """`text` as valid text, reversibly: backslashes doubled, undecodable bytes ``\\xNN``, lone surrogates
    ``\\uNNNN``."""
    return "".join(_escape(char, "\\\\") for char in text)


def safe_text(text: str) -> str:
    """`text` unchanged when it is valid text, else with its lone surrogates shown as ``\\xNN`` / ``\\uNNNN``:
    for messages and reasons, which must always be writable."""
    return text if is_text(text) else "".join(_escape(char, "\\") for char in text)


def name_key(name: str) -> str:
    """The text a ledger holds for a source name: itself, or `escaped` when it is not text or holds a backslash."""
    return name if is_text(name) and "\\" not in name else escaped(name)


def nameable(part: str) -> bool:
    """True when `part` can be named under OUT (through `output_part`): UTF-8 text, not empty, ``.`` or ``..``,
    no NUL and no ``/``."""
    return is_text(part) and part not in ("", ".", "..") and "\0" not in part and "/" not in part


def output_part(part: str) -> str:
    """One nameable path component as a safe one: itself when safe, else ``<slug>-<hash>`` (see the module)."""
    if is_safe_name(part):
        return part
    nfc = unicodedata.normalize("NFC", part)
    ascii_form = unicodedata.normalize("NFKD", nfc.translate(_ASCII_FOR)).encode("ascii", "ignore").decode()
    slug = re.sub(r"\.{2,}", ".", _UNSAFE_RUN.sub("_", ascii_form))
    slug = slug.lstrip("._+=@-")[:SLUG_CHARS].rstrip(".")
    digest = hashlib.sha256(nfc.encode("utf-8")).hexdigest()[:HASH_DIGITS]
    return f"{slug}-{digest}" if slug else digest


def output_stem(parts: Iterable[str]) -> str:
    """An OUT-relative stem from nameable components, each through `output_part`."""
    return "/".join(output_part(part) for part in parts)


def collision_key(stem: str) -> str:
    """What two output stems are compared by: one file on a case-insensitive, normalising file system."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", stem).casefold())


#: The empty group (a top-level file of a folder source, a metadata row without one) as every report prints it.
NO_GROUP = "(no group)"


def group_name(group: str) -> str:
    """A group as printed: itself, or `NO_GROUP` for the empty one."""
    return group or NO_GROUP


def sample_name(group: str, sample_id: str) -> str:
    """A sample as printed, the same everywhere: ``GROUP/ID``; the id alone where it already starts with its group
    (a folder source's ``film/Megamind.avi`` in group ``film``) or the group is empty (a top-level ``tree.avi``)."""
    if not group or sample_id == group or sample_id.startswith(group + "/"):
        return sample_id
    return f"{group}/{sample_id}"


#: Characters a store key may not hold: C0 and C1 controls and DEL (a log line, a terminal or a report would act on
#: them; no name of a sample needs one).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def store_key_problem(rel: str) -> str | None:
    """Why an object's key below a source's prefix (`rel`: the key past the prefix and its ``/``) cannot name a
    sample, or None. A store keeps keys as they are, so a key whose parts a path would read otherwise is refused:
    a ``..`` part (it leads out of the prefix), a ``.`` part, an empty part (a leading ``/``, a ``//``), a control
    character. Such an object is a skipped row (``bad_layout``), as an unsafe local name is, never read."""
    if _CONTROL.search(rel):
        return "holds a control character"
    parts = rel.split("/")
    if ".." in parts:
        return "has a '..' part: it leads out of its prefix"
    if "." in parts:
        return "has a '.' part"
    if "" in parts:
        return "has an empty part (a leading '/' or a '//')"
    return None


def key_text(key: str) -> str:
    """A store key as a ledger row holds it (`name_key`), its control characters shown as ``\\xNN`` too (a shown
    key holds a backslash whenever it was changed, as `name_key`'s)."""
    if not _CONTROL.search(key):
        return name_key(key)
    return "".join(f"\\x{ord(c):02x}" if _CONTROL.match(c) else _escape(c, "\\\\") for c in key)
