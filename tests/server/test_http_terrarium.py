"""Terrarium's endpoint (`POST /`) over HTTP, against a real gVisor server.

Existing Terrarium clients read one JSON object up to the first newline, so every
answer here, success or failure, is checked to be exactly that.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PDF_MAGIC = b"%PDF-"
MODULUS = 1_000_003  # keeps the long script's numbers small
# Each request may wait for a `data` sandbox to start (~3 s, far more on a loaded machine).
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def terrarium(state_root) -> Iterator[ServerThread]:
    """The server most tests share: Terrarium uses the `data` pool only."""
    require_gvisor()
    with ServerThread(make_config(state_root, pool_size=0, data_pool_size=3)) as running:
        running.call(running.server.manager.pools["data"].wait_full(600), timeout_s=600)
        yield running


@pytest.fixture(scope="module")
def http(terrarium) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{terrarium.http_port}", timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def wide(state_root) -> Iterator[ServerThread]:
    """Eight warm `data` sandboxes and a short cell timeout."""
    require_gvisor()
    config = make_config(
        state_root,
        pool_size=0,
        data_pool_size=8,
        # Refills start one at a time, leaving a core to the cells of the parallel test.
        start_concurrency=1,
        limits=Limits(cell_timeout_s=3, interrupt_grace_s=1),
    )
    with ServerThread(config) as running:
        running.call(running.server.manager.pools["data"].wait_full(600), timeout_s=600)
        yield running


def one_line(response: httpx.Response) -> dict[str, Any]:
    """The body as Terrarium's client reads it: one JSON object, then exactly one newline."""
    body = response.text
    assert body.endswith("\n"), body
    assert body.count("\n") == 1, body
    answer = json.loads(body)
    assert isinstance(answer, dict)
    return answer


def run(http: httpx.Client, code: str | None, files: dict[str, bytes] | None = None) -> Any:
    payload: dict[str, Any] = {} if code is None else {"code": code}
    if files is not None:
        payload["files"] = [
            {"filename": name, "b64_data": base64.b64encode(data).decode()}
            for name, data in files.items()
        ]
    response = http.post("/", json=payload)
    assert response.status_code == 200, response.text
    return one_line(response)


def outputs(answer: dict[str, Any]) -> dict[str, bytes]:
    return {f["filename"]: base64.b64decode(f["b64_data"]) for f in answer["output_files"]}


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("1 + 1", 2),
        ("'text' * 2", "texttext"),
        ("[1, 2, 'three']", [1, 2, "three"]),
        ("{'a': [1, 2], 'b': {'c': None}}", {"a": [1, 2], "b": {"c": None}}),
        ("{3, 1, 2}", "{1, 2, 3}"),
        ("import numpy as np; np.arange(3)", "array([0, 1, 2])"),
        ("None", None),
        ("x = 5", None),
    ],
)
def test_the_final_expression_is_json_when_it_can_be_else_its_repr(http, code, expected):
    answer = run(http, code)
    assert answer["success"] is True, answer
    assert answer["final_expression"] == expected
    assert answer["std_out"] == answer["std_err"] == ""
    assert answer["output_files"] == []
    assert isinstance(answer["code_runtime"], int)
    assert "error" not in answer or answer["error"] is None


def test_stdout_and_stderr_come_back_apart(http):
    answer = run(
        http,
        "import sys, os\nprint('to out')\nprint('to err', file=sys.stderr)\n"
        "os.write(1, b'fd out\\n')\n'done'",
    )
    assert answer["success"] is True
    assert answer["std_out"] == "to out\nfd out\n"
    assert answer["std_err"] == "to err\n"
    assert answer["final_expression"] == "done"


def test_a_syntax_error_is_a_parsing_failure(http):
    answer = run(http, "print('never')\ndef f(:\n    pass")
    assert answer["success"] is False
    assert answer["error"]["type"] == "parsing"
    assert "SyntaxError" in answer["error"]["message"]
    assert "def f(:" in answer["error"]["message"]
    assert answer["std_out"] == ""


def test_a_runtime_error_is_named_and_carries_its_traceback(http):
    answer = run(http, "print('before')\ndef f(x):\n    return 1 / x\nf(0)")
    assert answer["success"] is False
    assert answer["error"]["type"] == "ZeroDivisionError"
    message = answer["error"]["message"]
    assert "Traceback" in message
    assert "line 3" in message and "return 1 / x" in message
    assert "division by zero" in message
    assert answer["std_out"] == "before\n"


def test_a_lone_surrogate_in_the_answer_is_still_one_json_line(http):
    # A str UTF-8 can't encode, made by the code: it used to leave the client hanging.
    answer = run(http, "raise ValueError('\\ud800 in here')")
    assert answer["success"] is False
    assert "\ud800 in here" in answer["error"]["message"]
    assert run(http, "'\\udfff'")["final_expression"] == "\udfff"


def test_a_missing_module_is_a_module_not_found_error(http):
    answer = run(http, "import surely_not_installed_module")
    assert answer["success"] is False
    assert answer["error"]["type"] == "ModuleNotFoundError"
    assert "surely_not_installed_module" in answer["error"]["message"]


def test_numpy_pandas_and_sympy_are_there(http):
    answer = run(
        http,
        "import numpy as np\nimport pandas as pd\nimport sympy\n"
        "df = pd.DataFrame({'a': [1, 2, 3], 'b': [4.0, 5.0, 6.0]})\n"
        "x = sympy.Symbol('x')\n"
        "[int(np.arange(5).sum()), float(df['b'].mean()), str(sympy.expand((x + 1) ** 2)),"
        " str(sympy.integrate(x ** 2, x))]",
    )
    assert answer["success"] is True, answer
    assert answer["final_expression"] == [10, 5.0, "x**2 + 2*x + 1", "x**3/3"]


def long_pandas_script(min_chars: int = 12_000) -> tuple[str, dict[str, Any]]:
    """Many small DataFrame steps, and what they must compute (worked out here in Python)."""
    rows = [{"k": i % 7, "v": i} for i in range(60)]
    lines = [
        "import numpy as np",
        "import pandas as pd",
        f"M = {MODULUS}",
        "df = pd.DataFrame({'k': [i % 7 for i in range(60)], 'v': list(range(60))})",
    ]
    step = 0
    while len("\n".join(lines)) < min_chars:
        step += 1
        kind = step % 5
        if kind == 0:  # arithmetic on a column
            factor = step * 3 + 1
            lines.append(f"df = df.assign(v=(df['v'] * {factor} + {step}) % M)")
            for row in rows:
                row["v"] = (row["v"] * factor + step) % MODULUS
        elif kind == 1:  # group sums put back on each row
            lines.append("df['v'] = (df['v'] + df.groupby('k')['v'].transform('sum')) % M")
            sums: dict[int, int] = {}
            for row in rows:
                sums[row["k"]] = sums.get(row["k"], 0) + row["v"]
            for row in rows:
                row["v"] = (row["v"] + sums[row["k"]]) % MODULUS
        elif kind == 2:  # a new lookup table, merged in
            weights = [(step * (j + 1)) % 11 for j in range(7)]
            lines.append(f"t{step} = pd.DataFrame({{'k': list(range(7)), 'w': {weights}}})")
            lines.append(f"df = df.merge(t{step}, on='k', how='left')")
            lines.append(f"df = df.assign(v=(df['v'] + df['w'] * {step}) % M).drop(columns=['w'])")
            for row in rows:
                row["v"] = (row["v"] + weights[row["k"]] * step) % MODULUS
        elif kind == 3:  # sort, filter, and append copies of the first rows
            lines.append("df = df.sort_values(['k', 'v'], kind='stable').reset_index(drop=True)")
            lines.append("df = pd.concat([df[df['v'] % 3 != 0], df.head(4)], ignore_index=True)")
            rows.sort(key=lambda row: (row["k"], row["v"]))
            rows = [row for row in rows if row["v"] % 3 != 0] + [dict(row) for row in rows[:4]]
        else:  # a numpy column folded in, then dropped
            period = step % 13 + 2
            lines.append(f"df['u'] = np.arange(len(df)) % {period}")
            lines.append("df = df.assign(v=(df['v'] + df['u']) % M).drop(columns='u')")
            for index, row in enumerate(rows):
                row["v"] = (row["v"] + index % period) % MODULUS
    lines.append(
        "{'rows': len(df), 'total': int(df['v'].sum()), "
        "'first': [int(v) for v in df['v'].head(5)], 'columns': list(df.columns)}"
    )
    expected = {
        "rows": len(rows),
        "total": sum(row["v"] for row in rows),
        "first": [row["v"] for row in rows[:5]],
        "columns": ["k", "v"],
    }
    return "\n".join(lines) + "\n", expected


def test_a_long_pandas_script_runs_to_its_final_expression(http):
    code, expected = long_pandas_script()
    assert len(code) >= 12_000
    answer = run(http, code)
    assert answer["success"] is True, answer.get("error")
    assert answer["final_expression"] == expected


def test_input_files_flat_and_nested_are_there_for_the_code(http):
    answer = run(
        http,
        "import pandas as pd\n"
        "a = pd.read_csv('in.csv')\nb = pd.read_csv('d/e/in.csv')\n"
        "[int(a['x'].sum()), b['name'].tolist()]",
        files={"in.csv": b"x\n1\n2\n3\n", "d/e/in.csv": b"name\nada\ngrace\n"},
    )
    assert answer["success"] is True, answer
    assert answer["final_expression"] == [6, ["ada", "grace"]]
    assert answer["output_files"] == []  # read, not changed


def test_matplotlib_figures_saved_by_the_code_come_back(http):
    answer = run(
        http,
        "import os\nimport matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\nax.plot([1, 2, 3], [1, 4, 9])\n"
        "os.makedirs('charts', exist_ok=True)\n"
        "fig.savefig('plot.png')\nfig.savefig('charts/plot.svg')\nfig.savefig('plot.pdf')\n",
    )
    assert answer["success"] is True, answer
    files = outputs(answer)
    assert sorted(files) == ["charts/plot.svg", "plot.pdf", "plot.png"]
    assert files["plot.png"].startswith(PNG_MAGIC)
    assert files["plot.pdf"].startswith(PDF_MAGIC)
    assert files["charts/plot.svg"].lstrip().startswith(b"<?xml")
    assert b"<svg" in files["charts/plot.svg"]


def test_changed_and_new_files_come_back_and_unchanged_inputs_do_not(http):
    answer = run(
        http,
        "import os\n"
        "with open('change.csv', 'a') as f:\n    f.write('2\\n')\n"
        "os.makedirs('out', exist_ok=True)\n"
        "with open('out/new.txt', 'w') as f:\n    f.write('new')\n"
        "open('keep.txt').read() + open('sub/inner.txt').read()",
        files={"keep.txt": b"same", "change.csv": b"a\n1\n", "sub/inner.txt": b"-x"},
    )
    assert answer["success"] is True, answer
    assert answer["final_expression"] == "same-x"
    assert outputs(answer) == {"change.csv": b"a\n1\n2\n", "out/new.txt": b"new"}


def test_symlinks_made_by_the_code_bring_no_host_file_back(http):
    answer = run(
        http,
        "import os\nos.symlink('/etc/passwd', 'passwd.txt')\nos.symlink('/', 'root')\n"
        "os.remove('in.txt')\nos.symlink('/etc/hostname', 'in.txt')\n"
        "open('real.txt', 'w').write('mine')",
        files={"in.txt": b"input"},
    )
    assert answer["success"] is True, answer
    assert outputs(answer) == {"real.txt": b"mine"}


def test_nothing_is_left_from_one_request_to_the_next(http):
    first = run(http, "secret = 41\nopen('left.txt', 'w').write('x')\nsecret + 1")
    assert first["final_expression"] == 42
    assert list(outputs(first)) == ["left.txt"]
    second = run(http, "import os\n['secret' in globals(), os.path.exists('left.txt')]")
    assert second["success"] is True, second
    assert second["final_expression"] == [False, False]


@pytest.mark.parametrize("payload", [{"code": ""}, {"code": "  \n\t"}, {}, {"code": None}])
def test_empty_or_missing_code_is_a_parsing_failure(http, payload):
    response = http.post("/", json=payload)
    assert response.status_code == 200
    assert one_line(response) == {
        "success": False,
        "error": {"type": "parsing", "message": "no code provided"},
    }


@pytest.mark.parametrize(
    "body", [b"{not json", b'{"code": "1"', b"", b"[1, 2]", b'"code"', b'{"code": 5}']
)
def test_a_body_that_is_not_a_request_is_refused_in_terrariums_shape(http, body):
    response = http.post("/", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    answer = one_line(response)
    assert answer["success"] is False
    assert answer["error"]["type"] and answer["error"]["message"]


def test_invalid_base64_is_refused(http, terrarium):
    created = terrarium.server.manager.created
    response = http.post(
        "/", json={"code": "1", "files": [{"filename": "a.bin", "b64_data": "not base64!"}]}
    )
    assert response.status_code == 400
    answer = one_line(response)
    assert answer["success"] is False
    assert answer["error"]["type"] == "parsing"
    assert "a.bin" in answer["error"]["message"]
    assert terrarium.server.manager.created == created  # refused before taking a sandbox


@pytest.mark.parametrize("filename", ["../escape.txt", "/etc/escape.txt", "a/../../b", "", "."])
def test_input_files_outside_the_working_directory_are_refused(http, terrarium, filename):
    created = terrarium.server.manager.created
    response = http.post(
        "/", json={"code": "1", "files": [{"filename": filename, "b64_data": "eA=="}]}
    )
    assert response.status_code == 400
    answer = one_line(response)
    assert answer["success"] is False
    assert answer["error"]["type"] == "parsing"
    assert f"path {filename!r} refused" in answer["error"]["message"]
    assert terrarium.server.manager.created == created  # refused before taking a sandbox


def test_health_answers_ok(http):
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.timeout(600)
def test_a_sleeping_cell_is_stopped_by_the_cell_timeout(wide):
    with httpx.Client(base_url=f"http://127.0.0.1:{wide.http_port}", timeout=180) as client:
        response = client.post("/", json={"code": "import time\nprint('going')\ntime.sleep(200)"})
    assert response.status_code == 200
    answer = one_line(response)
    assert answer["success"] is False
    assert answer["error"]["type"] == "timeout"
    assert "3 s" in answer["error"]["message"]
    assert answer["std_out"] == "going\n"
    assert 2_900 <= answer["code_runtime"] < 30_000  # stopped at 3 s, long before 200 s


@pytest.mark.timeout(600)
def test_requests_run_in_parallel(wide):
    wide.call(wide.server.manager.pools["data"].wait_full(600), timeout_s=600)
    count = 8
    barrier = threading.Barrier(count + 1)
    url = f"http://127.0.0.1:{wide.http_port}"

    def one(index: int) -> tuple[dict[str, Any], float]:
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/health")  # connect before the clock starts
            barrier.wait()
            response = client.post("/", json={"code": f"import time\ntime.sleep(1)\n{index}"})
            finished = time.monotonic()
        assert response.status_code == 200
        return one_line(response), finished

    with ThreadPoolExecutor(count) as threads:
        futures = [threads.submit(one, i) for i in range(count)]
        barrier.wait()
        started = time.monotonic()
        results = [future.result() for future in futures]
    elapsed = max(finished for _, finished in results) - started
    assert [answer["final_expression"] for answer, _ in results] == list(range(count))
    assert all(answer["code_runtime"] >= 1000 for answer, _ in results)
    # Serially this would take 8 s; in parallel a little over 1 s.
    assert elapsed < 4, f"{count} one-second cells took {elapsed:.2f} s"
