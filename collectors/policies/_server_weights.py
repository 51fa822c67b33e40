"""How new weights reach running servers: a small pluggable transport, and the fleet's version lock.

A :class:`WeightTransport` makes a set of weights available to the servers (``publish``) and says which
HTTP calls make one server load them (``load_calls``); the policy runs those calls on every server in
parallel, then resets the prefix caches. The built-in :class:`DirectoryTransport` writes one safetensors
file (to a temporary directory, then renamed, so a server never reads half a checkpoint) and asks each
server to load it with the calls its engine's dialect gives (``reload``: vLLM's ``POST /collective_rpc``
``reload_weights``, SGLang's ``POST /update_weights_from_disk``). It needs the servers to see the directory: the same
host, or a shared filesystem. A GPU fleet on several hosts would rather broadcast the tensors over NCCL (vLLM's weight
transfer engines): such a transport goes here, behind the same two methods, and the policy is unchanged.

:class:`FleetLock` keeps per-token policy versions exact when several processes (Ray workers) share the
servers: a wave holds the lock shared, a weight reload holds it exclusive, and a small file records the
version the servers hold and where its weights are. A wave is stamped with that version, so no token is
ever labelled with weights it was not sampled under. It is a ``flock`` on a file: processes on one host
(or a filesystem with working ``flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

__all__ = ["DirectoryTransport", "FleetLock", "WeightTransport", "load_call", "save_tensors"]


@runtime_checkable
class WeightTransport(Protocol):
    """Gets weights to servers. ``publish`` runs once per update; ``load_calls`` per server."""

    def publish(self, items: list[tuple[str, torch.Tensor]], version: int) -> str:
        """Make ``items`` (transformers names, all the checkpoint's tensors) available as ``version``;
        returns a handle (e.g. a directory) that :meth:`load_calls` understands."""

    def load_calls(self, handle: str) -> list[tuple[str, dict]]:
        """``(path, json body)`` of the POSTs that make one server load the weights ``handle`` names."""

    def close(self) -> None:
        """Release what :meth:`publish` made (files, communicators)."""


class DirectoryTransport:
    """Weights as safetensors in ``root/v{version}``; servers reload them from there.

    Args:
        root: a directory the servers can read (and, for Ray workers sharing servers, the workers share);
            ``None``: a new temporary directory, removed by :meth:`close`.
        keep: versions kept on disk (older ones are removed once a newer one is written).
        reload: ``reload(handle)``, the ``(path, json body)`` POSTs that make one server load the directory
            ``handle`` (the engine's: its dialect's ``transport`` passes them); ``None``: a transport that only
            writes (an engine in this process reads the files itself), whose :meth:`load_calls` refuses.

    Example:
        >>> import torch
        >>> transport = DirectoryTransport(reload=lambda handle: [("/update_weights_from_disk", {"model_path": handle})])
        >>> handle = transport.publish([("w", torch.ones(2))], version=1)
        >>> sorted(os.listdir(handle)), transport.load_calls(handle)[0][0]
        (['model.safetensors'], '/update_weights_from_disk')
        >>> transport.close()
    """

    prefix = "v"
    """Directory names are ``prefix`` then the version in 8 digits."""

    def __init__(self, root: str | os.PathLike | None = None, *, keep: int = 2,
                 reload: Callable[[str], list[tuple[str, dict]]] | None = None) -> None:  # fmt: skip
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the current version stays on disk), got {keep!r}")
        if reload is not None and not callable(reload):
            raise TypeError(f"reload must be a function handle -> [(path, body)], got {type(reload).__name__}")
        self.reload = reload
        self.is_owned = root is None
        self.root = Path(tempfile.mkdtemp(prefix="tokengym-weights-") if root is None else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def publish(self, items: list[tuple[str, torch.Tensor]], version: int) -> str:
        target = self.root / f"{self.prefix}{version:08d}"
        if target.is_dir():  # another process sharing this root wrote this version already
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.root))
        try:
            self.write(tmp, items)
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._prune(version)
        return str(target)

    def write(self, directory: Path, items: list[tuple[str, torch.Tensor]]) -> None:
        """Write ``items`` into ``directory`` (a fresh one, renamed into place once written)."""
        save_tensors(items, directory / "model.safetensors")

    def _prune(self, version: int) -> None:
        for old in self.root.glob(f"{self.prefix}*"):
            number = old.name[len(self.prefix) :]
            if number.isdigit() and int(number) <= version - self.keep:
                shutil.rmtree(old, ignore_errors=True)

    def load_calls(self, handle: str) -> list[tuple[str, dict]]:
        if self.reload is None:
            raise ValueError(f"this {type(self).__name__} was built without reload, so no server can be told to load "
                             f"{handle}; build it with the engine's calls (the dialect's transport(root) does)")  # fmt: skip
        return self.reload(handle)

    def close(self) -> None:
        if self.is_owned:
            shutil.rmtree(self.root, ignore_errors=True)


async def load_call(fleet, server, path: str, body: dict) -> None:
    """POST one of :meth:`WeightTransport.load_calls` to ``server``; a 2xx answer that is not JSON (vLLM's
    ``/v1/load_lora_adapter`` answers plain text) is a success too."""
    try:
        await fleet.call(server, "POST", path, body)
    except json.JSONDecodeError:  # raised only once the status said success
        pass


def save_tensors(items: list[tuple[str, torch.Tensor]], path: Path) -> None:
    """``items`` as one safetensors file (tensors sharing memory, such as tied layers, are copied: safetensors
    refuses them)."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, tensor in items:
        tensor = tensor.detach().to("cpu").contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        tensors[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    save_file(tensors, str(path))


class FleetLock:
    """Shared (a wave) / exclusive (a reload) lock over a fleet, and the weights version it holds.

    Example:
        >>> lock = FleetLock(tempfile.mkdtemp())
        >>> with lock.exclusive():
        ...     lock.write(3, "/weights/v3")
        >>> with lock.shared() as (version, handle):
        ...     version, handle
        (3, '/weights/v3')
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.lock_path, self.state_path = self.root / "fleet.lock", self.root / "fleet.json"

    @contextlib.contextmanager
    def _held(self, mode: int):
        with open(self.lock_path, "a+") as f:
            fcntl.flock(f, mode)
            try:
                yield self.read()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def shared(self):
        """Context: held by a wave; yields ``(version, handle)`` the servers hold."""
        return self._held(fcntl.LOCK_SH)

    def exclusive(self):
        """Context: held by a weight reload; yields ``(version, handle)`` before it."""
        return self._held(fcntl.LOCK_EX)

    def read(self) -> tuple[int, str | None]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return 0, None
        return int(state["version"]), state.get("handle")

    def write(self, version: int, handle: str | None) -> None:
        """Record the version the servers now hold (call with :meth:`exclusive` held)."""
        tmp = self.state_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": version, "handle": handle}))
        os.replace(tmp, self.state_path)
