"""The prompt ids of a collected batch (and a vision-language prompt's images), stored once per group, not per step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from tokengym.llm_envs.image_inputs import ImageInputs

__all__ = ["PromptTable"]


class PromptTable:
    """Maps a group id to the token ids of its prompt (1-D int64), plus its text, metadata and images (a
    vision-language model's prompt: the :class:`~tokengym.llm_envs.image_inputs.ImageInputs` its processor made, kept
    once per group; the actors pass them to the model beside each trajectory's tokens).

    A collected batch carries one under ``keys.PROMPTS`` (as non-tensor data) holding the prompts
    of the trajectories in that batch, so the full sequence of a trajectory is
    ``cat(table.ids(group_id), response actions)`` and is never stored per step.

    Args:
        pad_token_id: the env tokenizer's pad token id (a tokengym collector records it), the
            default padding of the layouts built from the batch (``to_padded``, ``SequenceActor``...).
        sampling: the sampling settings of the policy that produced the batch (a tokengym collector records
            its ``SamplingConfig``), kept as a plain dict (``sampling``) of ``temperature``, ``top_k``,
            ``top_p``, ``greedy`` and ``banned_token_ids``; the sequence actors score with them or refuse a
            mismatch. ``None``: not recorded.

    Example:
        >>> table = PromptTable(pad_token_id=0)
        >>> table.add(7, torch.tensor([5, 6, 7]), text="hi", metadata={"answer": "3"})
        >>> tokens, lengths = table.left_padded(torch.tensor([7, 7]), pad_id=0)
        >>> tokens.tolist(), lengths.tolist()
        ([[5, 6, 7], [5, 6, 7]], [3, 3])
    """

    def __init__(self, *, pad_token_id: int | None = None, sampling=None) -> None:
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
            raise TypeError(f"pad_token_id must be an int (tokenizer.pad_token_id) or None, got {pad_token_id!r}")
        self.pad_token_id = pad_token_id
        self.sampling: dict | None = _sampling_record(sampling)
        self._ids: dict[int, torch.Tensor] = {}
        self._text: dict[int, str] = {}
        self._meta: dict[int, dict] = {}
        self._sequences: dict[int, torch.Tensor] = {}  # multi-turn: full token ids by trajectory id
        self._own: dict[int, torch.Tensor] = {}  # trajectories whose prompt is not their group's (an episode's later part)
        self._images: dict[int, ImageInputs] = {}  # groups whose prompt has images
        self._traj_images: dict[int, ImageInputs] = {}  # multi-turn trajectories whose feedback showed images

    def add(self, group_id: int, ids: torch.Tensor, *, text: str = "", metadata: dict | None = None,
            images: ImageInputs | None = None) -> None:  # fmt: skip
        """Record the prompt of ``group_id`` (later calls for the same id are ignored)."""
        gid = int(group_id)
        if gid not in self._ids:
            if images is not None and not isinstance(images, ImageInputs):
                raise TypeError(f"images must be ImageInputs (a Prompt's images) or None, got {type(images).__name__}")
            self._ids[gid] = ids
            self._text[gid] = text
            self._meta[gid] = metadata or {}
            if images is not None:
                self._images[gid] = images

    def add_sequence(self, traj_id: int, ids: torch.Tensor) -> None:
        """Record the full token ids (prompt, turns, env feedback) of a finished multi-turn trajectory."""
        self._sequences[int(traj_id)] = ids

    def sequence(self, traj_id: int) -> torch.Tensor:
        """Full token ids of multi-turn trajectory ``traj_id`` (see :meth:`add_sequence`)."""
        return self._lookup(traj_id, self._sequences)

    def add_trajectory_prompt(self, traj_id: int, ids: torch.Tensor) -> None:
        """Record the prompt of a trajectory that does not start with its group's prompt (the later part of an
        episode split in several trajectories); layouts then use it for that trajectory."""
        self._own[int(traj_id)] = ids

    def trajectory_prompt(self, traj_id: int) -> torch.Tensor | None:
        """The prompt of ``traj_id`` when it has its own (see :meth:`add_trajectory_prompt`), else ``None``."""
        return self._own.get(int(traj_id))

    def own_prompt_trajs(self) -> list[int]:
        """Trajectory ids with a prompt of their own."""
        return list(self._own)

    def traj_ids(self) -> list[int]:
        """Trajectory ids with a full sequence recorded."""
        return list(self._sequences)

    def __contains__(self, group_id: int) -> bool:
        return int(group_id) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def group_ids(self) -> list[int]:
        """The group ids held, in insertion order."""
        return list(self._ids)

    def _lookup(self, key: int, store: dict):
        if int(key) not in store:
            what = ("trajectory", "sequences") if store is self._sequences else ("group", "groups")
            raise KeyError(f"{what[0]} id {int(key)} is not in this PromptTable (it holds {len(store)} {what[1]})")
        return store[int(key)]

    def ids(self, group_id: int) -> torch.Tensor:
        """Token ids of the prompt of ``group_id``."""
        return self._lookup(group_id, self._ids)

    def text(self, group_id: int) -> str:
        """Text of the prompt of ``group_id`` (after the chat template, if any)."""
        return self._lookup(group_id, self._text)

    def metadata(self, group_id: int) -> dict:
        """Metadata of the prompt of ``group_id`` (e.g. the reference answer)."""
        return self._lookup(group_id, self._meta)

    def images(self, group_id: int) -> ImageInputs | None:
        """The images of the prompt of ``group_id`` (``None``: a prompt without images)."""
        self._lookup(group_id, self._ids)
        return self._images.get(int(group_id))

    def add_trajectory_images(self, traj_id: int, images: ImageInputs) -> None:
        """Record every image of a multi-turn trajectory whose feedback showed images (its prompt's first)."""
        if not isinstance(images, ImageInputs):
            raise TypeError(f"images must be ImageInputs, got {type(images).__name__}")
        self._traj_images[int(traj_id)] = images

    def image_trajs(self) -> list[int]:
        """Trajectory ids with images of their own recorded (:meth:`add_trajectory_images`)."""
        return list(self._traj_images)

    def trajectory_images(self, traj_id: int, group_id: int) -> ImageInputs | None:
        """The images of trajectory ``traj_id`` of group ``group_id``, in the order their tokens appear: those
        recorded for the trajectory (its feedback showed images), else its prompt's."""
        held = self._traj_images.get(int(traj_id))
        return held if held is not None else self.images(group_id)

    @property
    def has_images(self) -> bool:
        """Whether any prompt (or trajectory) held has images."""
        return bool(self._images) or bool(self._traj_images)

    def subset(self, group_ids, traj_ids=None) -> PromptTable:
        """A new table with only ``group_ids`` and the sequences of ``traj_ids`` held (shares the tensors)."""
        out = PromptTable(pad_token_id=self.pad_token_id, sampling=self.sampling)
        for gid in dict.fromkeys(int(g) for g in torch.as_tensor(group_ids).reshape(-1).tolist()):
            out.add(gid, self.ids(gid), text=self.text(gid), metadata=self.metadata(gid), images=self.images(gid))
        if traj_ids is not None:
            for tid in dict.fromkeys(int(t) for t in torch.as_tensor(traj_ids).reshape(-1).tolist()):
                if tid in self._sequences:
                    out.add_sequence(tid, self._sequences[tid])
                if tid in self._own:
                    out.add_trajectory_prompt(tid, self._own[tid])
                if tid in self._traj_images:
                    out.add_trajectory_images(tid, self._traj_images[tid])
        return out

    def merge(self, other: PromptTable) -> PromptTable:
        """Add every prompt of ``other`` to this table and return it (a table without a pad id or sampling settings
        takes ``other``'s); a ``ValueError`` if both record sampling settings and they differ (the merged batch
        would have no one sampling distribution to score)."""
        if self.pad_token_id is None:
            self.pad_token_id = other.pad_token_id
        if self.sampling is None:
            self.sampling = other.sampling
        elif other.sampling is not None and other.sampling != self.sampling:
            raise ValueError(f"cannot merge prompt tables of batches sampled with different settings, {self.sampling} "
                             f"and {other.sampling}: train on the batches of each setting apart")  # fmt: skip
        for gid in other.group_ids():
            self.add(gid, other.ids(gid), text=other.text(gid), metadata=other.metadata(gid), images=other.images(gid))
        for tid in other.traj_ids():
            self._sequences[tid] = other.sequence(tid)
        self._own.update(other._own)
        self._traj_images.update(other._traj_images)
        return self

    def left_padded(self, group_ids: torch.Tensor, *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts of ``group_ids`` (N,) left-padded to (N, P) with ``pad_id``, and their lengths (N,)."""
        group_ids = torch.as_tensor(group_ids).reshape(-1)
        rows = [self.ids(g) for g in group_ids.tolist()]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        width = int(lengths.max()) if len(rows) else 0
        out = torch.full((len(rows), width), pad_id, dtype=torch.int64)
        for i, row in enumerate(rows):  # one copy per sequence, never per step
            if len(row):
                out[i, width - len(row) :] = row
        return out, lengths

    def state_dict(self) -> dict:
        """The table as tensors, strings, lists and dicts (``torch.load(weights_only=True)`` reads it)."""
        groups = list(self._ids)
        sampling = self.sampling and {**self.sampling, "banned_token_ids": list(self.sampling["banned_token_ids"])}
        return {"groups": groups, "ids": [self._ids[g] for g in groups], "text": [self._text[g] for g in groups],
                "metadata": [self._meta[g] for g in groups], "sequences": dict(self._sequences),
                "own_prompts": dict(self._own), "pad_token_id": self.pad_token_id, "sampling": sampling,
                "images": {g: x.state_dict() for g, x in self._images.items()},
                "trajectory_images": {t: x.state_dict() for t, x in self._traj_images.items()}}  # fmt: skip

    @classmethod
    def from_state_dict(cls, state: dict) -> PromptTable:
        """Rebuild a table saved by :meth:`state_dict`."""
        out = cls(pad_token_id=state.get("pad_token_id"), sampling=state.get("sampling"))
        images = {int(g): ImageInputs.from_state_dict(x) for g, x in state.get("images", {}).items()}
        for gid, ids, text, meta in zip(state["groups"], state["ids"], state["text"], state["metadata"], strict=True):
            out.add(gid, ids, text=text, metadata=meta, images=images.get(int(gid)))
        for tid, ids in state["sequences"].items():
            out.add_sequence(tid, ids)
        for tid, ids in state.get("own_prompts", {}).items():
            out.add_trajectory_prompt(tid, ids)
        for tid, images in state.get("trajectory_images", {}).items():
            out.add_trajectory_images(tid, ImageInputs.from_state_dict(images))
        return out

    def __repr__(self) -> str:
        return f"PromptTable(groups={len(self)}, pad_token_id={self.pad_token_id})"


_SAMPLING_FIELDS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "greedy": False, "banned_token_ids": ()}


def _sampling_record(sampling) -> dict | None:
    """The plain dict a :class:`PromptTable` keeps of a policy's sampling settings: a ``SamplingConfig`` (any
    dataclass with its fields) or a mapping of its fields; missing fields take ``SamplingConfig``'s defaults.

    Example:
        >>> _sampling_record({"temperature": 0.7, "banned_token_ids": [3]})
        {'temperature': 0.7, 'top_k': 0, 'top_p': 1.0, 'greedy': False, 'banned_token_ids': (3,)}
    """
    if sampling is None:
        return None
    if dataclasses.is_dataclass(sampling) and not isinstance(sampling, type):
        sampling = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)}
    if not isinstance(sampling, Mapping):
        raise TypeError(f"sampling must be a SamplingConfig, a mapping of its fields or None, got {type(sampling).__name__}")
    unknown = sorted(set(sampling) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"unknown sampling fields {unknown}; a SamplingConfig has {list(_SAMPLING_FIELDS)}")
    record = {**_SAMPLING_FIELDS, **sampling}
    record["banned_token_ids"] = tuple(int(i) for i in record["banned_token_ids"])
    return record
