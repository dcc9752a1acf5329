"""Checks a command makes before any flow (and Prefect's API) starts: a user's mistake found here is one
``error: ...`` line and exit 2, in a second, instead of a failed flow run's tracebacks.

Only what is cheap and certain: where OUT is, that the source kind exists and lists shards, that the shard
filter keeps one, that a named device is there, that the 8-bit text encoder has bitsandbytes and CUDA. The
geometry and the model are checked by `make_spec`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from packaging.version import Version

from infra import outdir
from infra.cache.cachedir import CACHE_JSON, read_cache_json
from infra.config import BuildConfig, CacheSpec
from infra.errors import ConfigError
from infra.outdir import UnsafePath
from infra.outstore import is_url
from infra.sources import open_source
from infra.sources.base import source_place
from infra.urls import store_settings_problem

#: The oldest bitsandbytes transformers 5 loads 8-bit models with (its BITSANDBYTES_MIN_VERSION); the [int8] extra's.
BNB_MIN = "0.46.1"
BNB_REQUIREMENT = f"bitsandbytes>={BNB_MIN}"


def check_out(out: outdir.Out) -> None:
    """OUT is absent or a directory (a file there is the user's mistake, not the lock's); a URL's prefix is a folder
    (a store that refuses it says so at its first request)."""
    if outdir.is_store(out):
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, not a directory")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} is a file, not a directory")


def check_apart(config: BuildConfig) -> None:
    """OUT and the source do not overlap: OUT equal to the source, inside it, or holding it would write the cache
    among the user's data (and a later listing of the source would read the cache's files as samples)."""
    kind, _, path = config.source.partition(":")
    if not path or kind == "none":
        return
    source, out = source_place(path), str(config.out)
    out = out if is_url(out) else os.path.realpath(Path(out).expanduser())
    if is_url(out) != is_url(source):
        return
    sep = "/" if is_url(out) else os.sep
    inside = out == source or out.startswith(source.rstrip(sep) + sep) or source.startswith(out.rstrip(sep) + sep)
    if inside:
        how = "is" if out == source else "is inside" if len(out) > len(source) else "holds"
        raise ConfigError(
            f"--out {config.out} {how} the source {config.source}: the cache would be written among the clips "
            "(and read back as samples by the next listing); choose an OUT apart from the source"
        )


def check_cache(out: outdir.Out) -> None:
    """OUT is a latentforge cache (a directory with its cache.json): for the steps that read one (upload)."""
    if outdir.is_store(out):  # a URL's prefix: its cache.json an object
        if not outdir.is_file(out, CACHE_JSON):
            raise ConfigError(
                f"{out} is not a latentforge cache: it {'has no cache.json' if out.exists() else 'does not exist'}"
            )
        return
    if not (out / CACHE_JSON).is_file():
        what = (
            "does not exist" if not out.exists() else "is not a directory" if not out.is_dir() else "has no cache.json"
        )
        raise ConfigError(f"{out} is not a latentforge cache: it {what}")


def check_source(config: BuildConfig) -> int:
    """The source opens and lists shards, and --shard-filter keeps at least one; returns how many it keeps."""
    # SourceError (a ConfigError): unknown kind, no path, no shards
    shards = open_source(config.source, config.encoding).shards()
    kept = [s for s in shards if not config.selection.shard_filter or config.selection.shard_filter in s.id]
    if not kept:
        names = ", ".join(s.id for s in shards[:5]) + (", ..." if len(shards) > 5 else "")
        raise ConfigError(
            f"--shard-filter {config.selection.shard_filter!r} matches none of {config.source}'s shards ({names})"
        )
    return len(kept)


def check_device(device: str) -> None:
    """A device named outright (cuda, neuron) is there; auto and cpu always are."""
    if device in ("auto", "cpu"):
        return
    from infra.devices import resolve_device  # noqa: PLC0415 - torch only when a device is named

    resolve_device(device)


def check_text_8bit(config: BuildConfig) -> None:
    """``--load-text-encoder-in-8bit`` has what it runs on: bitsandbytes importable and a CUDA device (the run's,
    ``auto`` resolved). Both reasons are named when both are missing."""
    if not config.encoding.load_text_encoder_in_8bit:
        return
    from infra.devices import resolve_device  # noqa: PLC0415 - torch only when the 8-bit text encoder is asked for

    missing = []
    if importlib.util.find_spec("bitsandbytes") is None:
        missing.append(f"bitsandbytes is not installed (pip install 'latentforge[int8]': {BNB_REQUIREMENT})")
    elif Version(importlib.metadata.version("bitsandbytes")) < Version(BNB_MIN):
        found = importlib.metadata.version("bitsandbytes")
        missing.append(f"bitsandbytes {found} is older than transformers takes ({BNB_REQUIREMENT})")
    device = config.run.device
    try:
        found = resolve_device(device).type
    except ConfigError:  # a named device that is not there
        found = "not there"
    if found != "cuda":
        missing.append(
            f"it runs on CUDA only, and this run's device is {device}{'' if found == device else f' ({found})'}"
        )
    if missing:
        raise ConfigError(f"--load-text-encoder-in-8bit (bitsandbytes' 8-bit Gemma): {'; '.join(missing)}")


def check_store_settings(*values: str) -> None:
    """The store settings of the environment that the URLs among `values` would use (``AWS_ENDPOINT_URL``,
    ``AWS_REGION``, ``HF_ENDPOINT``: `infra.urls.store_settings_problem`) are well formed: one line naming the
    setting, instead of a store library's error at its first request."""
    problem = store_settings_problem(list(values), dict(os.environ))
    if problem is not None:
        raise ConfigError(problem)


def check_build(config: BuildConfig) -> None:
    """Everything above, for a build or a sanity run."""
    check_store_settings(config.source, config.model, config.out, *([config.upload.to] if config.upload else []))
    check_out(outdir.of_setting(config.out))
    check_apart(config)
    check_source(config)
    check_text_8bit(config)
    check_devices(config)  # a bad list is named before a missing GPU is
    check_device(config.run.device)


def check_reuse(config: BuildConfig, planned: CacheSpec) -> None:
    """``--on-conflict reuse`` resumes OUT's cache with its own settings: a setting given (a flag, a config key) that
    asks for another value would be dropped, so it is refused here, naming it and what to run instead."""
    if config.gates.on_conflict != "reuse":
        return
    from infra.gates.conflicts import (  # noqa: PLC0415 - heavy: torch (only a build told to reuse needs it)
        flag,
        next_free_dir,
        overwrite_token,
        settings_that_differ,
    )

    out = outdir.of_setting(config.out)
    try:
        existing = CacheSpec.model_validate(read_cache_json(out)["spec"])
    except (OSError, ValueError, KeyError, TypeError, UnsafePath):
        return  # nothing to reuse: the conflict gate says so
    given = config.given()
    clash = {k: v for k, v in settings_that_differ(existing, planned).items() if k in given}
    if not clash:
        return
    asked = ", ".join(f"{flag(k)} {new}" for k, (_, new) in clash.items())
    kept = ", ".join(f"{k} {old}" for k, (old, _) in clash.items())
    token = overwrite_token(out, existing.fingerprint(), planned.fingerprint())
    raise ConfigError(
        f"--on-conflict reuse resumes {out} with its own settings ({kept}), but {asked} asks for another: to reuse "
        f"it, leave out {', '.join(map(flag, clash))}; to build with {asked}, use --approve-overwrite {token} (replace "
        f"it sample by sample) or --on-conflict new_dir (write {next_free_dir(out)}) instead of --on-conflict reuse"
    )


def check_devices(config: BuildConfig) -> None:
    """``--devices`` names GPUs this host has (and only with ``--device cuda``)."""
    if config.run.devices is None:
        return
    from infra.devices import placement, visible_accelerators  # noqa: PLC0415 - torch only when GPUs are named

    placement(config.run.device, config.run.devices, visible_accelerators("cuda"))
