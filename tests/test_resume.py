"""engine: a request resumed from the tokens another engine generated (a migrated stream) goes on as if it
never moved: the same tokens, greedy or seeded, and exactly the text the client has not seen yet."""

from __future__ import annotations

import pytest

from engine.params import SamplingParams
from tests.harness.chat import chat_ids
from tests.harness.native import NEEDS_NATIVE


def run(engine, rid: str, prompt: list[int], params: SamplingParams, **kw) -> tuple[list[int], str]:
    seq = engine.add_request(rid, prompt, params, **kw)
    text = ""
    while not seq.finished:
        for out in engine.step():
            text += out.text
    return list(seq.output_ids), text


@NEEDS_NATIVE  # a resumed prompt is one chunk where the first worker decoded: the same bits on the C kernels only
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=1234, top_p=0.9,
                                                                     frequency_penalty=0.5)])
def test_resumed_request_continues_the_same_output(make_engine, smollm, sampling: dict) -> None:
    prompt = chat_ids(smollm, "Write two sentences about the sea, with an emoji 🌊 in the middle.")
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=["zzz"], **sampling)
    first, second = make_engine(), make_engine()
    ids, text = run(first, "whole", prompt, params)
    for k in (1, 17, 39):  # the old worker died after k tokens; the client saw the text it had emitted
        shown = "".join(out.text for out in _emitted_texts(first, prompt, params, k))
        again, rest = run(second, f"moved-{k}", prompt, params, resume_ids=ids[:k], shown_chars=len(shown))
        assert again == ids, k
        assert shown + rest == text, k


def _emitted_texts(engine, prompt: list[int], params: SamplingParams, k: int) -> list:
    """The outputs a worker streamed before it died after ``k`` tokens."""
    seq = engine.add_request(f"partial-{k}", prompt, params)
    outs = []
    while len(seq.output_ids) < k:
        outs += engine.step()
    engine.abort(seq.request_id)
    return outs
