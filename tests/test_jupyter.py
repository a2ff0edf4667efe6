"""The notebook front end a student opens: `jupyter lab` starts from the environment `make demo` builds,
serves the lessons, and runs one through its own kernel (as a student's clicks would: a session on the
notebook, each code cell sent over the kernel's websocket), every cell without an error."""
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = Path(__file__).resolve().parent.parent
LESSON = "lessons/00_memory.ipynb"  # the shortest lesson (about 6 s)
JUPYTER = Path(sys.executable).with_name("jupyter")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A headless `jupyter lab` on a free port, its token, and its log; stopped after the test."""
    if not JUPYTER.exists():
        pytest.skip(f"no {JUPYTER}: make demo installs JupyterLab (the dev extra)")
    port, token = _free_port(), secrets.token_hex(16)
    log = open(tmp_path / "lab.log", "w")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(JUPYTER), "lab", "--no-browser", f"--port={port}", "--port-retries=50",
                             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"]
                            + (["--allow-root"] if os.geteuid() == 0 else []),  # CI runs as root
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = None
    deadline = time.monotonic() + 120  # a deadlock guard: the server starts in a few seconds when idle
    while base is None and time.monotonic() < deadline and proc.poll() is None:
        text = (tmp_path / "lab.log").read_text()
        for line in text.splitlines():
            if "http://127.0.0.1:" in line and "/lab" in line:
                base = line[line.index("http://127.0.0.1:"):].split("/lab")[0]
                break
        time.sleep(0.5)
    try:
        assert base, f"jupyter lab did not start:\n{(tmp_path / 'lab.log').read_text()[-3000:]}"
        yield base, token, tmp_path / "lab.log"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _api(base, token, path, body=None, method=None):
    req = urllib.request.Request(f"{base}{path}", method=method or ("POST" if body is not None else "GET"),
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, r.read()


async def _run_cells(base, token, kernel_id, cells, timeout_s):
    from tornado.websocket import websocket_connect
    ws = await websocket_connect(f"{base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token={token}")
    session, failures = uuid.uuid4().hex, []
    for i, code in cells:
        msg_id = uuid.uuid4().hex
        await ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "student",
                       "session": session, "date": "", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        while True:
            raw = await asyncio.wait_for(ws.read_message(), timeout_s)
            assert raw is not None, f"the kernel's websocket closed during cell {i}"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "error":
                failures.append(f"cell {i}: {msg['content']['ename']}: {msg['content']['evalue']}")
            if msg["msg_type"] == "execute_reply":
                break
    ws.close()
    return failures


@pytest.mark.launches
def test_jupyter_lab_opens_and_runs_a_lesson(lab):
    base, token, log = lab
    status, page = _api(base, token, "/lab")
    assert status == 200 and b"JupyterLab" in page
    status, body = _api(base, token, "/api/sessions", {"path": LESSON, "type": "notebook",
                                                          "kernel": {"name": "python3"}})
    assert status == 201, body
    kernel = json.loads(body)["kernel"]["id"]
    import nbformat  # here, not at the top: its jsonschema costs every collection seconds
    nb = nbformat.read(ROOT / LESSON, as_version=4)
    cells = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert len(cells) > 3
    failures = asyncio.run(_run_cells(base, token, kernel, cells, timeout_s=600))
    assert not failures, f"{LESSON} in jupyter lab: {failures}\n{log.read_text()[-2000:]}"
