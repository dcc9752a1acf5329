"""``--text-storage trimmed``: the prompt's rows only, the padded tensor restored exactly; the gates accept it."""

from __future__ import annotations

import pytest
import torch

from flows.terminal_run import run_build
from infra.cache import ledger
from infra.config import CacheSpec
from infra.errors import ConfigError
from infra.formats import get_format
from infra.formats.textpad import restore_padded, trim
from infra.plan import make_plan, make_spec
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip
from tests.steps import verified


def test_restore_padded_is_the_exact_inverse_of_trim() -> None:
    padded = torch.zeros(16, 8, dtype=torch.bfloat16)
    padded[:5] = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    trimmed = trim(padded, 5)
    assert trimmed.shape == (5, 8) and trimmed.untyped_storage().nbytes() == 5 * 8 * 2  # its own, small storage
    assert torch.equal(restore_padded(trimmed, 16), padded) and restore_padded(padded, 16) is padded
    with pytest.raises(ValueError, match="more than max_length"):
        restore_padded(padded, 8)


def test_trimmed_needs_zero_padding_and_a_right_padded_family(tmp_path, tiny_model, ltx2_model) -> None:
    src = tmp_path / "src"
    with pytest.raises(ConfigError, match="--text-padding zeros"):
        make_spec(config(src, tiny_model, tmp_path / "out", text_storage="trimmed"))
    with pytest.raises(ConfigError, match="family ltx2"):
        make_spec(config(src, ltx2_model, tmp_path / "out", text_storage="trimmed", text_padding="zeros"))
    _, padded, _, _ = make_spec(config(src, tiny_model, tmp_path / "out", text_padding="zeros"))
    old = CacheSpec.model_validate({k: v for k, v in padded.model_dump().items() if k != "text_storage"})
    assert old.fingerprint() == padded.fingerprint()  # caches made before the field keep their fingerprints


def test_a_trimmed_build_restores_the_padded_tensors_and_passes_the_gates(tmp_path, tiny_model, clips) -> None:
    video = cut_clip(clips["carphone"], 12)
    samples = [sample(0, 0, video, b"short"), sample(0, 1, video, b"a somewhat longer prompt about a phone call")]
    src = make_shards(tmp_path / "src", {"part": samples})
    outs = {}
    for storage in ("padded", "trimmed"):
        cfg = config(src, tiny_model, tmp_path / storage, text_padding="zeros", text_storage=storage, decode_samples=1)
        ok, result = run_build(cfg)
        assert ok and result["done"] == 2, result
        report = verified(make_plan(cfg.with_values(on_conflict="reuse")))
        assert report.kind == "compatible" and report.problems == [], report.problems
        outs[storage] = (tmp_path / storage, ledger.read_shard(tmp_path / storage, "part"))
    fmt = get_format("pt")
    (padded_out, padded_rows), (trimmed_out, trimmed_rows) = outs["padded"], outs["trimmed"]
    for key, row in trimmed_rows.items():
        trimmed, padded = fmt.read(trimmed_out / row.path), fmt.read(padded_out / padded_rows[key].path)
        assert trimmed["text_embeds"].shape == (row.seq_len, padded["text_embeds"].shape[1])
        want = padded["text_embeds"]
        assert torch.equal(restore_padded(trimmed["text_embeds"], want.shape[0]), want)
        assert torch.equal(trimmed["x0"], padded["x0"])
        assert row.bytes < padded_rows[key].bytes
