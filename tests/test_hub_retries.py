"""The Hub's retried answers in ``store_retries`` (`retries.watch_hub`), as S3's are: an ``hf://`` source read through
the fake Hub (`tests.fakehub`), its downloads answered 429, 503 or 404 first; only an answer huggingface_hub asks
again for is counted."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import close_session, get_session, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from infra.errors import InputError
from infra.sources import retries, store
from tests import fakehub
from tests.fakehub import FakeHub

fake_hub, hub_env = fakehub.fake_hub, fakehub.hub_env  # the fixtures, by name
REPO, FILE = "org/clips", "data/clip-000.bin"
DATA = bytes(range(256)) * 64  # 16 KiB, binary: an LFS file on the Hub
URL = f"hf://datasets/{REPO}@main/{FILE}"
MAX_MB = 1
RESOLVE = "/resolve/"


@pytest.fixture
def hub(hub_env: FakeHub) -> FakeHub:
    """The fake Hub holding `FILE`, the retry counts at zero, huggingface_hub's next client unwatched (a read is
    counted only where the store's own path watches it)."""
    hub_env.create(REPO)
    hub_env.commit(REPO, {FILE: DATA})
    close_session()
    retries.take()
    return hub_env


def _statuses(hub: FakeHub) -> list[int]:
    """The statuses of the file's GETs, in turn."""
    return [r.status for r in hub.requests if r.method == "GET" and RESOLVE in r.path]


def test_a_throttled_then_unavailable_read_is_retried_and_counted(hub: FakeHub) -> None:
    """A 429 then a 503 on the file's range read: huggingface_hub asks again twice, the bytes come whole, 2 counted."""
    hub.download_faults([429, 503], RESOLVE)
    assert store.read(URL, None, MAX_MB) == DATA
    assert _statuses(hub) == [429, 503, 206]
    assert retries.take() == {"slow_down": 2}


def test_a_read_without_faults_counts_nothing(hub: FakeHub) -> None:
    assert store.read(URL, None, MAX_MB) == DATA
    assert _statuses(hub) == [206]
    assert retries.take() == {}


def test_a_refused_read_is_not_counted(hub: FakeHub) -> None:
    """A 404 is not asked again: the read fails, no retry counted."""
    hub.download_faults([404], RESOLVE)
    with pytest.raises(InputError):
        store.read(URL, None, MAX_MB)
    assert _statuses(hub) == [404]
    assert retries.take() == {}


def test_a_5xx_a_download_does_not_ask_again_for_is_not_counted(hub: FakeHub, tmp_path: Path) -> None:
    """hf_hub_download's GET asks again after a 408 or 429 only: its 503 is an error, not a retry."""
    retries.watch_hub()
    hub.download_faults([503], f"^GET .*{RESOLVE}")
    with pytest.raises(HfHubHTTPError):
        hf_hub_download(REPO, FILE, repo_type="dataset", endpoint=hub.url, cache_dir=tmp_path)
    assert _statuses(hub) == [503]
    assert retries.take() == {}


def test_watching_again_adds_no_hook_and_a_new_client_is_watched() -> None:
    """`watch_hub` twice: one hook each; huggingface_hub's next client (after `close_session`) is watched anew."""

    def ours(event: str) -> int:
        return sum(1 for hook in get_session().event_hooks[event] if hook.__module__ == retries.__name__)

    retries.watch_hub()
    retries.watch_hub()
    assert (ours("request"), ours("response")) == (1, 1)
    close_session()
    assert (ours("request"), ours("response")) == (0, 0)
    retries.watch_hub()
    assert (ours("request"), ours("response")) == (1, 1)
