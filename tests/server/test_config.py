"""ServeConfig from flags and LUCEKV_* variables, and `lucekv serve --print-config`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import lucekv
from lucekv.cli import main
from lucekv.engine.config import EngineConfig
from lucekv.errors import ConfigError
from lucekv.server.config import ServeConfig, add_config_flags, config_from_args, env_name, settings


def parse(argv: list[str], environ: dict[str, str]) -> tuple[ServeConfig, dict[str, str]]:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv), environ)


def test_a_flag_beats_its_variable_which_beats_the_default():
    config, sources = parse(["--port", "7001", "--kv-pool", "off"],
                            {"LUCEKV_PORT": "7000", "LUCEKV_MAX_STREAMS": "4", "LUCEKV_AUTH_TOKENS": "/t",
                             "LUCEKV_KV_POOL": "256", "LUCEKV_METRICS_PORT": "9100"})
    assert (config.port, config.engine.kv_pool, config.max_streams, config.auth_tokens, config.metrics_port) == \
        (7001, None, 4, Path("/t"), 9100)
    assert (sources["port"], sources["max_streams"], sources["host"]) == ("--port", "LUCEKV_MAX_STREAMS", "default")
    engine = {f.name: getattr(config.engine, f.name) for f in settings("engine")}
    assert engine == {"backend": "auto", "kv_dtype": "f16", "kv_pool": None, "kv_policy": "auto", "kv_tau": 64,
                      "kv_drafter": "", "kv_cache": None, "max_batch": 64, "gpu_memory_gib": 0.0,
                      "spark_placement": None, "spark_spare": 0, "spark_promote": 0, "mmq_tokens": 64,
                      "step_tokens": None, "prefill_compression": None,
                      "prefill_threshold": 2048, "prefill_drafter": "", "prefill_drafter_layers": 0}


def test_every_field_has_a_flag_and_a_variable():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = {a.dest: a.option_strings for a in parser._actions}
    for f in settings():
        assert flags[f.name] == ["--" + f.name.replace("_", "-")]
    given = {"host": "0.0.0.0", "kv_policy": "lru", "max_queue": "3", "lease_seconds": "2.5", "tls_cert": ""}
    config, sources = parse([], {env_name(name): value for name, value in given.items()})
    assert (config.host, config.engine.kv_policy, config.engine.max_queue, config.lease_seconds, config.tls_cert) == \
        ("0.0.0.0", "lru", 3, 2.5, None)
    assert all(sources[name] == "LUCEKV_" + name.upper() for name in given)


def test_off_as_the_help_shows_it_turns_an_optional_number_off():
    config, _ = parse(["--kv-cache", "off", "--metrics-port", "off"], {"LUCEKV_STEP_TOKENS": "off"})
    assert (config.engine.kv_cache, config.engine.step_tokens, config.metrics_port) == (None, None, None)
    with pytest.raises(ConfigError, match="expected an integer or 'off'"):
        parse([], {"LUCEKV_KV_CACHE": "lots"})


@pytest.mark.parametrize(("environ", "message"), [
    ({"LUCEKV_PORT": "http"}, "LUCEKV_PORT='http': expected an integer"),
    ({"LUCEKV_BACKEND": "tpu"}, "choose one of auto, cpu, cuda"),
    ({"LUCEKV_TLS_KEY": "k.pem"}, "--tls-cert and --tls-key go together"),
    ({"LUCEKV_MAX_STREAMS": "-1"}, "--max-streams must be >= 0"),
    ({"LUCEKV_MAX_BATCH": "0"}, "--max-batch must be >= 1"),  # the engine's settings are checked with the server's
])
def test_bad_values_are_refused_naming_them(environ, message):
    with pytest.raises(ConfigError, match=message):
        parse([], environ)


# a value other than the server's default for each engine setting, as a variable gives it
ENGINE_VARIABLES = {
    "backend": ("cpu", "cpu"), "kv_dtype": ("f32", "f32"), "kv_pool": ("512", 512), "kv_policy": ("lru", "lru"),
    "kv_tau": ("8", 8), "kv_drafter": ("small", "small"), "kv_cache": ("4096", 4096), "max_batch": ("8", 8),
    "spark_placement": ("p.json", Path("p.json")), "spark_spare": ("2", 2), "spark_promote": ("1", 1),
    "mmq_tokens": ("32", 32), "step_tokens": ("128", 128), "prefill_compression": ("0.5", 0.5),
    "prefill_threshold": ("99", 99), "prefill_drafter": ("tiny", "tiny"), "prefill_drafter_layers": ("3", 3),
    "max_queue": ("5", 5), "max_sessions": ("7", 7), "session_memory_gib": ("0.5", 0.5),
    "spark_record": ("live.json", Path("live.json")), "spark_record_every": ("10", 10),
    "gpu_memory_gib": ("16", 16.0),
}


def test_every_engine_option_is_a_serve_flag_and_a_variable():
    """EngineConfig's fields are the engine's settings, but for the library's own (set in code, not by a command
    line; the --spec flags make `speculation`)."""
    library_only = {"n_ctx", "speculation", "layers"}
    engine_settings = {f.name for f in settings() if f.name in EngineConfig.__dataclass_fields__}
    assert engine_settings == EngineConfig.__dataclass_fields__.keys() - library_only == ENGINE_VARIABLES.keys()
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = {a.dest: a.option_strings for a in parser._actions}
    assert all(flags[name] == ["--" + name.replace("_", "-")] for name in engine_settings)
    config, sources = parse([], {env_name(name): text for name, (text, _) in ENGINE_VARIABLES.items()})
    assert {name: getattr(config.engine, name) for name in engine_settings} == \
        {name: value for name, (_, value) in ENGINE_VARIABLES.items()}
    assert all(sources[name] == "LUCEKV_" + name.upper() for name in engine_settings)


def test_print_config_shows_values_and_where_they_came_from(monkeypatch, capsys):
    monkeypatch.setenv("LUCEKV_DRAIN_SECONDS", "12.5")
    assert main(["serve", "--print-config", "--snapshot-store", "redis://127.0.0.1:6379/0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("drain_seconds = 12.5 ") and line.endswith("# LUCEKV_DRAIN_SECONDS") for line in lines)
    assert any("redis://127.0.0.1:6379/0" in line and line.endswith("# --snapshot-store") for line in lines)
    assert len(lines) == len(settings())
    monkeypatch.setenv("LUCEKV_KV_TAU", "often")
    assert main(["serve", "--print-config"]) == 2
    assert "LUCEKV_KV_TAU='often': expected an integer" in capsys.readouterr().err


def test_the_serve_settings_reach_the_engine(tiny_model):
    config, _ = parse(["--backend", "cpu", "--max-batch", "3", "--max-sessions", "7", "--session-memory-gib", "0.5",
                       "--max-queue", "5", "--kv-pool", "256", "--kv-policy", "lru"], {})
    engine = lucekv.load(tiny_model, config.engine)
    assert (engine.info.max_batch, engine.max_sessions, engine.session_host_bytes, engine.scheduler.config.max_queue,
            engine.info.kv_pool_tokens, engine.info.kv_policy) == (3, 7, 2**29, 5, 256, "lru")
