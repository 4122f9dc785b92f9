"""A slider move costs its tail (issue 37, item 4): a prompt encoded once is kept (LRU within a
byte budget), so a new strength of the same edit mixes K/V with no text encoding, and gives the
same numbers as a fresh encoding."""

from __future__ import annotations

import numpy as np

from edit_rt.runtime.model.edit import TailRow

from .conftest import TEST_BASE


def _counting(pipeline, monkeypatch) -> list:
    calls: list = []
    real = pipeline.kv_from_prompts

    def counted(prompts, *args, **kwargs):
        calls.append(list(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(pipeline, "kv_from_prompts", counted)
    return calls


def test_a_new_strength_reuses_the_encoded_prompt(pipeline, base_state, monkeypatch):
    calls = _counting(pipeline, monkeypatch)
    prompt = "a yellow triangle on a blue background"
    pipeline.resolver.encoded.clear()
    pipeline.run_tail(base_state, [TailRow(prompt, 1.0, 5, TEST_BASE.guidance)])
    assert calls == [[prompt]]
    moved = pipeline.run_tail(base_state, [TailRow(prompt, 0.6, 5, TEST_BASE.guidance)])
    assert calls == [[prompt]]  # the move: a K/V mix and the tail, no encoding
    pipeline.resolver.encoded.clear()
    fresh = pipeline.run_tail(base_state, [TailRow(prompt, 0.6, 5, TEST_BASE.guidance)])
    assert calls == [[prompt], [prompt]]
    np.testing.assert_array_equal(moved, fresh)


def test_the_kept_encodings_stay_within_their_budget(pipeline, base_state, monkeypatch):
    resolver = pipeline.resolver
    resolver.encoded.clear()
    resolver.encoded_bytes = 0
    prompts = [f"a red circle, edit {i}" for i in range(5)]
    pipeline.run_tail(base_state, [TailRow(prompts[0], 1.0, 8, TEST_BASE.guidance)])
    one = resolver.encoded_bytes
    monkeypatch.setattr(resolver, "encoded_limit", 3 * one)
    pipeline.run_tail(base_state, [TailRow(p, 1.0, 8, TEST_BASE.guidance) for p in prompts[1:]])
    assert resolver.encoded_bytes == sum(kv.nbytes for kv in resolver.encoded.values()) == 3 * one
    assert [key[0] for key in resolver.encoded] == prompts[2:]  # the least recently used went first
