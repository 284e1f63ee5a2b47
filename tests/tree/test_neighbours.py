"""fdcore users of one machine leave each other alone: a running server (an untagged tree, as a
user starts it), this test session and a second pytest session started beside them.

The second session's leak guards judge and remove only what its own tests made (its own
``FDCORE_INSTANCE_TAG``), so the server keeps every segment and keeps serving, and this session's
guard is not upset by what the others hold.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fdcore import LLM, SamplingParams
from fdcore.ipc import names
from tests.supervised import ROOT, Tree, make_model_dir

pytestmark = pytest.mark.tree

INNER_TEST = """
from fdcore import LLM, SamplingParams
from fdcore.config import parse_config


def test_inner_session_with_a_tree_of_its_own():
    llm = LLM(parse_config(open({config!r}).read()))
    try:
        with open({up!r}, "w") as up:  # tell the outer test our tree runs...
            up.write("up\\n")
        with open({go!r}) as go:  # ...and wait until the server has started meanwhile
            assert go.readline() == "go\\n"
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs.token_ids) == 4
    finally:
        llm.shutdown()
"""


def test_a_server_and_two_test_sessions_leave_each_other_alone(tmp_path):
    """The server starts while a test of the second session runs with a tree of its own: that
    test's leak guard sees the server's segments appear during the test and must leave them be."""
    config = tmp_path / "server.toml"
    config.write_text(f'[model]\npath = "{make_model_dir(tmp_path)}"\n[workers]\nstandby = false\n')
    up, go = str(tmp_path / "up"), str(tmp_path / "go")
    os.mkfifo(up)
    os.mkfifo(go)
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER_TEST.format(config=str(config), up=up, go=go))
    second = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            "--rootdir",
            str(tmp_path),
            str(inner),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = None
    try:
        with open(up) as f:  # the second session's tree is up (EOF: it died before)
            assert f.readline() == "up\n", second.communicate(timeout=60)[0][-3000:]
        server = Tree(str(config), env={names.TAG_ENV: ""})  # a user's server: no test session's tag
        server.wait("ready")
        held = {e.filename for e in names.list_entries() if e.instance_id == server.instance}
        assert held, "the server holds no shared memory?"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        with LLM.connect(server.instance) as llm:
            before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs.token_ids
        with open(go, "w") as f:
            f.write("go\n")
        output = second.communicate(timeout=240)[0]
        assert second.returncode == 0, f"the second session failed:\n{output[-3000:]}"
        still = {e.filename for e in names.list_entries() if e.instance_id == server.instance}
        assert still == held, f"the second session touched the server's shared memory: {sorted(held - still)}"
        with LLM.connect(server.instance) as llm:  # and the server still serves, the same tokens
            assert llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs.token_ids == before
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.exit_code() == 0
        assert not [e for e in names.list_entries() if e.instance_id == server.instance], "the server leaked"
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
        if server is not None:
            server.destroy()
