"""Which trainer reads what, for the Wan trainers' formats: `check_consumer` refuses every family their trainer does
not train (naming it), `inspect` names the consumer, and the table of docs/formats.md has a row for every pair
`infra.formats.consumers.CONSUMERS` holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.config import CacheSpec
from infra.errors import ConfigError
from infra.formats.consumers import CONSUMERS, check_consumer, written_for

FORMATS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "formats.md"
FAMILIES = ("wan22", "wan21", "ltx2", "image")
READ_BY = {"musubi": ("wan21",), "diffsynth": ("wan21", "wan22")}


def _spec(fmt: str, family: str) -> CacheSpec:
    values = {"format": fmt, "family": family, "layout": None, "store_dtype": "bf16", "text_padding": "zeros"}
    values |= {"text_stage": "last_hidden_state", "latent_norm": "normalised", "text_clean": None}
    return CacheSpec.model_construct(**values)


@pytest.mark.parametrize("fmt", sorted(READ_BY))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_wan_trainers_formats_take_only_the_families_they_train(fmt, family):
    if family in READ_BY[fmt]:
        check_consumer(_spec(fmt, family), ("latents", "text_embeddings"))
        assert written_for({"format": fmt, "family": family})["consumer"] == CONSUMERS[(fmt, family)].consumer
    else:
        with pytest.raises(ConfigError, match=f"format {fmt} with family {family}: .*no trainer reads it"):
            check_consumer(_spec(fmt, family), ("latents", "text_embeddings"))


def test_diffsynth_refuses_the_raw_pad_rows_its_prompt_embedder_zeroes():
    raw = _spec("diffsynth", "wan21").model_copy(update={"text_padding": "raw"})
    with pytest.raises(ConfigError, match="--text-padding raw: its consumer, DiffSynth-Studio"):
        check_consumer(raw, ("latents", "text_embeddings"))


def test_the_formats_page_table_has_a_row_for_every_consumer_pair():
    text = FORMATS_PAGE.read_text(encoding="utf-8")
    table = text[text.index("## Which trainer reads what") :].split("\n\n")[2]
    covered = set()
    for row in table.splitlines()[2:]:
        fmt, families = (cell.strip() for cell in row.strip("|").split("|")[:2])
        names = FAMILIES if families == "all" else re.findall(r"[a-z0-9][a-z0-9-]*", families)
        covered |= {(fmt.strip("`"), name) for name in names}
    assert set(CONSUMERS) <= covered, sorted(set(CONSUMERS) - covered)
