"""LoRA on running servers: adapters where every server takes them, merged weights where none does.

Whether a server takes adapters, the calls that load one and how a request names it are its engine's (the dialect's
``takes_adapters``, ``adapter_calls``, ``name_adapter``; a vLLM server takes them when started with ``--enable-lora
--max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, an SGLang one with ``--enable-lora``). Then every
update is a new adapter directory loaded on every server under its own name, and each request names the adapter the
fleet holds (read
under the fleet lock, so a wave is stamped with the version it was sampled under, as with full weights; a server
that comes back loads it before it takes requests). Otherwise every update is the base checkpoint with the
adapter merged, reloaded as full weights. Version 0 (the PEFT model's adapter as it is at construction) is
loaded at construction unless it changes nothing or a process sharing the servers loaded one already.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from tokengym.collectors.policies._checkpoints import checkpoint_shapes, tied_outputs, weight_items
from tokengym.collectors.policies._lora_sync import MERGE_FIX, AdapterSpec, AdapterTransport, lora_rank
from tokengym.collectors.policies._server_weights import load_call
from tokengym.collectors.policies._wave_core import update_tensors

__all__ = ["ServerAdapters"]

logger = logging.getLogger("tokengym.collectors.lora")

_MIXED = ("servers {urls} do not take LoRA adapters but the others do; start every server with {hint} (or none: "
          "merged weights go instead)")  # fmt: skip
_MERGED = ("the {name} servers do not take LoRA adapters (start them with {hint}): every update sends the merged full "
           "weights")  # fmt: skip


async def _each(calls) -> list:
    return await asyncio.gather(*calls)


class ServerAdapters:
    """The LoRA part of a ``ServerPolicy``: what an update sends, and which adapter its requests name.

    Args:
        lora: the PEFT model or its ``peft.LoraConfig``.
        policy: the ``ServerPolicy`` (its ``fleet``, ``fleet_lock``, ``transport``, ``checkpoint_dir``,
            ``options`` and ``dialect``, a ``FleetDialect``), checked against its servers already.

    Attributes:
        sync: ``"adapter"`` or ``"merged"``.
        transport: the :class:`AdapterTransport` the policy publishes with (``None``: merged weights go through the
            policy's own transport).
    """

    def __init__(self, lora, policy) -> None:
        self.fleet, self.fleet_lock, self.checkpoint_dir = policy.fleet, policy.fleet_lock, policy.checkpoint_dir
        self.dialect = policy.dialect
        shapes = None if self.checkpoint_dir is None else checkpoint_shapes(self.checkpoint_dir)
        self.spec = AdapterSpec.of(lora, shapes)
        takes = self.fleet.run(_each(self.dialect.takes_adapters(self.fleet, s) for s in self.fleet.servers))
        if any(takes) and not all(takes):
            urls = [s.url for s, t in zip(self.fleet.servers, takes, strict=True) if not t]
            raise ValueError(_MIXED.format(urls=urls, hint=self._hint()))
        self.sync = "adapter" if all(takes) else "merged"
        if self.sync == "adapter":
            if policy.options.transport is not None:
                raise ValueError("ServerOptions.transport moves full weights; a LoRA policy whose servers take "
                                 "adapters writes adapter directories: leave transport=None")  # fmt: skip
            self.transport = AdapterTransport(self.spec, policy.options.weights_dir, reload=self.dialect.adapter_calls)
            self._load_initial(self.transport)
            return
        if self.checkpoint_dir is None:
            raise ValueError("the servers do not take LoRA adapters, and merged weights need the base checkpoint here: "
                             "pass ServerOptions(checkpoint_dir=<a local copy of the served model directory>)")  # fmt: skip
        logger.warning(_MERGED.format(name=self.dialect.name, hint=self._hint()))
        self.transport = None
        from transformers import AutoConfig

        self.shapes, self.tied = shapes, tied_outputs(AutoConfig.from_pretrained(self.checkpoint_dir))
        if not self.spec.is_initial_zero():
            self._load_initial(policy.transport)

    def _load_initial(self, transport) -> None:
        with self.fleet_lock.exclusive() as (version, handle):
            if handle is not None:  # a process sharing these servers loaded its weights already
                return
            weights = self.weights(self.spec.initial)
            items = list(weights.items()) if self.sync == "adapter" else weight_items(weights, self.shapes, self.tied)
            handle = transport.publish(items, version)
            import httpx  # the fleet's client

            try:
                self.fleet.run(_each(self._load(s, transport, handle) for s in self.fleet.up()))
            except (ValueError, httpx.HTTPStatusError) as err:  # vLLM answers 500 to an adapter it cannot load
                raise ValueError(f"{err}; the servers could not load the LoRA adapter: start them with "
                                 f"{self._hint()}, or {MERGE_FIX}") from err  # fmt: skip
            self.fleet_lock.write(version, handle)

    def _hint(self) -> str:
        """What the servers need to take this adapter (the dialect's hint, with the adapter's rank)."""
        return self.dialect.adapter_hint.format(rank=lora_rank(self.spec.config))

    async def _load(self, server, transport, handle: str) -> None:
        for path, body in transport.load_calls(handle):
            await load_call(self.fleet, server, path, body)
        if self.sync == "merged":  # the exclusive fleet lock is held: no wave runs on the servers
            await self.dialect.reset_cache(self.fleet, server)

    def weights(self, weights) -> dict[str, torch.Tensor]:
        """What an update sends: the adapter's tensors (servers that take adapters), else the merged full weights."""
        return update_tensors(weights, spec=self.spec, sync=self.sync, checkpoint_dir=self.checkpoint_dir)

    def name_requests(self, payloads: list, handle: str | None) -> None:
        """Make every request name the adapter ``handle`` (the one the servers hold; the dialect says how)."""
        if self.sync == "adapter" and handle is not None:
            name = handle.rstrip("/").rsplit("/", 1)[-1]
            for payload in payloads:
                self.dialect.name_adapter(payload, name)
