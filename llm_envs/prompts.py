"""Prompt sources: strings, chat messages, token ids, iterables or a ``datasets.Dataset``, tokenized once."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import StrEnum

import torch

from tokengym.llm_envs.errors import PromptError
from tokengym.llm_envs.image_inputs import ImageInputs, encode_with_images, image_token_id

__all__ = ["OverlongPrompts", "Prompt", "PromptSource"]

_PROMPT_FIELDS = ("prompt", "messages", "question", "input_ids")
_IMAGE_FIELDS = ("images", "image")  # a mapping's images: a list, or one image
_NO_TEMPLATE = ("is a chat message list but the tokenizer has no chat_template; set tokenizer.chat_template "
                "(a jinja template) or pass plain strings")  # fmt: skip


class OverlongPrompts(StrEnum):
    """What a prompt source does with a prompt longer than its limit (the env's ``max_length - 1``)."""

    ERROR = "error"  # raise PromptError naming the prompt (the prompt is skipped; iterating again goes on)
    SKIP = "skip"  # leave it out, counted (verl's ``filter_overlong_prompts``)
    TRUNCATE = "truncate"  # keep its last tokens, counted (TRL's ``max_prompt_length``, left truncation)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as a slot receives it.

    Attributes:
        ids: int64 token ids (1-D).
        text: the prompt text (after the chat template, if any).
        metadata: everything else the item carried (e.g. ``{"answer": "19"}``), for the reward function.
        index: position of the item in its source (stable across epochs).
        group_id: increasing id of this draw of the item; its ``group_size`` samples share it.
        sample_id: index of the sample within its group, ``0 .. group_size - 1``.
        messages: the chat messages of a chat prompt (before the template), else ``None``; a TRL
            reward function receives them as ``prompts``, as TRL passes a conversational dataset's.
        images: the prompt's images as its processor prepared them (a vision-language model's prompt), else
            ``None``; ``ids`` then hold each image's tokens.
    """

    ids: torch.Tensor
    text: str
    metadata: dict
    index: int
    group_id: int
    sample_id: int
    messages: list | None = None
    images: ImageInputs | None = None


class PromptSource:
    """Turns user prompts into :class:`Prompt` objects, ``group_size`` samples per prompt, in a seeded order.

    Items may be a string, a list of chat messages (``[{"role": ..., "content": ...}]``, the
    tokenizer's chat template is applied), a list or tensor of token ids, or a mapping with one of
    the fields ``prompt`` / ``messages`` / ``question`` / ``input_ids`` (the other fields become
    metadata). A sized source (list, ``datasets.Dataset``) is replayed for ``epochs`` epochs
    (``None``: forever), shuffled per epoch when ``shuffle``; any other iterable is read once.

    Args:
        prompts: the items.
        tokenizer: a transformers tokenizer.
        group_size: samples per prompt (GRPO's G; TRL's ``num_generations``, verl's ``rollout.n``).
        shuffle: shuffle a sized source each epoch with ``seed``.
        seed: seed of the shuffle.
        epochs: passes over a sized source; ``None`` repeats forever.
        chat_template_kwargs: extra arguments of ``tokenizer.apply_chat_template`` for chat prompts
            (e.g. ``{"enable_thinking": False}``).
        overlong: an :class:`OverlongPrompts` or its string: ``"error"`` (default), ``"skip"`` or
            ``"truncate"`` a prompt of more than ``max_prompt_length`` tokens (a TokenEnv caps the
            limit at its ``max_length - 1``). ``counts`` counts the skipped and truncated draws.
        max_prompt_length: the prompt token limit (``None``: only the env's).
        processor: a vision-language model's processor (``AutoProcessor.from_pretrained``): a mapping item's
            ``images`` (a list of PIL images, arrays or paths; ``image``: one) go through it with the rendered text,
            each placeholder expanded to its image's tokens (:func:`~tokengym.llm_envs.image_inputs.encode_with_images`);
            :attr:`Prompt.images` holds what it made of them. Its tokenizer must be ``tokenizer``'s vocabulary.

    Raises:
        ValueError: at construction, for chat prompts (judged by the first item of a list or
            dataset) and a tokenizer without a chat template.

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> src = PromptSource([{"prompt": "1+1=", "answer": "2"}], tiny_tokenizer(), group_size=2, epochs=1)
        >>> [(p.text, p.group_id, p.sample_id, p.metadata) for p in src]
        [('1+1=', 0, 0, {'answer': '2'}), ('1+1=', 0, 1, {'answer': '2'})]
    """

    def __init__(
        self,
        prompts: Iterable,
        tokenizer,
        *,
        group_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        epochs: int | None = None,
        chat_template_kwargs: dict | None = None,
        overlong: OverlongPrompts | str = OverlongPrompts.ERROR,
        max_prompt_length: int | None = None,
        processor=None,
    ) -> None:
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Iterable):
            raise TypeError(
                f"prompts must be an iterable of prompts (a list of strings, say), got {type(prompts).__name__}"
            )
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size must be a positive int (samples per prompt), got {group_size!r}")
        if epochs is not None and (not isinstance(epochs, int) or epochs <= 0):
            raise ValueError(f"epochs must be a positive int or None (repeat forever), got {epochs!r}")
        self.is_sized = hasattr(prompts, "__len__") and hasattr(prompts, "__getitem__")
        if self.is_sized and len(prompts) == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        self.prompts, self.tokenizer, self.group_size = prompts, tokenizer, group_size
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.overlong = _overlong(overlong)
        if max_prompt_length is not None and (isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int)
                                              or max_prompt_length <= 0):  # fmt: skip
            raise ValueError(f"max_prompt_length must be a positive int or None, got {max_prompt_length!r}")
        self.max_prompt_length = max_prompt_length
        self.counts = {"prompts_skipped_overlong": 0, "prompts_truncated": 0}
        self.processor = _check_processor(processor, tokenizer)
        if self.is_sized:  # what applies to every prompt fails here, not at every refill
            _check_chat_template(prompts[0], tokenizer)
        self._iter: Iterator | None = None if self.is_sized else iter(prompts)
        self._epoch, self._pos, self._sample, self._group = 0, 0, 0, 0
        self._order: list[int] | None = None
        self._current: tuple | None = None  # (index, ids, text, metadata, messages, images)
        self.is_exhausted = False
        self.shard_index, self.num_shards = 0, 1

    # -- order and state --
    def _epoch_order(self) -> list[int]:
        n = len(self.prompts)
        if not self.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self._epoch)
        return torch.randperm(n, generator=gen).tolist()

    def _next_item(self) -> tuple[int, object] | None:
        if not self.is_sized:
            try:
                item = next(self._iter)
            except StopIteration:
                return None
            self._pos += 1
            return self._pos - 1, item
        if self._pos >= len(self.prompts):
            self._epoch, self._pos, self._order = self._epoch + 1, 0, None
        if self.epochs is not None and self._epoch >= self.epochs:
            return None
        if self._order is None:
            self._order = self._epoch_order()
        index = self._order[self._pos]
        self._pos += 1
        return index, self.prompts[index]

    def __iter__(self) -> Iterator[Prompt]:
        while (prompt := self.next()) is not None:
            yield prompt

    def cap_prompt_length(self, limit: int) -> None:
        """Lower the prompt token limit to ``limit`` (a TokenEnv passes ``max_length - 1``)."""
        self.max_prompt_length = limit if self.max_prompt_length is None else min(self.max_prompt_length, limit)

    def next(self) -> Prompt | None:
        """The next prompt sample, or ``None`` once the source is exhausted.

        Raises:
            PromptError: for a prompt that cannot be encoded or is over-long under ``overlong="error"``;
                the source has moved past it (the next call gives the next prompt).
        """
        while self._current is None or self._sample >= self.group_size:
            nxt = self._next_item()
            while nxt is not None and self._group % self.num_shards != self.shard_index:
                self._group += 1  # another shard's group: skipped unencoded, its id stays that shard's
                nxt = self._next_item()
            if nxt is None:
                self.is_exhausted = True
                return None
            index, item = nxt
            self._current, self._sample = None, 0
            self._group += 1  # consumed even when the item is left out: shards stay in step
            encoded = self._within_limit(index, *self._encode_cached(item, index))
            if encoded is not None:
                self._current = (index, *encoded)
        index, ids, text, meta, messages, images = self._current
        self._sample += 1
        return Prompt(ids, text, meta, index, self._group - 1, self._sample - 1, messages, images)

    def end_group(self) -> None:
        """The group being drawn gives no more samples: the next draw is the next prompt's first sample (a tree
        samples its prompt once, as its root; its other samples are branches forked from it)."""
        if self._current is not None:
            self._sample = self.group_size

    @property
    def group_in_progress(self) -> int | None:
        """The id of the group being drawn while it has samples still to give (``None`` when there is none): a
        collector keeps that group's finished samples waiting rather than dropping them."""
        return self._group - 1 if self._group and self._sample < self.group_size else None

    def shard(self, index: int, num_shards: int) -> PromptSource:
        """Keep only the groups whose id ``g`` has ``g % num_shards == index`` (in place; returns ``self``).

        Group ids stay those of the unsharded source and all ``group_size`` samples of a group go to one
        shard, so ``num_shards`` sources built alike and sharded ``0 .. num_shards - 1`` split the prompt
        stream exactly (one shard per Ray worker, say). Other shards' items are skipped without being
        encoded. Call it before the first draw.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> src = PromptSource(["a", "b", "c"], tiny_tokenizer(), group_size=2, epochs=1).shard(1, 2)
            >>> [(p.text, p.group_id, p.sample_id) for p in src]
            [('b', 1, 0), ('b', 1, 1)]
        """
        for name, value in (("index", index), ("num_shards", num_shards)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"shard {name} must be an int, got {value!r}")
        if num_shards <= 0 or not 0 <= index < num_shards:
            raise ValueError(f"shard needs num_shards >= 1 and 0 <= index < num_shards, got index={index}, "
                             f"num_shards={num_shards}")  # fmt: skip
        if self._group or self._current is not None:
            raise ValueError(f"shard() must come before the first draw; this source has drawn {self._group} groups")
        self.shard_index, self.num_shards = index, num_shards
        return self

    def _within_limit(self, index: int, ids: torch.Tensor, text: str, meta: dict, messages, images):
        """The encoded item under the over-long policy: as is, truncated, ``None`` (skipped), or PromptError."""
        limit = self.max_prompt_length
        if limit is None or ids.numel() <= limit:
            return ids, text, meta, messages, images
        if self.overlong is OverlongPrompts.SKIP:
            self.counts["prompts_skipped_overlong"] += 1
            return None
        if images is not None:  # truncating would cut image tokens off their pixels
            image_tokens = int((ids == image_token_id(self.processor)).sum())
            raise PromptError(
                f"prompt {index} {text[:60]!r} has {ids.numel()} tokens, {image_tokens} of them for its "
                f"{images.num_images} image(s) ({images.image_grid_thw.tolist()} patch grids), more than the {limit} a "
                "prompt may have (the env's max_length - 1): give smaller images (the processor's max_pixels), raise "
                "max_length, or pass overlong_prompts='skip' (an image prompt is never truncated)"
            )
        if self.overlong is OverlongPrompts.TRUNCATE:
            self.counts["prompts_truncated"] += 1
            ids = ids[-limit:]
            return ids, self.tokenizer.decode(ids), meta, messages, images
        raise PromptError(
            f"prompt {index} {text[:60]!r} has {ids.numel()} tokens, more than the {limit} a prompt may have "
            "(the env's max_length - 1, or max_prompt_length); raise max_length, or pass overlong_prompts='skip' "
            "(left out and counted, as verl's filter_overlong_prompts) or 'truncate' (keeps its last tokens, as "
            "TRL's max_prompt_length)"
        )

    def rewind(self, seed: int) -> None:
        """Start over from the first draw of the ``seed`` order: the cursor goes back to the start and the
        shuffle is reseeded with ``seed`` (an iterable is read again from its start; ``counts`` stay).

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> src = PromptSource(["a", "b", "c"], tiny_tokenizer(), shuffle=True)
            >>> first = [src.next().text for _ in range(2)]
            >>> src.rewind(0)
            >>> [src.next().text for _ in range(2)] == first
            True
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"rewind needs an int seed, got {seed!r}")
        self.seed = seed
        self.load_state_dict({"epoch": 0, "pos": 0, "sample": 0, "group": 0})

    FINGERPRINT_SCHEME = "blake2b-every-prompt"
    """The ``scheme`` of :meth:`fingerprint` (a checkpoint whose fingerprint has no ``scheme`` sampled 16 prompts)."""

    def fingerprint(self) -> dict | None:
        """What identifies a sized source's prompts: their ``count``, a ``digest`` of every one of them and the first
        one's text; ``None`` for an iterable (read once, possibly endless: it cannot be hashed ahead, and a checkpoint
        over it is not checked). Computed once; a collector checkpoint carries it.

        The digest is a blake2b hash streamed over every item as given (a text, chat messages, token ids, a mapping
        with its metadata), in order, without tokenizing them (a million short prompts take seconds), plus the token
        ids of the first one (another tokenizer or chat template shows too). Two sources differing in any one prompt
        have different digests.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> fp = PromptSource(["1+1=", "2+2="], tiny_tokenizer()).fingerprint()
            >>> fp["count"], fp["first"], len(fp["digest"]), fp["scheme"]
            (2, '1+1=', 16, 'blake2b-every-prompt')
        """
        if not self.is_sized:
            return None
        if "_fingerprint" not in self.__dict__:
            n = len(self.prompts)
            digest = hashlib.blake2b(str(n).encode(), digest_size=8)
            for item in itertools.islice(self.prompts, n):  # iterated: a datasets.Dataset reads its rows in chunks
                data = _item_bytes(item)
                digest.update(len(data).to_bytes(8, "little") + data)
            try:
                ids, text = self._encode_item(self.prompts[0], 0)[:2]
            except (KeyError, TypeError, ValueError):  # a bad item fails at its draw, not at a checkpoint
                ids, text = torch.tensor([-1]), ""
            digest.update(ids.to(torch.int64).numpy().tobytes())
            self.__dict__["_fingerprint"] = {"count": n, "digest": digest.hexdigest(), "first": text[:40],
                                             "scheme": self.FINGERPRINT_SCHEME}  # fmt: skip
        return dict(self.__dict__["_fingerprint"])

    def state_dict(self) -> dict:
        """Cursor of the source; restoring it replays the same prompts (iterables are re-read and skipped)."""
        return {"epoch": self._epoch, "pos": self._pos, "sample": self._sample, "group": self._group,
                "counts": dict(self.counts)}  # fmt: skip

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a cursor from :meth:`state_dict`."""
        self._epoch, self._sample, self._group = state["epoch"], state["sample"], state["group"]
        self.counts.update(state.get("counts", {}))
        self._order, self._current, self.is_exhausted = None, None, False
        if self.is_sized:
            self._pos = state["pos"]
            if self._sample:  # re-encode the group in progress
                self._pos -= 1
                index, item = self._next_item()
                self._current = (index, *self._resumed(item, index))
            return
        self._iter, self._pos = iter(self.prompts), 0
        for _ in range(state["pos"] - (1 if self._sample else 0)):
            self._next_item()
        if self._sample:
            index, item = self._next_item()
            self._current = (index, *self._resumed(item, index))

    def _resumed(self, item, index: int) -> tuple:
        """The group in progress at a checkpoint, encoded again (it was within the limit, or truncated)."""
        counts = dict(self.counts)
        encoded = self._within_limit(index, *self._encode_item(item, index))
        self.counts = counts  # counted when it was first drawn
        return encoded

    # -- encoding --
    _CACHE_SIZE = 65_536

    def _encode_cached(self, item, index: int) -> tuple:
        """Encode a sized source's item once across epochs (bounded cache); iterables every time."""
        if not self.is_sized:
            return self._encode_item(item, index)
        cache = self.__dict__.setdefault("_cache", {})
        if index not in cache:
            self._encode_ahead(cache)
            if index not in cache:
                while len(cache) >= self._CACHE_SIZE:
                    cache.pop(next(iter(cache)))
                cache[index] = self._encode_item(item, index)
        return cache[index]

    _LOOKAHEAD = 256

    def _encode_ahead(self, cache: dict) -> None:
        """Encode the text prompts this shard draws next in this epoch's order with one batched tokenizer call
        (a tokenizer call per prompt costs ~100 µs; a batch of them a few µs each). Items that are not plain
        text, or not well formed, are left to :meth:`_encode_item` when drawn (their errors surface then)."""
        start = self._pos - 1  # the item being drawn; its group is self._group - 1
        indices, texts, metas = [], [], []
        for k, i in enumerate(self._order[start : start + self._LOOKAHEAD]):
            if i in cache or (self._group - 1 + k) % self.num_shards != self.shard_index:
                continue
            item, meta = self.prompts[i], {}
            if isinstance(item, Mapping):
                field = next((f for f in _PROMPT_FIELDS if f in item), None)
                if field is None or any(f in item for f in _IMAGE_FIELDS):
                    continue
                meta, item = {key: v for key, v in item.items() if key != field}, item[field]
            if isinstance(item, str) and item:
                indices.append(i), texts.append(item), metas.append(meta)
        if len(texts) < 2:
            return
        while len(cache) + len(texts) > self._CACHE_SIZE and cache:
            cache.pop(next(iter(cache)))
        rows = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        for i, text, meta, row in zip(indices, texts, metas, rows, strict=True):
            if row:
                cache[i] = (torch.tensor(row, dtype=torch.int64), text, meta, None, None)

    def encode(self, item, index: int) -> tuple[torch.Tensor, str, dict]:
        """Token ids, text and metadata of one item; raises ``ValueError`` for an empty prompt."""
        return self._encode_item(item, index)[:3]

    def encode_with_images(self, item, index: int) -> tuple[torch.Tensor, ImageInputs | None]:
        """Token ids of one item (its image placeholders expanded) and its images' inputs (``None`` without)."""
        encoded = self._encode_item(item, index)
        return encoded[0], encoded[4]

    def _encode_item(self, item, index: int) -> tuple:
        """:meth:`encode` plus the chat messages of a chat prompt and the prompt's image inputs (``None`` for a
        prompt without)."""
        meta: dict = {}
        images = None
        if isinstance(item, Mapping):
            field = next((f for f in _PROMPT_FIELDS if f in item), None)
            if field is None:
                raise KeyError(
                    f"prompt item {index} is a mapping without a prompt field: it has keys "
                    f"{sorted(item)}; give one of {_PROMPT_FIELDS}"
                )
            meta = {k: v for k, v in item.items() if k != field and k not in _IMAGE_FIELDS}
            images = _item_images(item, index)
            item = item[field]
        ids, text = self._tokenize(item, index)
        if images is not None:
            if self.processor is None:
                raise ValueError(f"prompt item {index} carries {len(images)} image(s) but the prompt source has no "
                                 "processor: pass processor= (the vision-language model's AutoProcessor) to the env "
                                 "or PromptSource, with a vision-language model")  # fmt: skip
            if not isinstance(item, str) and _chat_messages(item) is None:
                raise TypeError(f"prompt item {index} gives images with token ids: give its text (with one image "
                                "placeholder per image) or chat messages with {'type': 'image'} items")  # fmt: skip
            ids, images = encode_with_images(self.processor, text, images, index=index)
        if ids.numel() == 0:
            raise ValueError(f"prompt item {index} is empty ({item!r}): every prompt needs at least one token")
        return ids, text, meta, _chat_messages(item), images

    def _tokenize(self, item, index: int) -> tuple[torch.Tensor, str]:
        tok = self.tokenizer
        if isinstance(item, str):
            ids = tok(item, add_special_tokens=False)["input_ids"]
            return torch.tensor(ids, dtype=torch.int64), item
        if isinstance(item, torch.Tensor):
            item = item.reshape(-1).tolist()
        if isinstance(item, Sequence) and all(isinstance(m, Mapping) for m in item) and len(item):
            if getattr(tok, "chat_template", None) is None:
                raise ValueError(f"prompt item {index} {_NO_TEMPLATE}")
            text = tok.apply_chat_template(list(item), tokenize=False, add_generation_prompt=True,
                                           **self.chat_template_kwargs)  # fmt: skip
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return torch.tensor(ids, dtype=torch.int64), text
        if isinstance(item, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            bad = [t for t in item if not 0 <= t < len(tok)]
            if bad:  # decoding them would fail deep inside the tokenizer
                raise ValueError(f"prompt item {index} holds token id {bad[0]}, outside the vocabulary [0, {len(tok)}); "
                                 "encode it with the env's tokenizer")  # fmt: skip
            ids = torch.tensor(list(item), dtype=torch.int64)
            return ids, tok.decode(ids) if len(ids) else ""
        raise TypeError(
            f"prompt item {index} has type {type(item).__name__} ({item!r:.60}); expected a string, "
            "a list of chat messages, a list of token ids or a mapping with a 'prompt' field"
        )


def _chat_messages(item) -> list | None:
    """``item`` as a list of message dicts if it is a chat prompt, else ``None``."""
    if isinstance(item, Sequence) and not isinstance(item, str) and len(item) and all(isinstance(m, Mapping) for m in item):
        return [dict(m) for m in item]
    return None


def _item_images(item: Mapping, index: int) -> list | None:
    """The images of a mapping item (its ``images`` list or its one ``image``), ``None`` when it has none."""
    if "images" in item:
        images = item["images"]
        if images is None:
            return None
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise TypeError(f"prompt item {index}: 'images' must be a list of images (PIL images, arrays or paths), "
                            f"got {type(images).__name__}; one image goes in 'image'")  # fmt: skip
        return list(images) or None
    if "image" in item and item["image"] is not None:
        return [item["image"]]
    return None


def _check_processor(processor, tokenizer):
    """``processor`` if it can render images for ``tokenizer``'s ids; ``None`` stays ``None``."""
    if processor is None:
        return None
    inner = getattr(processor, "tokenizer", None)
    if inner is None or getattr(processor, "image_token", None) is None:
        raise TypeError(f"processor must be a vision-language model's processor (a tokenizer and an image token), "
                        f"got {type(processor).__name__}")  # fmt: skip
    if len(inner) != len(tokenizer) or inner.convert_tokens_to_ids(processor.image_token) != tokenizer.convert_tokens_to_ids(
            processor.image_token):  # fmt: skip
        raise ValueError(f"the processor's tokenizer ({len(inner)} tokens) is not the env's tokenizer ({len(tokenizer)} "
                         "tokens, or another image token id): load both from the same model directory")  # fmt: skip
    return processor


def _overlong(value) -> OverlongPrompts:
    try:
        return OverlongPrompts(value)
    except ValueError:
        raise ValueError(f"overlong_prompts must be one of {[e.value for e in OverlongPrompts]}, got {value!r}") from None


def _check_chat_template(first, tokenizer) -> None:
    """Chat prompts need a chat template: checked once on the first item of a sized source."""
    if isinstance(first, Mapping):
        first = next((first[f] for f in _PROMPT_FIELDS if f in first), None)
    if _chat_messages(first) is not None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the prompts are chat message lists (the first: {first!r:.60}) but the tokenizer "
                         f"{type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template (a jinja "
                         "template) or pass plain strings")  # fmt: skip


def _item_bytes(item) -> bytes:
    """One prompt item as bytes for the fingerprint: a text, a tensor's dtype and values, else its JSON (mappings
    with sorted keys; tensors and numpy values as lists), else its ``repr``."""
    if isinstance(item, str):
        return b"s" + item.encode("utf-8", "surrogatepass")
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().reshape(-1).contiguous()
        return b"t" + str(item.dtype).encode() + item.view(torch.uint8).numpy().tobytes()
    try:
        text = json.dumps(item, sort_keys=True, ensure_ascii=False, default=_plain)
    except (TypeError, ValueError):  # keys that do not sort, say
        return b"r" + repr(item).encode("utf-8", "surrogatepass")
    return b"j" + text.encode("utf-8", "surrogatepass")


def _plain(value):
    """A JSON-able stand-in for a value ``json`` does not know: a tensor's or numpy value's list, an image's
    pixels' hash, else its repr."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if callable(getattr(value, "tobytes", None)) and hasattr(value, "mode") and hasattr(value, "size"):  # PIL
        return [value.mode, list(value.size), hashlib.blake2b(value.tobytes(), digest_size=8).hexdigest()]
    return repr(value)
