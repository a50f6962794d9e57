"""EngineConfig: lucekv.load's options by name, refused (naming the option or its flag) before a model loads."""

from __future__ import annotations

import pytest

import lucekv
from lucekv.engine.config import EngineConfig
from lucekv.errors import ConfigError
from lucekv.spec.config import SpecConfig

NO_MODEL = "no-such-dir/no-such-model.gguf"  # a model that would fail to load: the options fail first


def test_an_unknown_option_is_refused_by_name():
    with pytest.raises(TypeError, match="unknown engine option 'bogus'"):
        lucekv.load(NO_MODEL, backend="cpu", bogus=1)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_batch": 0}, "--max-batch must be >= 1"),
    ({"max_queue": -1}, "--max-queue must be >= 0"),
    ({"max_sessions": 0}, "--max-sessions must be >= 1"),
    ({"session_memory_gib": -1.0}, "--session-memory-gib must be >= 0"),
    ({"prefill_threshold": -1}, "--prefill-threshold must be >= 0"),
    ({"prefill_compression": 1.5, "prefill_drafter": "m"}, "--prefill-compression: a keep ratio must be in"),
    ({"prefill_compression": 0.5}, "--prefill-compression needs a drafter"),
    ({"spark_spare": 2}, "--spark-spare and --spark-promote need --spark-placement"),
    ({"speculation": SpecConfig(mode="draft")}, "speculation mode 'draft' needs a draft model"),
])
def test_bad_values_are_refused_naming_their_flag(options, message):
    with pytest.raises(ConfigError, match=message):
        lucekv.load(NO_MODEL, **options)


def test_options_replace_a_given_config():
    base = EngineConfig(backend="cpu", max_batch=4)
    with pytest.raises(ConfigError, match="--max-batch must be >= 1"):
        lucekv.load(NO_MODEL, base, max_batch=0)
    assert EngineConfig().check() == EngineConfig()  # the defaults pass
