"""ServerProcess: a server child started on a free port, waited for, its own error line kept, always stopped."""

from __future__ import annotations

import sys

import pytest

from outrider.interop.server_process import ServerFailed, ServerProcess, error_line


def test_a_server_comes_up_and_its_whole_group_is_stopped(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
            "import http.server, functools; h = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1]); " \
            "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[2])), h).serve_forever()"
    server = ServerProcess([sys.executable, "-c", child, str(tmp_path), "{port}"], log=tmp_path / "log")
    with server:
        server.wait_ready(timeout=30)
        assert server.url.endswith(str(server.port)) and server.proc.poll() is None
    assert server.proc.poll() is not None


def test_a_server_that_dies_gives_its_own_error_line(tmp_path):
    script = ("import sys; print('INFO starting', flush=True); "
              "raise ValueError('Model architectures [\\'X\\'] are not supported for now')")
    server = ServerProcess([sys.executable, "-c", script], log=tmp_path / "log")
    with server, pytest.raises(ServerFailed) as e:
        server.wait_ready(timeout=30)
    assert e.value.line == "ValueError: Model architectures ['X'] are not supported for now"


def test_error_line_joins_a_validation_detail_and_strips_log_prefixes(tmp_path):
    log = tmp_path / "log"
    log.write_text("(APIServer pid=1) INFO 12-06 04:11:09 [api.py:1] up\nTraceback (most recent call last):\n"
                   '  File "x.py", line 1, in f\n    raise X\n'
                   "pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n"
                   "  Value error, Unexpected keyword argument speculative_token_tree\n"
                   "    For further information visit https://errors.pydantic.dev\n")
    assert error_line(log) == ("pydantic_core.ValidationError: 1 validation error for SpeculativeConfig: "
                               "Value error, Unexpected keyword argument speculative_token_tree")
    assert error_line(tmp_path / "missing", "none") == "none"


def test_error_line_skips_wrappers_that_point_back_at_the_cause(tmp_path):
    log = tmp_path / "log"
    log.write_text("(Worker pid=1) ERROR 12-06 07:28:10 [multiproc_executor.py:1063] ValueError: No common block size "
                   "for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]).\n"
                   "RuntimeError: Worker failed with error 'No common block size', please check the stack trace above "
                   "for the root cause\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert error_line(log) == "ValueError: No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])."
