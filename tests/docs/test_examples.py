"""The documentation's examples, run as a reader runs them: every block of README.md and docs/*.md marked `tested`
(tests/docs/doc_blocks.py), so that a renamed flag or field breaks this test, not the reader.

Blocks run in document order, README first, against one server: the README's `bash tested server` block (`lucekv
serve`), started in the background before the first block and stopped after the last. bash blocks run under
`bash -euo pipefail`, python blocks with this interpreter, js blocks with node as an ES module in clients/node (where
`./lucekv.js` is; skipped where node is not installed). A block passes when it exits 0: the examples assert what they
show where there is something to check. The blocks of one file share a working directory (a block may read a file an
earlier one wrote) and see `lucekv` and `python` on PATH, as a reader with the virtual environment active does. The
environment holds no LUCEKV_* variable but LUCEKV_HOME (where the test models are) and LUCEKV_BACKEND=cpu: CI runs the
examples on smollm2-135m on the CPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from doc_blocks import Block, marked_blocks

from lucekv.model import registry

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_CLIENT = REPO_ROOT / "clients" / "node"
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
BLOCKS = [block for path in DOCS for block in marked_blocks(path)]
EXAMPLES = [block for block in BLOCKS if not block.server]
BLOCK_SECONDS = 300  # the slowest block (a MoE file written and run twice) takes ~25 s on a 2-core machine under load
SERVER_START_SECONDS = 120


@pytest.fixture(scope="module")
def environment(model_path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every block: `lucekv` and `python` on PATH, the test's model in LUCEKV_HOME's cache."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, command in (("lucekv", f'"{sys.executable}" -m lucekv.cli'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUCEKV_")}
    name = registry.DEFAULT_MODEL
    model = model_path(name)
    if not (registry.is_pulled(name) and registry.model_path(name).samefile(model)):
        home = tmp_path_factory.mktemp("lucekv-home")  # a cache holding the test's file, so names resolve to it
        (home / "models").mkdir()
        (home / "models" / registry.MODELS[name].filename).symlink_to(model)
        env["LUCEKV_HOME"] = str(home)
    elif "LUCEKV_HOME" in os.environ:
        env["LUCEKV_HOME"] = os.environ["LUCEKV_HOME"]
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", LUCEKV_BACKEND="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])))
    return env


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """One working directory per documentation file."""
    return {path: tmp_path_factory.mktemp(path.stem) for path in DOCS}


@pytest.fixture(scope="module")
def server(environment: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The README's server block, running until the module's last example has run."""
    [block] = [b for b in BLOCKS if b.server]
    workdir = tmp_path_factory.mktemp("server")
    log = workdir / "server.log"
    with open(log, "w") as err:
        process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.code], cwd=workdir, env=environment,
                                   stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_serving(process, log)
        yield
    finally:
        _stop(process)


def _wait_until_serving(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_SECONDS
    while "lucekv: serving " not in log.read_text():
        if process.poll() is not None:
            text = log.read_text()
            if "cannot serve on" in text and not os.environ.get("CI"):
                pytest.skip(f"the documented address is taken on this machine: {text.strip().splitlines()[-1]}")
            pytest.fail(f"the README's server block exited with {process.returncode}:\n{text}")
        if time.monotonic() > deadline:
            pytest.fail(f"the README's server block did not serve within {SERVER_START_SECONDS} s:\n{log.read_text()}")
        time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # the server drains and exits
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_the_readme_shows_each_step_in_a_tested_block():
    """What a new reader needs is tested: the server, a streaming call from Python and from Node, the session and
    snapshot commands."""
    readme = [b for b in BLOCKS if b.path.name == "README.md"]
    assert sum(b.server for b in BLOCKS) == 1 and any(b.server for b in readme)
    assert {"bash", "python", "js"} <= {b.language for b in readme}
    shell = "".join(b.code for b in readme if b.language == "bash")
    for command in ("lucekv generate", "--session", "lucekv snapshot", "lucekv restore"):
        assert command in shell


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.name for b in EXAMPLES])
def test_example(block: Block, server: None, environment: dict[str, str], workdirs: dict[Path, Path]):
    workdir = workdirs[block.path]
    if block.language == "bash":
        command, stdin, cwd = ["bash", "-euo", "pipefail", "-c", block.code], None, workdir
    elif block.language == "python":
        script = workdir / f"example_{block.line}.py"
        script.write_text(block.code)
        command, stdin, cwd = [sys.executable, script.name], None, workdir
    else:
        command, stdin, cwd = ["node", "--input-type=module"], block.code, NODE_CLIENT
        _node_packages(environment)
    result = subprocess.run(command, cwd=cwd, env=environment, input=stdin, capture_output=True, text=True,
                            timeout=BLOCK_SECONDS)
    assert result.returncode == 0, (f"{block.name} exited with {result.returncode}\n--- block\n{block.code}"
                                    f"--- stdout\n{result.stdout[-3000:]}--- stderr\n{result.stderr[-3000:]}")


def _node_packages(environment: dict[str, str]) -> None:
    """node and the client's packages (installed from the lockfile as clients/node/run_test.sh does)."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (NODE_CLIENT / "node_modules" / ".package-lock.json").is_file():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, env=environment, check=True,
                       capture_output=True, timeout=BLOCK_SECONDS)
