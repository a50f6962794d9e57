"""bench spec_host: the engine's host time with a backend whose forwards cost nothing (no timing asserted: counts)."""

from __future__ import annotations

from lucekv.bench.spec_host import breakdown, instant_engine, measure
from lucekv.model.synth import write_synthetic_gguf


def test_the_instant_backend_answers_the_scripted_text_and_rounds_are_counted(tmp_path):
    engine = instant_engine(write_synthetic_gguf(tmp_path / "m.gguf", "llama", n_ctx=8192), n_ctx=8192)
    plain = measure(engine, "edit", "off", max_tokens=48, repeats=1)
    assert plain["tokens"] == plain["steps"] == 48 and plain["rounds"] == 0
    edit = measure(engine, "edit", "suffix", max_tokens=48, repeats=1)  # the answer copies the prompt's file
    assert edit["tokens"] == 48 and 0 < edit["rounds"] < 24 and edit["tau"] > 2
    parts = breakdown(engine, "edit", "suffix", max_tokens=48)["us_per_step_profiled"]
    assert parts["engine step (all of it)"] >= parts["drafter accept (index the tokens)"] > 0
