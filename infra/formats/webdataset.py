"""The webdataset format: ``OUT/shards/<shard-id>-<part:05d>.tar``, one sample per key, readable with
``webdataset.WebDataset(urls).to_tuple("npy", "txt")``.

Members of a sample with key K (the sample's stem, ``.`` written ``%2E`` and ``%`` ``%25`` so that webdataset's
"key up to the first dot" rule holds):

* ``K.npy`` the latents; ``K.text_embeddings.npy``; ``K.audio_latents.npy`` where the sample has audio; every
  other tensor the family adds (``K.prompt_attention_mask.npy``, ...). numpy has no bfloat16: a bf16 tensor is
  stored widened to float32 (exact), and the json says it was bf16 (latentforge's reader gives it back as bf16);
* ``K.txt`` the caption (UTF-8);
* ``K.json`` the metadata: id, group, stem, fingerprint, shapes, seq_len, stored dtypes, fps and geometry.

Members are written in that order, each with mtime 0, mode 0644, uid/gid 0 and no owner names: the same inputs
give the same bytes.

``--layout cc12m`` (the ``cc12m-wds`` recipe) writes the CC12M latent set's layout exactly: parts named after their
source shard's number (``shards/00000.tar``, `infra.formats.shards.part_path`), each sample only ``K.npy`` (float16
where the family stores float16) and ``K.txt``. Its parts carry no metadata: latentforge's reader takes their
fingerprint from the part's record (``ledger/parts/<part>.json``; else ``_meta.json``, else ``cache.json``); the
layout is float16 only (``--store-dtype fp16``), so the .npy holds the stored dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from infra import outdir, records
from infra.cache.cachedir import CACHE_JSON
from infra.formats.base import AUDIO_KIND, EncodedSample, opened
from infra.formats.consumer_glob import ConsumerGlob
from infra.formats.shards import META_JSON, SHARDS_DIR, ShardFormat, ShardWriter, Sink, part_record_rel, shard_options
from infra.outdir import OutFile

#: Output kind → its member's extension (``latents`` is the bare ``npy`` trainers ask for).
EXTS: dict[str, str] = {"latents": "npy", "text_embeddings": "text_embeddings.npy", AUDIO_KIND: "audio_latents.npy"}
#: Facts of `EncodedSample.info` the json keeps.
INFO_KEYS = ("fps", "geometry", "audio_duration", "frames")


def member_key(stem: str) -> str:
    """The sample's key in a tar: its stem with no dots (injective: ``%`` and ``.`` escaped)."""
    return stem.replace("%", "%25").replace(".", "%2E")


def _npy(tensor: torch.Tensor) -> bytes:
    value = tensor.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.to(torch.float32)  # exact: every bf16 is a float32
    buffer = io.BytesIO()
    np.save(buffer, value.contiguous().numpy(), allow_pickle=False)
    return buffer.getvalue()


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


def sample_members(sample: EncodedSample, layout: str | None = None) -> list[tuple[str, bytes]]:
    """(extension, bytes) of each member of a sample, in tar order (``cc12m``: the latents and the caption only)."""
    if layout == "cc12m":
        return [("npy", _npy(sample.latents)), ("txt", sample.prompt.encode("utf-8"))]
    tensors = dict(sample.outputs())
    tensors.update({k: v for k, v in sample.extras.items() if isinstance(v, torch.Tensor) and k not in tensors})
    members = [(EXTS.get(name, f"{name}.npy"), _npy(t)) for name, t in tensors.items()]
    extras = {k: _jsonable(v) for k, v in sample.extras.items() if not isinstance(v, torch.Tensor)}
    meta = {
        "id": sample.id,
        "group": sample.group,
        "stem": sample.stem,
        "fingerprint": sample.fingerprint,
        "latent_shape": sample.latent_shape,
        "source_shape": list(sample.source_shape),
        "seq_len": int(sample.seq_len),
        "dtypes": {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()},
        "info": {k: _jsonable(sample.info[k]) for k in INFO_KEYS if k in sample.info},
        "extras": {k: v for k, v in extras.items() if v is not None},
    }
    members.append(("txt", sample.prompt.encode("utf-8")))
    members.append(("json", json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")))
    return members


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class WdsWriter(ShardWriter):
    """Streams samples into tar parts."""

    ext = "tar"

    def begin(self, sink: Sink, sample: EncodedSample) -> None:
        self._tar = tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT)

    def add(self, sample: EncodedSample) -> tuple[str, int, str]:
        key = member_key(sample.stem)
        digest, size = hashlib.sha256(), 0
        for ext, data in sample_members(sample, self.layout):
            self._tar.addfile(_tarinfo(f"{key}.{ext}", len(data)), io.BytesIO(data))
            digest.update(data)
            size += len(data)
        return key, size, digest.hexdigest()

    def end(self) -> None:
        self._tar.close()


def _decode(ext: str, data: bytes) -> tuple[str, Any]:
    """A member's (record key, value): tensors by their kind's name, the caption as ``prompt``."""
    if ext == "txt":
        return "prompt", data.decode("utf-8")
    if ext == "json":
        return "json", json.loads(data)
    name = next((kind for kind, e in EXTS.items() if e == ext), ext.removesuffix(".npy"))
    return name, torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))


def _record(parts: dict[str, Any], sidecar: dict[str, Any] | None = None) -> dict[str, Any]:
    """A sample's record from its decoded members: tensors in the dtypes they were made in, metadata flattened (a
    sample without a json member, the cc12m layout: its part's `sidecar` facts)."""
    meta = parts.pop("json", None) or dict(sidecar or {})
    dtypes = meta.get("dtypes", {})
    for name, value in parts.items():
        if isinstance(value, torch.Tensor) and name in dtypes:
            parts[name] = value.to(getattr(torch, dtypes[name]))
    return {**{k: v for k, v in meta.items() if k not in ("dtypes", "extras")}, **meta.get("extras", {}), **parts}


def _split(name: str) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    key, _, ext = base.partition(".")
    return (f"{folder}/{key}" if folder else key), ext


class WebDatasetFormat(ShardFormat):
    """webdataset tars of ``.npy`` tensors, ``.txt`` captions and ``.json`` metadata."""

    name = "webdataset"
    ext = "tar"
    #: A reader handed the parts (``shards/*.tar``, as `_meta.json` lists them: CC12M's ``{00000..N}.tar``).
    consumer_glob = ConsumerGlob((f"{SHARDS_DIR}/*.tar",))
    keys: ClassVar[dict[str, str]] = {
        "latents": "latents",
        "text_embeddings": "text_embeddings",
        AUDIO_KIND: AUDIO_KIND,
    }

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> WdsWriter:
        return WdsWriter(out, self, shard_id, shard_options(spec))

    def _members(self, path: Path | OutFile, wanted: str | None, exts: tuple[str, ...] | None = None) -> dict:
        samples: dict[str, dict[str, Any]] = {}
        with opened(path) as fh, tarfile.open(fileobj=fh, mode="r:") as tar:
            for info in tar:
                key, ext = _split(info.name)
                if (wanted is not None and key != wanted) or (exts is not None and ext not in exts):
                    continue
                handle = tar.extractfile(info)
                if handle is None:
                    continue
                name, value = _decode(ext, handle.read())
                samples.setdefault(key, {})[name] = value
        return samples

    def read_part(self, path: Path | OutFile) -> dict[str, dict[str, Any]]:
        found = self._members(path, None)
        sidecar = _sidecar(path) if any("json" not in parts for parts in found.values()) else None
        return {key: _record(parts, sidecar) for key, parts in found.items()}

    def read_member(self, path: Path | OutFile, member: str) -> dict[str, Any]:
        found = self._members(path, member)
        if member not in found:
            raise KeyError(f"{path}: no sample {member!r}")
        return _record(found[member], _sidecar(path) if "json" not in found[member] else None)

    def copy_without(self, path: Path | OutFile, sink: Sink, drop: set[str]) -> list[str]:
        kept: list[str] = []
        with (
            opened(path) as fh,
            tarfile.open(fileobj=fh, mode="r:") as src,
            tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as dst,
        ):
            for info in src:
                key, _ = _split(info.name)
                if key in drop:
                    continue
                dst.addfile(info, src.extractfile(info))
                if key not in kept[-1:]:
                    kept.append(key)
        return kept

    def fingerprints(self, path: Path | OutFile) -> set[str]:
        metas = self._members(path, None, ("json",))
        if not metas:  # the cc12m layout: no json members
            return {str(_sidecar(path).get("fingerprint", ""))}
        return {str(m["json"].get("fingerprint")) for m in metas.values()}


def _sidecar(path: Path | OutFile) -> dict[str, Any]:
    """What a part without json members (the cc12m layout, float16 .npy as stored) has beside it: its fingerprint
    (the part's record under OUT/ledger/parts, else OUT/_meta.json, else cache.json), read through the door."""
    out = path.out if isinstance(path, OutFile) else Path(path).parent.parent
    facts: dict[str, Any] = {}
    for rel in (CACHE_JSON, META_JSON, part_record_rel(f"{SHARDS_DIR}/{path.name}")):  # the last found wins
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, outdir.UnsafePath):  # DamagedRecord too
            facts["fingerprint"] = records.loads(outdir.read_bytes(out, rel), outdir.shown(out, rel))["fingerprint"]
    return facts
