"""`lucekv generate`, `lucekv info` against an in-process server, and `lucekv serve` as a real process."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lucekv.cli_server import add_server_commands
from lucekv.client import Client, SamplingOptions
from lucekv.engine.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="lucekv")
    add_server_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_generate_streams_the_engine_output_to_stdout(server, reference_engine, capsys):
    params = {"temperature": 0.7, "top_k": 40, "seed": 5, "max_tokens": 16}
    expected = "".join(d.text for d in reference_engine.generate("Hello", SamplingParams(**params)))
    code = run_cli(
        "generate",
        "Hello",
        "--server",
        server.address,
        "--temperature",
        "0.7",
        "--top-k",
        "40",
        "--seed",
        "5",
        "--max-tokens",
        "16",
    )
    out, err = capsys.readouterr()
    assert (code, out) == (0, expected)
    assert re.search(r"\[length: \d+ prompt \+ 16 completion tokens, first token \d+ ms", err)


def test_generate_chat_and_stop_flags_reach_the_engine(server, reference_engine, capsys):
    chat = [{"role": "user", "content": "Hello"}]
    full = "".join(
        d.text for d in reference_engine.generate(chat, SamplingParams(temperature=0.0, max_tokens=20))
    )
    stop = full[6:9]
    code = run_cli(
        "generate",
        "Hello",
        "--chat",
        "--server",
        server.address,
        "--temperature",
        "0",
        "--max-tokens",
        "20",
        "--stop",
        stop,
    )
    out, err = capsys.readouterr()
    assert (code, out) == (0, full[: full.index(stop)])
    assert err.startswith("[stop: ")


def test_generate_reports_a_refused_request_and_fails(server, capsys):
    assert run_cli("generate", "Hello", "--server", server.address, "--top-p", "0") == 1
    assert "INVALID_ARGUMENT: top_p: must be in (0, 1]" in capsys.readouterr().err


def test_info_prints_the_server_model(server, reference_engine, capsys):
    assert run_cli("info", "--server", server.address) == 0
    out = capsys.readouterr().out
    assert f"model:       {reference_engine.info.model_name}\n" in out
    assert f"fingerprint: {reference_engine.info.fingerprint}\n" in out
    assert "context:     512\n" in out


def test_info_without_a_server_fails_clearly(capsys):
    assert run_cli("info", "--server", "127.0.0.1:1") == 1
    assert "lucekv: error: UNAVAILABLE" in capsys.readouterr().err


def test_serve_runs_until_sigterm_and_answers_meanwhile(tiny_model, reference_engine):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "lucekv.cli", "serve", "--model", str(tiny_model), "--port", "0"]
    with subprocess.Popen(command, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True) as process:
        try:
            address = _wait_for_address(process)
            with Client(address) as client:
                got = client.complete("Hello", SamplingOptions(temperature=0.0, max_tokens=8), timeout=60)
            params = SamplingParams(temperature=0.0, max_tokens=8)
            assert got.text == "".join(d.text for d in reference_engine.generate("Hello", params))
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            process.kill()


def _wait_for_address(process: subprocess.Popen) -> str:
    lines = []
    for line in process.stderr:
        lines.append(line)
        if match := re.search(r"lucekv: serving .* on (\S+:\d+)$", line.strip()):
            return match.group(1)
    pytest.fail("server exited before serving:\n" + "".join(lines))


def test_serve_on_a_taken_port_fails_clearly(server, tiny_model, capsys):
    port = server.address.rsplit(":", 1)[1]
    assert run_cli("serve", "--model", str(tiny_model), "--port", port) == 1
    assert f"lucekv: error: cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err


def test_session_commands_round_trip_a_session_through_a_file(server, tmp_path, capsys):
    blob = tmp_path / "chat.lkvs"
    assert run_cli("generate", "Hello there", "--session", "cli-chat", "--server", server.address,
                   "--max-tokens", "4") == 0
    assert "reused" not in capsys.readouterr().err
    assert run_cli("generate", "Hello there, again", "--session", "cli-chat", "--server", server.address,
                   "--max-tokens", "4") == 0
    assert re.search(r"tok/s, \d+ prompt tokens reused", capsys.readouterr().err)
    assert run_cli("snapshot", "cli-chat", "-o", str(blob), "--server", server.address) == 0
    assert run_cli("restore", str(blob), "--session", "cli-copy", "--server", server.address) == 0
    assert run_cli("sessions", "--server", server.address) == 0
    listing = capsys.readouterr().out
    assert re.search(r"cli-chat\s+\w+\s+\d+", listing) and re.search(r"cli-copy\s+\w+\s+\d+", listing)
    assert run_cli("sessions", "--delete", "cli-copy", "--server", server.address) == 0


def test_session_commands_fail_with_the_servers_message_and_leave_no_file(server, tmp_path, capsys):
    out = tmp_path / "missing.lkvs"
    assert run_cli("snapshot", "no-such-session", "-o", str(out), "--server", server.address) == 1
    assert "NOT_FOUND" in capsys.readouterr().err and not list(tmp_path.iterdir())
    bad = tmp_path / "bad.lkvs"
    bad.write_bytes(b"not a snapshot at all")
    assert run_cli("restore", str(bad), "--server", server.address) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
