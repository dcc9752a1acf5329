"""The dataset card of a real small cache: counts, reasons, fingerprint, shapes, decisions, a loading snippet that
runs, valid front matter, an estimate for a capped build, and the same bytes for the same OUT."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
import yaml

import infra.sources
from flows.terminal_run import run_build
from infra.cache.cachedir import read_cache_json
from infra.cache.ledger import read_all
from infra.publish.base import parse_target
from infra.publish.card import card_file, dataset_card, generated_card
from infra.sources import SourceError
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip

TARGET = parse_target("hf://datasets/latentforge-test/wan22-latents@main/v1")
GROUP_A, GROUP_B = "G-11_handle_object_reappearance_data-generator", "O-21_ball_trajectory_data-generator"
PER_SHARD_CAP = 2


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> dict[str, Path]:
    """One source (7 samples, the first without a prompt), built whole and with a per-shard cap of 2."""
    root = tmp_path_factory.mktemp("card")
    clip = cut_clip(clips["bikes"], 12, width=160)
    shard_a = [sample(0, 0, clip, None), *(sample(0, i, clip, f"a cyclist, take {i}".encode()) for i in (1, 2, 3))]
    shard_b = [sample(1, i, clip, f"a ball rolls, take {i}".encode()) for i in range(3)]
    src = make_shards(root / "src", {"G-11_part-00000": shard_a, "O-21_part-00000": shard_b})
    built = {}
    for name, extra in (("whole", {}), ("capped", {"max_samples_per_shard": PER_SHARD_CAP})):
        ok, result = run_build(config(src, tiny_model, root / name, **extra))
        assert ok, result
        built[name] = root / name
    return built


def _card(out: Path, license: str = "apache-2.0") -> str:  # noqa: A002
    return dataset_card(out, target=TARGET, license=license)


def _python_block(card: str) -> str:
    match = re.search(r"```python\n(.*?)```", card, re.DOTALL)
    assert match, "the card has a python snippet"
    return match[1]


def test_the_card_states_what_the_cache_holds(caches: dict[str, Path]) -> None:
    out = caches["whole"]
    card = _card(out)
    record = torch.load(next(out.glob(f"{GROUP_B}/*.pt")), weights_only=True)
    assert f"| {GROUP_A} | 3 | 1 | 0 |" in card and f"| {GROUP_B} | 3 | 0 | 0 |" in card
    assert read_cache_json(out)["fingerprint"] in card
    assert f"bfloat16 {tuple(record['x0'].shape)}" in card and f"bfloat16 {tuple(record['text_embeds'].shape)}" in card
    assert "| skipped | missing_prompt | 1 |" in card and "the sample has no prompt file" in card
    assert "**accept_loss**, decided by on_loss=accept (policy, " in card
    assert "np.linspace(0, T - 1, 17).round()" in card and "`align_corners=False`" in card
    assert "pixels / 127.5 - 1" in card and "(posterior.mode - latents_mean) / latents_std" in card
    done_bytes = sum(r.bytes or 0 for rows in read_all(out).values() for r in rows.values() if r.status == "done")
    assert f"{done_bytes:,} bytes" in card
    assert "ledger/" in card and "2 file(s)" in card and generated_card(card.encode())
    assert not generated_card(card.replace("latent cache", "latent Cache", 1).encode())  # an edited card is a person's
    assert "Estimated full size" not in card  # nothing was capped
    assert str(out) not in card  # no local path of OUT leaks into a public card


def test_front_matter_is_valid_yaml_with_the_license(caches: dict[str, Path]) -> None:
    card = _card(caches["whole"], license="cc-by-4.0")
    match = re.match(r"^---\n(.*?)\n---\n", card, re.DOTALL)
    assert match
    meta = yaml.safe_load(match[1])
    assert meta["license"] == "cc-by-4.0" and "latent-cache" in meta["tags"] and meta["size_categories"] == ["n<1K"]
    assert "`cc-by-4.0`" in card.split("## License", 1)[1]


def test_the_loading_snippet_runs_against_a_real_sample(
    caches: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = caches["whole"]
    asked: list[tuple[str, str, dict[str, Any]]] = []

    def download(repo_id: str, filename: str, **kwargs: Any) -> str:
        asked.append((repo_id, filename, kwargs))
        return str(out / filename.removeprefix(TARGET.prefix + "/"))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    card = _card(out)
    namespace: dict[str, Any] = {}
    exec(_python_block(card), namespace)  # the snippet as a reader would paste it
    assert asked == [(TARGET.repo_id, asked[0][1], {"repo_type": "dataset", "revision": "main"})]
    assert asked[0][1].startswith("v1/") and asked[0][1].endswith(".pt")
    sample_ = namespace["sample"]
    assert namespace["x0"].dtype == torch.bfloat16 and namespace["x0"].shape == tuple(sample_["latent_shape"])
    assert int(namespace["mask"].sum()) == sample_["seq_len"]
    assert all(f"| `{key}` |" in card for key in sample_)


def test_same_cache_same_bytes(caches: dict[str, Path]) -> None:
    out = caches["whole"]
    first = card_file(out, target=TARGET, license="other")
    (out / "reports" / "upload-20990101T000000Z.json").write_text("{}\n")  # an upload's own report changes nothing
    try:
        second = card_file(out, target=TARGET, license="other")
    finally:
        (out / "reports" / "upload-20990101T000000Z.json").unlink()
    assert first == second and first.path == "README.md" and first.role == "card"
    assert first.data is not None and first.sha256 == hashlib.sha256(first.data).hexdigest()
    assert first.size == len(first.data) and first.source is None


def test_a_capped_build_gets_an_estimate_of_the_full_size(
    caches: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = caches["capped"]
    rows = [r for shard in read_all(out).values() for r in shard.values()]
    assert len(rows) == 2 * PER_SHARD_CAP
    card = _card(out)
    assert f"took {len(rows)} of the 7 samples in the source (max_samples_per_shard={PER_SHARD_CAP})" in card
    done_bytes = sum(r.bytes or 0 for r in rows if r.status == "done")
    assert f"({round(done_bytes / len(rows) * 7):,} bytes)" in card

    def unreadable(spec: str, settings: object = None) -> None:
        raise SourceError(f"{spec}: gone")

    monkeypatch.setattr(infra.sources, "open_source", unreadable)
    assert "the full size is not estimated: the source is not readable here" in _card(out)
