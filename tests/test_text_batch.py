"""Prompts batched and de-duplicated: each prompt's embedding is exactly what it gets alone (UMT5 and Gemma, short
and truncated prompts in one batch, so every row has its own padding), and a repeated prompt is encoded once."""

from __future__ import annotations

import pytest
import torch

from infra.models import load_family
from infra.models.base import TextSettings
from infra.preprocess.texts import TextCache

CPU = torch.device("cpu")
#: A one-token prompt, a prompt longer than max_length (truncated: no padding at all) and two in between.
PROMPTS = ("a", "a red ball rolls across a long wooden table " * 12, "two cats sit on a mat", "the sea at dusk")
MAX_LENGTH = 32


def _assert_same(one: list, many: list) -> None:
    assert len(one) == len(many)
    for alone, batched in zip(one, many, strict=True):
        assert (alone.seq_len, alone.tokens_total) == (batched.seq_len, batched.tokens_total)
        assert alone.embeds.dtype == batched.embeds.dtype and torch.equal(alone.embeds, batched.embeds)
        assert alone.extras.keys() == batched.extras.keys()
        assert all(torch.equal(alone.extras[k], batched.extras[k]) for k in alone.extras)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_umt5_batch_equals_one_at_a_time(tiny_model, dtype) -> None:
    encoder = load_family(tiny_model, "wan22", CPU, dtype)
    for padding in ("raw", "zeros"):
        settings = TextSettings(MAX_LENGTH, padding)
        many = encoder.encode_texts(list(PROMPTS), settings)
        assert {e.seq_len for e in many} == {2, MAX_LENGTH, *(e.seq_len for e in many[2:])}  # short and truncated
        assert many[1].truncated and not many[0].truncated
        _assert_same([encoder.encode_text(p, settings) for p in PROMPTS], many)
        if padding == "zeros":
            assert not many[0].embeds[many[0].seq_len :].any()


def test_gemma_batch_equals_one_at_a_time(ltx2_model) -> None:
    encoder = load_family(ltx2_model, "ltx2", CPU, torch.float32)
    for stage in ("pre_connector", "post_connector"):
        settings = TextSettings(MAX_LENGTH, "raw", stage)
        many = encoder.encode_texts(list(PROMPTS), settings)
        masks = [e.extras["prompt_attention_mask"] for e in many]
        if stage == "pre_connector":  # left padding: the short prompt's mask starts with zeros
            assert masks[0][0] == 0 and masks[0][-1] == 1 and bool(masks[1].all())
        _assert_same([encoder.encode_text(p, settings) for p in PROMPTS], many)


class _Counting:
    """A real encoder whose encode_texts calls are recorded."""

    def __init__(self, encoder) -> None:
        self.encoder, self.batches = encoder, []

    def encode_texts(self, prompts, settings):
        self.batches.append(list(prompts))
        return self.encoder.encode_texts(prompts, settings)


def test_identical_prompts_are_encoded_once_and_batched_with_upcoming_ones(tiny_model) -> None:
    real = load_family(tiny_model, "wan22", CPU, torch.float32)
    counting, cache = _Counting(real), TextCache()
    settings, other = TextSettings(MAX_LENGTH), TextSettings(MAX_LENGTH, "zeros")
    order = ["b", "a", "b", "c", "a", "b", "d"]
    got = [cache.embedding(counting, p, settings, upcoming=order[i + 1 :], batch=2) for i, p in enumerate(order)]
    assert counting.batches == [["b", "a"], ["c", "d"]]
    assert cache.stats.calls == 2 and cache.stats.encoded == len(set(order)) and cache.stats.served == len(order)
    for prompt, embedding in zip(order, got, strict=True):
        assert torch.equal(embedding.embeds, real.encode_text(prompt, settings).embeds)
    cache.embedding(counting, "b", other)  # other settings: another key
    assert counting.batches[-1] == ["b"] and cache.stats.calls == 3


def test_the_text_cache_is_bounded_in_bytes(tiny_model) -> None:
    real = load_family(tiny_model, "wan22", CPU, torch.float32)
    settings = TextSettings(MAX_LENGTH)
    size = real.encode_text("x", settings).embeds.numel() * 2  # bf16
    counting, cache = _Counting(real), TextCache(max_bytes=2 * size)
    for prompt in ("a", "b", "c", "a"):  # "a" was dropped when "c" came
        cache.embedding(counting, prompt, settings)
    assert [b[0] for b in counting.batches] == ["a", "b", "c", "a"]
    cache.embedding(counting, "c", settings)
    assert len(counting.batches) == 4


def test_umt5_beside_another_thread_tokenizing_gives_each_prompt_its_padded_rows(tiny_model) -> None:
    """Shard threads share one loaded family (``--text-offload`` with 2 workers encodes two shards' prompts at once):
    a fast tokenizer's padding and truncation are state of its one backend, so a call that does not hold
    `TOKENIZER_LOCK` can tokenize with another thread's settings (no padding: a [seq_len, D] text, as a build wrote).
    Another thread tokenizes without padding, under the lock as every tokenizer call of the families does; every
    embedding keeps its max_length rows and equals the prompt's alone."""
    import sys  # noqa: PLC0415 - this test's only
    import threading  # noqa: PLC0415 - this test's only

    from infra.models.base import TOKENIZER_LOCK  # noqa: PLC0415 - this test's only

    encoder = load_family(tiny_model, "wan22", CPU, torch.float32)
    settings = TextSettings(MAX_LENGTH, "zeros")
    alone = {p: encoder.encode_text(p, settings) for p in PROMPTS}
    done = threading.Event()

    def other() -> None:  # the untruncated count's call: no padding, no truncation
        while not done.is_set():
            with TOKENIZER_LOCK:
                encoder.tokenizer(["two cats"], add_special_tokens=True, truncation=False)

    thread, interval = threading.Thread(target=other), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: the race shows within the test
    bad: list[tuple[str, tuple[int, ...]]] = []
    try:
        thread.start()
        for _ in range(100):
            for prompt, got in zip(PROMPTS, encoder.encode_texts(list(PROMPTS), settings), strict=True):
                if not torch.equal(got.embeds, alone[prompt].embeds):
                    bad.append((prompt[:20], tuple(got.embeds.shape)))
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not bad, f"{len(bad)} embeddings differ from the prompt's alone, e.g. {bad[:3]}"
