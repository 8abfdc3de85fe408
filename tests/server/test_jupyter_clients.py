"""Real Jupyter clients from PyPI drive cloche unchanged, against a real gVisor server:
nbclient through jupyter_server's `GatewayKernelManager` (and the same notebook on a local
ipykernel, for comparison), `jupyter server --gateway-url` as a proxy in front of cloche, and
autogen-ext's `DockerJupyterCodeExecutor` given cloche's host, port and token."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from threading import Thread
from typing import Any

import httpx
import nbformat
import pytest
import websocket
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.gateway.managers import GatewayKernelClient, GatewayKernelManager
from jupyter_server.utils import url_path_join
from nbclient import NotebookClient
from tornado.escape import url_escape
from traitlets import Type
from websockets.sync.client import connect

from cloche.config import Limits
from cloche.sandbox.images import TemplateSource
from images_support import small_root
from support import ServerThread, make_config, require_gvisor

TOKEN = "t1"
SLOW_CELL_TIMEOUT_S = 180  # nbclient's limit for ordinary cells (a first matplotlib import)
STOPPED_CELL_TIMEOUT_S = 5  # the cell that nbclient interrupts on its timeout
RECV_TIMEOUT_S = 60.0


# --- the client subclass the README shows ----------------------------------------------
class TokenGatewayKernelClient(GatewayKernelClient):
    """jupyter_server's GatewayKernelClient opens its websocket without GatewayClient's auth
    header (its REST calls have it): this one sends it there too."""

    async def start_channels(
        self,
        shell: bool = True,
        iopub: bool = True,
        stdin: bool = True,
        hb: bool = True,
        control: bool = True,
    ) -> None:
        gateway = GatewayClient.instance()
        url = url_path_join(
            gateway.ws_url, gateway.kernels_endpoint, url_escape(self.kernel_id), "channels"
        )
        self.channel_socket = websocket.create_connection(
            url,
            timeout=gateway.KERNEL_LAUNCH_TIMEOUT,
            enable_multithread=True,
            header=gateway.load_connection_args()["headers"],  # Authorization: token <t>
        )
        # the channels of jupyter_client's KernelClient (GatewayKernelClient's own is replaced)
        super(GatewayKernelClient, self).start_channels(shell, iopub, stdin, hb, control)
        self.response_router = Thread(target=self._route_responses)
        self.response_router.start()

    def stop_channels(self) -> None:
        super().stop_channels()
        # websocket-client's close() leaves its socket open when the gateway closed first
        # (as it does when the kernel is shut down)
        assert self.channel_socket is not None
        self.channel_socket.shutdown()


class TokenGatewayKernelManager(GatewayKernelManager):
    """GatewayKernelManager whose clients send the token on their websocket."""

    client_factory = Type(TokenGatewayKernelClient, klass=GatewayKernelClient)

    async def _async_is_alive(self) -> bool:
        # What the client's is_alive() asks (nbclient does, on a cell's timeout): the
        # inherited one looks for a local process; this one asks the gateway over REST.
        alive: bool = await self.is_alive()
        return alive


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(state_root) -> Iterator[ServerThread]:
    """A server whose one token is TOKEN."""
    require_gvisor()
    # Cells may take long on a busy machine (a first matplotlib import builds its font
    # cache); the cell that is stopped is stopped by the client's interrupt, not this limit.
    limits = Limits(cell_timeout_s=SLOW_CELL_TIMEOUT_S, interrupt_grace_s=1.0)
    config = make_config(state_root, tokens=frozenset({TOKEN}), pool_size=2, limits=limits)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def cloche(gateway) -> Iterator[httpx.Client]:
    """cloche's own HTTP API (sessions), as TOKEN."""
    with httpx.Client(
        base_url=f"http://127.0.0.1:{gateway.http_port}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    ) as client:
        yield client


def session_ids(cloche: httpx.Client) -> set[str]:
    response = cloche.get("/v1/sessions")
    assert response.status_code == 200, response.text
    return {session["id"] for session in response.json()["sessions"]}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- 1. nbclient through GatewayKernelManager, against a local ipykernel -------------------

CELLS = [
    "print('hi')",
    "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()",
    "import pandas as pd\npd.DataFrame({'a': [1, 2]})",
    "1 / 0",
    "!echo hi",
    "%time sum(range(10))",
    "%%writefile f.txt\nwritten by a cell magic\n",
    "print(open('f.txt').read())",
    "import time\nprint('sleeping', flush=True)\ntime.sleep(60)\nprint('not reached')",
    "print('still alive')",
]
STOPPED_CELL = 8  # stopped by nbclient's timeout (it interrupts the kernel)


def notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nb.cells[STOPPED_CELL].metadata["tags"] = ["stopped-by-timeout"]
    return nb


def cell_timeout(cell: nbformat.NotebookNode) -> int:
    """nbclient's timeout_func: the tagged cell is interrupted after a few seconds."""
    tags = cell.get("metadata", {}).get("tags", [])
    return STOPPED_CELL_TIMEOUT_S if "stopped-by-timeout" in tags else SLOW_CELL_TIMEOUT_S


def run_notebook(**client: Any) -> nbformat.NotebookNode:
    nb = notebook()
    NotebookClient(
        nb, timeout_func=cell_timeout, allow_errors=True, interrupt_on_timeout=True, **client
    ).execute()
    return nb


@pytest.fixture
def gateway_client_config(gateway, monkeypatch) -> Iterator[None]:
    """GatewayClient (a process-wide singleton) pointed at cloche with TOKEN."""
    # GatewayClient writes these into os.environ; monkeypatch puts them back afterwards.
    monkeypatch.setenv("KERNEL_LAUNCH_TIMEOUT", "60")
    monkeypatch.delenv("KERNEL_USERNAME", raising=False)
    GatewayClient.clear_instance()
    GatewayClient.instance(url=f"http://127.0.0.1:{gateway.http_port}", auth_token=TOKEN)
    yield
    GatewayClient.clear_instance()


_TIMINGS = re.compile(r"\d+(\.\d+)?(e[+-]?\d+)?\s*(ns|µs|μs|us|ms|s)\b")  # IPython: "1e+03 ns" too
# matplotlib's notice on its first import where its font cache is cold (in every new
# sandbox; rarely on a developer's machine): the state of a cache, not of the notebook.
_FONT_CACHE_NOTICE = "Matplotlib is building the font cache; this may take a moment.\n"


def normalised(nb: nbformat.NotebookNode) -> list[list[tuple[Any, ...]]]:
    """Per cell, its outputs as what must match across kernels (consecutive streams of one
    name joined; %time's durations, figure reprs and tracebacks left out)."""
    cells = []
    for cell in nb.cells:
        outputs: list[tuple[Any, ...]] = []
        for output in cell.outputs:
            kind = output.output_type
            if kind == "stream":
                text = output.text.replace(_FONT_CACHE_NOTICE, "")
                # ipykernel runs `!cmd` under a pty, which ends lines with \r\n
                text = _TIMINGS.sub("T", text.replace("\r\n", "\n"))
                if not text:
                    continue
                if outputs and outputs[-1][:2] == ("stream", output.name):
                    outputs[-1] = ("stream", output.name, outputs[-1][2] + text)
                else:
                    outputs.append(("stream", output.name, text))
            elif kind == "error":
                outputs.append(("error", output.ename, output.evalue))
            elif "image/png" in output.data:
                png = base64.b64decode(output.data["image/png"])
                outputs.append((kind, "image/png", png.startswith(b"\x89PNG\r\n\x1a\n")))
            else:
                shown = {m: output.data[m] for m in ("text/plain", "text/html") if m in output.data}
                outputs.append((kind, json.dumps(shown, sort_keys=True)))
        cells.append(outputs)
    return cells


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nbclient_through_gateway_kernel_manager_matches_a_local_ipykernel(
    gateway, gateway_client_config, cloche, tmp_path
):
    before = session_ids(cloche)
    remote = run_notebook(kernel_manager_class=TokenGatewayKernelManager)
    local_dir = tmp_path / "local"
    local_dir.mkdir()
    local = run_notebook(kernel_name="python3", resources={"metadata": {"path": str(local_dir)}})

    assert remote.metadata["language_info"]["name"] == "python"
    got, expected = normalised(remote), normalised(local)
    for number, (source, mine, theirs) in enumerate(zip(CELLS, got, expected, strict=True)):
        assert mine == theirs, f"cell {number} ({source!r}) differs from ipykernel"
    # What the comparison stands on, spelled out:
    assert got[0] == [("stream", "stdout", "hi\n")]
    assert got[1] == [("display_data", "image/png", True)]
    assert got[2][0][0] == "execute_result" and "<table" in got[2][0][1]
    assert got[3] == [("error", "ZeroDivisionError", "division by zero")]
    assert got[4] == [("stream", "stdout", "hi\n")]
    assert got[5][0][:2] == ("stream", "stdout") and "Wall time: T" in got[5][0][2]
    assert got[5][1] == ("execute_result", json.dumps({"text/plain": "45"}))
    assert got[6] == [("stream", "stdout", "Writing f.txt\n")]
    assert got[7] == [("stream", "stdout", "written by a cell magic\n\n")]
    assert got[STOPPED_CELL] == [
        ("stream", "stdout", "sleeping\n"),
        ("error", "KeyboardInterrupt", ""),
    ]
    assert got[STOPPED_CELL + 1] == [("stream", "stdout", "still alive\n")]
    # nbclient shut its kernel down: the session is gone.
    wait_for(lambda: session_ids(cloche) <= before, "the notebook's session to close")


async def test_history_requests_of_jupyter_client_are_answered_from_the_sessions_history(
    gateway, gateway_client_config, cloche
):
    manager = TokenGatewayKernelManager()
    await manager.start_kernel()
    client = manager.client()
    await client.start_channels()
    try:
        await client.wait_for_ready(timeout=RECV_TIMEOUT_S)
        for code in ("print('hello')", "6 * 7", "import math", "6 * 7"):
            reply = await client.execute(code, reply=True, timeout=RECV_TIMEOUT_S)
            assert reply["content"]["status"] == "ok", reply["content"]
        # a cell sent another way is in the session's history too
        sent = cloche.post(
            f"/v1/sessions/{manager.kernel_id}/execute", json={"code": "print('over http')"}
        )
        assert sent.status_code == 200, sent.text

        async def history(**request: Any) -> list[Any]:
            reply = await client.history(**request, reply=True, timeout=RECV_TIMEOUT_S)
            assert reply["msg_type"] == "history_reply"
            assert reply["content"]["status"] == "ok", reply["content"]
            found: list[Any] = reply["content"]["history"]
            return found

        assert await history(hist_access_type="tail", n=2) == [
            [0, 4, "6 * 7"],
            [0, 5, "print('over http')"],
        ]
        assert await history(hist_access_type="tail", n=3, output=True) == [
            [0, 3, ["import math", None]],
            [0, 4, ["6 * 7", "42"]],
            [0, 5, ["print('over http')", "over http\n"]],
        ]
        everything = await history()  # jupyter_client's default: range, session 0, from 0
        assert [line for _, line, _ in everything] == [1, 2, 3, 4, 5]
        assert await history(hist_access_type="range", session=0, start=2, stop=4) == [
            [0, 2, "6 * 7"],
            [0, 3, "import math"],
        ]
        assert await history(hist_access_type="range", start=-2, output=True) == [
            [0, 4, ["6 * 7", "42"]],
            [0, 5, ["print('over http')", "over http\n"]],
        ]
        assert await history(hist_access_type="range", session=-1) == []  # no earlier one
        assert await history(hist_access_type="search", pattern="print(*") == [
            [0, 1, "print('hello')"],
            [0, 5, "print('over http')"],
        ]
        assert await history(hist_access_type="search", pattern="6 *", unique=True) == [
            [0, 4, "6 * 7"],
        ]
        assert await history(hist_access_type="search", pattern="*", n=1, output=True) == [
            [0, 5, ["print('over http')", "over http\n"]],
        ]
        assert await history(hist_access_type="search", pattern="PRINT*") == []
    finally:
        client.stop_channels()
        await manager.shutdown_kernel()


# --- 2. jupyter server --gateway-url=<cloche> ----------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def jupyter_server(gateway, tmp_path) -> Iterator[str]:
    """`jupyter server --gateway-url=<cloche>` on a free port, without auth of its own:
    its base URL. Stopped (by its pid) afterwards."""
    port = free_port()
    home = tmp_path / "jupyter"
    (home / "root").mkdir(parents=True)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTER_PLATFORM_DIRS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "jupyter_server",
        "--no-browser",
        "--allow-root",  # the gVisor tests run as root
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={home / 'root'}",
        "--IdentityProvider.token=",
        "--ServerApp.disable_check_xsrf=True",
        f"--gateway-url=http://127.0.0.1:{gateway.http_port}",
        f"--GatewayClient.auth_token={TOKEN}",
    ]
    log = (tmp_path / "jupyter_server.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert process.poll() is None, (tmp_path / "jupyter_server.log").read_text()
            try:
                return httpx.get(f"{base}/api", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "jupyter server to answer", timeout_s=120)
        yield base
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(30)
        log.close()


def _request(msg_type: str, content: dict[str, Any]) -> tuple[str, str]:
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": uuid.uuid4().hex,
        "username": "tester",
        "date": "2025-01-01T00:00:00.000000Z",
        "version": "5.3",
    }
    message = {
        "header": header,
        "parent_header": {},
        "metadata": {},
        "content": content,
        "buffers": [],
        "channel": "shell",
    }
    return msg_id, json.dumps(message)


@pytest.mark.slow
def test_jupyter_server_with_gateway_url_proxies_kernels_to_cloche(jupyter_server, cloche):
    with httpx.Client(base_url=jupyter_server, timeout=120) as server:
        response = server.post("/api/kernels", json={"name": "python3"})
        assert response.status_code == 201, response.text
        kernel_id = response.json()["id"]
        assert kernel_id in session_ids(cloche)  # the kernel is a cloche session
        assert kernel_id in {k["id"] for k in server.get("/api/kernels").json()}

        url = jupyter_server.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels"
        with connect(url, proxy=None, open_timeout=60) as ws:
            msg_id, request = _request("execute_request", {"code": "print(6*7)", "silent": False})
            ws.send(request)
            found: list[dict[str, Any]] = []
            while not (
                any(m["msg_type"] == "execute_reply" for m in found)
                and any(
                    m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                    for m in found
                )
            ):
                message = json.loads(ws.recv(timeout=RECV_TIMEOUT_S))
                if message["parent_header"].get("msg_id") == msg_id:
                    found.append(message)
        streams = [m["content"] for m in found if m["msg_type"] == "stream"]
        assert streams == [{"name": "stdout", "text": "42\n"}]
        (reply,) = [m for m in found if m["msg_type"] == "execute_reply"]
        assert reply["channel"] == "shell"
        assert reply["content"]["status"] == "ok"

        assert server.delete(f"/api/kernels/{kernel_id}").status_code == 204
    wait_for(lambda: kernel_id not in session_ids(cloche), "the kernel's session to close")


# --- 3. autogen-ext's DockerJupyterCodeExecutor ---------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
# autogen-ext's own config class, at its import: not ours to fix
@pytest.mark.filterwarnings("ignore:Support for class-based `config` is deprecated")
async def test_autogen_docker_jupyter_code_executor_runs_on_cloche(gateway, cloche, tmp_path):
    from autogen_core import CancellationToken
    from autogen_core.code_executor import CodeBlock
    from autogen_ext.code_executors.docker_jupyter import DockerJupyterCodeExecutor

    # (not re-exported by the package in autogen-ext 0.7)
    from autogen_ext.code_executors.docker_jupyter._jupyter_server import JupyterConnectionInfo

    info = JupyterConnectionInfo(
        host="127.0.0.1", use_https=False, port=gateway.http_port, token=TOKEN
    )
    executor = DockerJupyterCodeExecutor(jupyter_server=info, timeout=120, output_dir=tmp_path)
    cancel = CancellationToken()
    async with executor:
        kernel_id = executor._kernel_id
        assert kernel_id in session_ids(cloche)
        shared = await executor.execute_code_blocks(
            [CodeBlock("x = 21", "python"), CodeBlock("print(x * 2)", "python")], cancel
        )
        assert (shared.exit_code, shared.output.strip()) == (0, "42")

        figure = await executor.execute_code_blocks(
            [CodeBlock("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()", "python")],
            cancel,
        )
        assert figure.exit_code == 0, figure.output
        (png,) = figure.output_files
        assert png.parent == tmp_path and png.suffix == ".png"
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

        await executor.restart()
        after = await executor.execute_code_blocks([CodeBlock("print(x)", "python")], cancel)
        assert after.exit_code == 1
        assert "NameError" in after.output
        assert executor._kernel_id == kernel_id  # a restart keeps the kernel id
    wait_for(lambda: kernel_id not in session_ids(cloche), "the executor's kernel to close")


async def test_stock_gateway_kernel_client_is_refused_without_the_token(
    gateway, gateway_client_config, cloche
):
    """Why the README's subclass: jupyter_server's own GatewayKernelClient starts a kernel
    (REST, with the token) but opens its websocket without it, which cloche refuses. If a
    jupyter_server release sends it, this fails, and the subclass can go."""
    manager = GatewayKernelManager()
    await manager.start_kernel()
    try:
        assert manager.kernel_id in session_ids(cloche)
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            await manager.client().start_channels()
        assert refused.value.status_code == 401
    finally:
        await manager.shutdown_kernel()
    assert manager.kernel_id not in session_ids(cloche)


# --- 4. a kernelspec per template ------------------------------------------------------------


@pytest.fixture
def tiny_template(gateway, tmp_path) -> Iterator[str]:
    """A ready template of a tiny root (no python of its own: cells run on cloche's)."""
    manager = gateway.server.manager
    source = TemplateSource("tar", str(small_root(tmp_path / "tiny.tar")))
    gateway.call(manager.build_template("tiny", source))

    def ready() -> bool:
        info = gateway.call(manager.template("tiny"))
        assert info.state.value != "failed", info.error  # type: ignore[attr-defined]
        return bool(info.state.value == "ready")  # type: ignore[attr-defined]

    wait_for(ready, "the template to be built", timeout_s=300)
    yield "tiny"
    gateway.call(manager.delete_template("tiny"))


async def test_a_template_s_kernelspec_starts_a_session_of_that_template(
    gateway, gateway_client_config, cloche, tiny_template
):
    specs = cloche.get("/api/kernelspecs").json()
    assert specs["default"] == "python3"
    spec = specs["kernelspecs"]["cloche-template-tiny"]
    assert "tiny" in spec["spec"]["display_name"] and spec["spec"]["language"] == "python"
    assert "cloche-template-python" not in specs["kernelspecs"]  # python is python3's
    manager = TokenGatewayKernelManager()
    await manager.start_kernel(kernel_name="cloche-template-tiny")
    client = manager.client()
    await client.start_channels()
    try:
        kernel_id = manager.kernel_id
        session = cloche.get(f"/v1/sessions/{kernel_id}").json()
        assert (session["template"], session["profile"]) == ("tiny", "lean")
        assert cloche.get(f"/api/kernels/{kernel_id}").json()["name"] == "cloche-template-tiny"
        await client.wait_for_ready(timeout=RECV_TIMEOUT_S)
        reply = await client.execute(
            "print(open('/bin/sh').read().strip())", reply=True, timeout=RECV_TIMEOUT_S
        )
        assert reply["content"]["status"] == "ok"
        printed = []
        while True:  # its iopub messages, to its idle
            message = await client.get_iopub_msg(timeout=RECV_TIMEOUT_S)
            if message["parent_header"].get("msg_id") != reply["parent_header"]["msg_id"]:
                continue
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
        assert "".join(printed) == "#!not really a shell\n"  # the template's own root
    finally:
        client.stop_channels()
        await manager.shutdown_kernel()
    unknown = cloche.post("/api/kernels", json={"name": "cloche-template-nope"})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
