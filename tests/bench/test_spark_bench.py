"""`lucekv bench spark`'s options, checked before a model is read (the bench itself needs a GPU: bench/gpu_session.sh
spark bench / spark long)."""

from __future__ import annotations

from lucekv.cli import main


def test_long_context_takes_one_share_and_shares_must_be_shares(capsys):
    assert main(["bench", "spark", "any.gguf", "--resident", "0.3,0.5", "--long-context", "131072"]) == 2
    assert "--long-context measures one --resident share" in capsys.readouterr().err
    assert main(["bench", "spark", "any.gguf", "--resident", "1.5", "--long-context", "131072"]) == 2
    assert "--resident shares must be in (0, 1)" in capsys.readouterr().err
