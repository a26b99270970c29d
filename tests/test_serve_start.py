"""Starting and stopping the service as its users do, through scripts/ on this machine: the install shows its
progress; `scripts/serve.sh` of a config that asks for GPUs on a machine without one fails naming it instead of
waiting; SIGTERM (docker stop, systemd, kill) stops a running server cleanly, with no crash-style stack dump; the
README says how to install on a CPU-only machine and how to stop the server."""
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.app import GPU_WAIT_ENV
from serve_app.local import free_port
from shadowkv_core.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
CRASH_DUMP = "SIGTERM received"  # the first line of Ray's failure-signal handler's stack dump
FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the venv's python: records each call, answers imports, and prints what pip prints while installing.
here=$(cd "$(dirname "$0")/.." && pwd)
echo "$*" >> "$here/calls"
if [ "$1" = "-c" ]; then
    case "$2" in *"import torch"*) [ -f "$here/torch-installed" ]; exit $?;; esac
    exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
    spec=${@: -1}
    printf 'Collecting %s\\n  Downloading %s.whl (12.3 MB)\\nInstalling collected packages: %s\\n' "$spec" "$spec" "$spec"
    case "$spec" in torch*) touch "$here/torch-installed";; esac
    exit 0
fi
exit 2
"""


def _fake_venv(root: Path) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    return venv


def test_the_first_start_shows_the_installs_progress_and_a_second_is_quiet(tmp_path):
    venv = _fake_venv(tmp_path)
    env = {**os.environ, "SHADOWKV_VENV": str(venv), "SHADOWKV_TORCH_SPEC": "torch==2.13.0",
           "SHADOWKV_EXTRAS": "test"}
    first = subprocess.run(["bash", "-c", f". {ROOT / 'scripts' / 'env.sh'}"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    shown = first.stdout + first.stderr
    for line in ("shadowkv: installing torch==2.13.0", "Collecting torch==2.13.0", "Downloading torch==2.13.0.whl",
                 "shadowkv: installing the project and its dependencies (test)", f"Collecting {ROOT}[test]"):
        assert line in shown, shown
    pip_calls = [c.split() for c in (venv / "calls").read_text().splitlines() if c.startswith("-m pip")]
    assert len(pip_calls) == 2 and not {"-q", "--quiet", "-qq"} & {arg for call in pip_calls for arg in call}
    again = subprocess.run(["bash", "-c", f". {ROOT / 'scripts' / 'env.sh'}"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and "installing" not in again.stdout + again.stderr


class Server:
    """`scripts/serve.sh` with SHADOWKV_CONFIG, in a session of its own; its output is collected as it comes."""

    def __init__(self, config: Path):
        self.lines: list[str] = []
        env = {k: v for k, v in os.environ.items() if k != GPU_WAIT_ENV}  # the shipped wait, not a test's
        self.proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve.sh")], cwd=ROOT, text=True,
                                     env={**env, "SHADOWKV_CONFIG": str(config)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if found := re.search(pattern, self.output):
                return found
            time.sleep(0.5)
        raise AssertionError(f"{pattern!r} not in the output within {timeout_s} s:\n{self.output[-4000:]}")

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not healthy within {timeout_s} s:\n{self.output[-4000:]}")

    def terminate(self, timeout_s: float) -> int:
        """SIGTERM to `serve run` (serve.sh execs it), as docker stop and systemd send it; its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        """Whatever of this server's session is left (Ray's processes included) is killed."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.reader.join(timeout=10)


def _config(tmp_path: Path, name: str, port: int, **args) -> Path:
    """A shipped config on a free loopback port; its relative paths still resolve against configs/."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {**config["http_options"], "host": "127.0.0.1", "port": port}
    config["applications"][0]["args"] |= {"config_dir": str(CONFIGS), **args}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_sigterm_stops_a_running_server_cleanly(tmp_path):
    port = free_port()
    server = Server(_config(tmp_path, "local.yaml", port))
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", timeout_s=300)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["random_weights"] is False
        status = server.terminate(timeout_s=60)
    finally:
        server.close()
    assert status in (0, signal.SIGTERM), server.output[-4000:]
    assert CRASH_DUMP not in server.output and "Traceback" not in server.output, server.output[-4000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_gpu_config_on_a_machine_without_a_gpu_fails_naming_it(tmp_path):
    """configs/prod.yaml (the tiny model in place of its checkpoint) on this CPU machine: the app's build gives up
    after SHADOWKV_GPU_WAIT_S (under 30 s unless set) with a message saying there is no GPU; it does not wait."""
    model = build_tiny_model(tmp_path / "tiny")
    server = Server(_config(tmp_path, "prod.yaml", free_port(), model=str(model)))
    try:
        found = server.wait_for(r"no GPU: each engine replica needs 1 .*? this Ray cluster has 0 after (\S+) s",
                                timeout_s=240)
        assert float(found.group(1)) < 30
        server.terminate(timeout_s=60)
    finally:
        server.close()
    assert CRASH_DUMP not in server.output


def test_the_readme_says_how_to_install_on_a_cpu_start_and_stop_the_server():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/serve.sh" in readme
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme  # not the CUDA build
    assert "Ctrl-C" in readme and "SIGTERM" in readme and "kill <pid>" in readme
