"""reasoning-gym tasks: prompts from any dataset or weighted mix, rewarded by the dataset's own ``score_answer``.

``pip install 'tokengym[reasoning-gym]'``. Each prompt carries its reasoning-gym entry in the metadata
(``metadata["entry"]``), so the reward scores a response with ``score_answer(answer, entry)`` of the
dataset that generated it; the answer is the text of the last ``<answer>...</answer>`` (reasoning-gym's
own format and extractor), a response without one scores 0. ``split="train"`` / ``split="held_out"`` with
``split_seed`` give two envs over disjoint problems; ``epochs=1`` a source that ends, for ``evaluate()``.

Example:
    >>> from tokengym.testing import tiny_tokenizer
    >>> env = make_reasoning_gym_env("chain_sum", tokenizer=tiny_tokenizer(), size=8, batch_size=2)
    >>> _ = env.reset()
    >>> entry = env.slot_prompt(0).metadata["entry"]
    >>> reward = ReasoningGymReward("chain_sum", size=8)
    >>> reward([f"<answer>{entry['answer']}</answer>", entry["answer"]], ["", ""], [{"entry": entry}] * 2)
    tensor([1., 0.])
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence

import torch

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.adapters._kwargs import check_kwargs, keyword_options
from tokengym.llm_envs.adapters._lazy import require
from tokengym.llm_envs.gym_adapter import GymTokenEnv
from tokengym.llm_envs.prompts import PromptSource
from tokengym.llm_envs.reward_errors import RewardErrors
from tokengym.llm_envs.token_env import TokenEnv

__all__ = ["ReasoningGymReward", "ReasoningGymSpec", "held_out_split", "make_reasoning_gym_env", "reasoning_gym_prompts",
           "gym_env"]

_EXTRA = "reasoning-gym"
ENTRY = "entry"  # prompt-metadata field holding the reasoning-gym entry (question, answer, metadata)
ANSWER = "answer"
# a short instruction in reasoning-gym's answer format (its own "default" system prompt is ~90 words)
SHORT_SYSTEM_PROMPT = "Answer inside <answer></answer>."
SPLITS = ("train", "held_out")  # the sides of a held-out split


@dataclasses.dataclass(frozen=True)
class ReasoningGymSpec:
    """Which reasoning-gym data: one dataset (``name`` + ``config``) or a weighted mix, plus size and seed.

    Attributes:
        datasets: ``((name, weight, config), ...)``; one entry is a single dataset, more are a mix
            (reasoning-gym's ``composite`` dataset, entries drawn by weight).
        size: number of entries.
        seed: seed of the generator (the same spec gives the same entries).
    """

    datasets: tuple[tuple[str, float, dict], ...]
    size: int = 500
    seed: int = 0

    @classmethod
    def parse(cls, dataset, *, config: Mapping | None = None, size: int = 500, seed: int = 0) -> ReasoningGymSpec:
        """A spec from a name (``"chain_sum"``), names (an equal mix), ``{name: weight}``, or
        ``[{"name": ..., "weight": ..., "config": {...}}, ...]``; ``config`` goes with a single name."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int (entries to generate), got {size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if isinstance(dataset, str):
            items = [(dataset, 1.0, dict(config or {}))]
        elif config is not None:
            raise ValueError("config= goes with a single dataset name; give a mix as [{'name', 'weight', 'config'}]")
        elif isinstance(dataset, Mapping):
            items = [(name, float(weight), {}) for name, weight in dataset.items()]
        elif isinstance(dataset, Sequence) and dataset:
            items = [_mix_item(item) for item in dataset]
        else:
            raise TypeError(f"dataset must be a name, a list of names or specs, or {{name: weight}}, got {dataset!r}")
        for name, weight, cfg in items:
            _check_name(name)
            if not weight > 0:
                raise ValueError(f"weight of {name!r} must be > 0, got {weight!r}")
            if not isinstance(cfg, Mapping):
                raise TypeError(f"config of {name!r} must be a dict of the dataset's options, got {cfg!r}")
        return cls(tuple(items), size, seed)

    def build(self):
        """The reasoning-gym dataset (``ProceduralDataset``); a bad config names the dataset's options."""
        rg = require("reasoning_gym", _EXTRA)
        if len(self.datasets) == 1:
            name, _, cfg = self.datasets[0]
            return _create(rg, name, dict(cfg), size=self.size, seed=self.seed)
        composite = require("reasoning_gym.composite", _EXTRA)
        for name, _, cfg in self.datasets:  # fail on a bad config here, naming its dataset
            _create(rg, name, dict(cfg), size=1, seed=self.seed)
        specs = [composite.DatasetSpec(name, weight, dict(cfg)) for name, weight, cfg in self.datasets]
        return rg.create_dataset("composite", size=self.size, seed=self.seed, datasets=specs)


def _mix_item(item) -> tuple[str, float, dict]:
    if isinstance(item, str):
        return item, 1.0, {}
    if isinstance(item, Mapping) and "name" in item:
        return item["name"], float(item.get("weight", 1.0)), dict(item.get("config") or {})
    raise TypeError(f"a mix item must be a name or {{'name': ..., 'weight': ..., 'config': {{...}}}}, got {item!r}")


def _check_name(name) -> None:
    factory = require("reasoning_gym.factory", _EXTRA)
    if name not in factory.DATASETS or name == "composite":
        available = sorted(n for n in factory.DATASETS if n != "composite")
        raise KeyError(f"reasoning-gym has no dataset {name!r}; available: {', '.join(available)}")


def _create(rg, name: str, cfg: dict, *, size: int, seed: int):
    factory = require("reasoning_gym.factory", _EXTRA)
    config_cls = factory.DATASETS[name][1]
    options = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed"))
    unknown = sorted(set(cfg) - set(options))
    if unknown:
        raise ValueError(f"reasoning-gym dataset {name!r} has no option(s) {unknown}; its options: {options}")
    try:
        return rg.create_dataset(name, size=size, seed=seed, **cfg)
    except (AssertionError, ValueError, TypeError) as err:  # reasoning-gym validates configs with asserts
        raise ValueError(f"reasoning-gym dataset {name!r} rejected config {cfg}: {err}; its options: {options}") from err


def reasoning_gym_prompts(spec: ReasoningGymSpec, *, system_prompt: str | None = SHORT_SYSTEM_PROMPT,
                          use_chat: bool = True) -> list[dict]:  # fmt: skip
    """One prompt item per entry: ``{"prompt": messages or text, "answer": ..., "entry": entry}``.

    Args:
        spec: the data.
        system_prompt: instruction placed before the question (a system message in chat form); ``None``:
            none. reasoning-gym's own prompts are in ``reasoning_gym.utils.SYSTEM_PROMPTS``.
        use_chat: chat messages (the tokenizer's template is applied) instead of plain text.
    """
    items = []
    for entry in spec.build():
        question = entry["question"]
        if use_chat:
            prompt = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
            prompt = [*prompt, {"role": "user", "content": question}]
        else:
            prompt = f"{system_prompt}\n{question}" if system_prompt else question
        items.append({"prompt": prompt, ANSWER: entry[ANSWER], ENTRY: entry})
    return items


class ReasoningGymReward:
    """``reward_fn`` scoring each response with its dataset's ``score_answer(answer, entry)``.

    The answer is the content of the response's last ``<answer_tag>...</answer_tag>``
    (``reasoning_gym.utils.extract_answer``); without one the reward is 0. The entry comes from
    ``metadata["entry"]``. Picklable (the dataset is rebuilt from its spec where it is first used).

    An answer that makes ``score_answer`` raise (some datasets do on answers a model can write:
    ``prime_factorization`` on any non-number, ``coin_flip`` and ``boxnet`` on ``1e999``) scores 0 and is
    counted in ``counts``; the first one of each dataset is logged under ``tokengym.rewards``.

    Args:
        dataset: as for :meth:`ReasoningGymSpec.parse` (or a :class:`ReasoningGymSpec`).
        config: options of a single dataset.
        size: entries of the spec (the same as the prompts').
        seed: seed of the spec.
        answer_tag: the tag around the answer.

    Attributes:
        counts: ``{"reward_errors": n}``, answers ``score_answer`` raised on (or gave a non-finite score);
            a :class:`TokenEnv` adds it to ``prompt_counts``, so it appears in the collector's metrics.
    """

    def __init__(self, dataset, *, config: Mapping | None = None, size: int = 500, seed: int = 0,
                 answer_tag: str = "answer") -> None:  # fmt: skip
        if isinstance(dataset, ReasoningGymSpec):
            self.spec = dataset
        else:
            self.spec = ReasoningGymSpec.parse(dataset, config=config, size=size, seed=seed)
        if not isinstance(answer_tag, str) or not answer_tag:
            raise ValueError(f"answer_tag must be a non-empty string, got {answer_tag!r}")
        self.answer_tag = answer_tag
        self._dataset = None
        self.errors = RewardErrors()  # the first error of each dataset is logged
        self.counts = self.errors.counts

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None}

    @property
    def dataset(self):
        """The reasoning-gym dataset whose ``score_answer`` rewards (built on first use)."""
        if self._dataset is None:
            self._dataset = self.spec.build()
        return self._dataset

    def extract(self, response: str) -> str | None:
        """The answer in ``response`` (``None`` without an answer tag)."""
        return require("reasoning_gym.utils", _EXTRA).extract_answer(response, tag_name=self.answer_tag)

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        out = torch.zeros(len(responses))
        for i, (response, meta) in enumerate(zip(responses, metadata, strict=True)):
            if ENTRY not in meta:
                raise KeyError(f"prompt {prompts[i][:60]!r} has no metadata[{ENTRY!r}] (its reasoning-gym entry); "
                               f"build the prompts with reasoning_gym_prompts(); metadata keys: {sorted(meta)}")  # fmt: skip
            answer = self.extract(response)
            if answer is not None:
                out[i] = self._score(answer, meta[ENTRY])
        return out

    def _score(self, answer: str, entry: dict) -> float:
        """``score_answer(answer, entry)`` of the dataset; 0 (counted in ``counts``) where it raises."""
        dataset = self.dataset  # built outside the try: a bad spec is the user's error
        try:
            value = float(dataset.score_answer(answer, entry) or 0.0)
            if not math.isfinite(value):
                raise ValueError(f"score_answer returned {value}")
        except Exception as err:  # a model's output never stops a run (DESIGN.md "Bad input")
            self.errors.record(self._dataset_name(entry), answer, err)
            return 0.0
        return value

    def _dataset_name(self, entry) -> str:
        meta = entry.get("metadata") if isinstance(entry, Mapping) else None
        source = meta.get("source_dataset") if isinstance(meta, Mapping) else None
        return str(source or "+".join(name for name, _, _ in self.spec.datasets))


_PASSED_ON = keyword_options(TokenEnv, exclude={"turns", "seed"})  # the reward is this dataset's; seed is above
_HINTS = {"num_episodes": "reasoning-gym problems are a list: epochs=1 serves each once, then the source ends",
          "held_out_fraction": "held_out=0.2 (a float) holds out a fraction"}  # fmt: skip


def held_out_split(items: Sequence[Mapping], *, held_out: int | float = 0.2,
                   seed: int = 0) -> tuple[list[Mapping], list[Mapping]]:  # fmt: skip
    """(training, held-out) problems: the distinct questions of ``items``, shuffled by ``seed``, the first ``held_out``
    of them held out.

    A question generated twice counts once (its first item is kept), so no question is on both sides; the split
    depends only on the set of questions and ``seed``: the same seed always gives the same two disjoint sets.

    Args:
        items: prompt items of :func:`reasoning_gym_prompts` (each with its reasoning-gym ``entry``).
        held_out: how many distinct questions are held out (an int), or which fraction of them (a float in (0, 1),
            rounded, at least 1).
        seed: seed of the shuffle.

    Raises:
        ValueError: a split that leaves one side empty.

    Example:
        >>> items = reasoning_gym_prompts(ReasoningGymSpec.parse("chain_sum", size=20, seed=0), use_chat=False)
        >>> train, held = held_out_split(items, held_out=5, seed=1)
        >>> len(held), {p["prompt"] for p in train} & {p["prompt"] for p in held}
        (5, set())
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"the seed of the split must be an int, got {seed!r}")
    distinct: dict[str, Mapping] = {}
    for item in items:
        distinct.setdefault(item[ENTRY]["question"], item)
    questions = sorted(distinct)  # the order of the items does not matter, only which questions there are
    random.Random(seed).shuffle(questions)
    n_held = _held_out_count(held_out, len(questions))
    return [distinct[q] for q in questions[n_held:]], [distinct[q] for q in questions[:n_held]]


def _held_out_count(held_out, n: int) -> int:
    if isinstance(held_out, bool) or not isinstance(held_out, int | float):
        raise TypeError(f"held_out must be an int (problems) or a float in (0, 1) (a fraction), got {held_out!r}")
    if isinstance(held_out, float):
        if not 0 < held_out < 1:
            raise ValueError(f"held_out={held_out!r}: a fraction must be in (0, 1); give an int for a count")
        count = max(1, round(n * held_out))
    else:
        count = held_out
    if not 1 <= count < n:
        raise ValueError(f"held_out={held_out!r} holds out {count} of the {n} distinct problems; leave at least one on "
                         "each side (a larger size= gives more problems)")  # fmt: skip
    return count


def make_reasoning_gym_env(
    dataset="chain_sum",
    *,
    tokenizer,
    config: Mapping | None = None,
    size: int = 500,
    seed: int = 0,
    system_prompt: str | None = SHORT_SYSTEM_PROMPT,
    epochs: int | None = None,
    split: str | None = None,
    held_out: int | float | None = None,
    split_seed: int | None = None,
    **env_kwargs,
) -> TokenEnv:
    """A :class:`TokenEnv` over a reasoning-gym dataset or mix, rewarded by :class:`ReasoningGymReward`.

    A held-out evaluation is two envs over the same data (``dataset``, ``config``, ``size``, ``seed``) and the same
    ``split_seed``: ``split="train"`` to train on, ``split="held_out", epochs=1`` for
    :func:`tokengym.evaluation.evaluate`; their problems never overlap (:func:`held_out_split`).

    Args:
        dataset: a name, names, ``{name: weight}`` or ``[{"name", "weight", "config"}]`` (see
            :meth:`ReasoningGymSpec.parse`).
        tokenizer: the tokenizer of the model you train (``tokengym.testing.tiny_tokenizer()`` in tests).
        config: options of a single dataset (e.g. ``{"min_terms": 2, "max_terms": 2}``).
        size: entries generated.
        seed: seed of the entries (and of the prompt order with ``shuffle=True``).
        system_prompt: instruction before each question (``None``: none).
        epochs: passes over the prompts, then the source ends (``1`` for :func:`~tokengym.evaluation.evaluate`);
            ``None`` repeats forever.
        split: ``"train"`` or ``"held_out"``: only that side of :func:`held_out_split` of the entries' distinct
            questions; ``None``: every entry.
        held_out: with ``split``, the distinct questions held out: a count (int) or a fraction (float; default 0.2).
        split_seed: with ``split``, the seed of the split (default: ``seed``).
        **env_kwargs: the other :class:`TokenEnv` arguments (``batch_size``, ``max_new_tokens``, ``group_size``...).

    Raises:
        TypeError: an argument neither this function nor :class:`TokenEnv` takes (named, with the accepted ones).

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> common = dict(tokenizer=tiny_tokenizer(), size=40, held_out=10, split_seed=3)
        >>> train = make_reasoning_gym_env("chain_sum", split="train", **common)
        >>> held = make_reasoning_gym_env("chain_sum", split="held_out", epochs=1, group_size=4, **common)
        >>> len(held.source.prompts), held.source.epochs
        (10, 1)
    """
    require_tokenizer("make_reasoning_gym_env", tokenizer)
    check_kwargs(make_reasoning_gym_env, env_kwargs, _PASSED_ON, _HINTS)
    reward = ReasoningGymReward(dataset, config=config, size=size, seed=seed)
    prompts = reasoning_gym_prompts(reward.spec, system_prompt=system_prompt,
                                    use_chat=getattr(tokenizer, "chat_template", None) is not None)  # fmt: skip
    prompts = _split(prompts, split, held_out, seed if split_seed is None else split_seed, is_seeded=split_seed is not None)
    source = PromptSource(prompts, tokenizer, group_size=env_kwargs.pop("group_size", 1), seed=seed, epochs=epochs,
                          shuffle=env_kwargs.pop("shuffle", False), overlong=env_kwargs.pop("overlong_prompts", "error"))  # fmt: skip
    env_kwargs.setdefault("max_length", 512)
    return TokenEnv(source, tokenizer, reward, seed=seed, **env_kwargs)


def _split(prompts: list[dict], split: str | None, held_out, split_seed: int, *, is_seeded: bool) -> list[dict]:
    if split is None:
        if held_out is not None or is_seeded:
            raise ValueError("held_out= and split_seed= choose a split: add split='train' (the env you train on) or "
                             "split='held_out' (the env you evaluate on)")  # fmt: skip
        return prompts
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (or None: every entry), got {split!r}")
    train, held = held_out_split(prompts, held_out=0.2 if held_out is None else held_out, seed=split_seed)
    return train if split == "train" else held


def gym_env(*, render_mode: str | None = None, **env_kwargs) -> GymTokenEnv:
    """The entry point of the gymnasium id ``tokengym/ReasoningGym-v0`` (one slot; kwargs go to
    :func:`make_reasoning_gym_env`: ``tokenizer`` (required), ``dataset="chain_sum"``...)."""
    require_tokenizer("gymnasium.make('tokengym/ReasoningGym-v0')", env_kwargs.get("tokenizer"))
    env_kwargs = {"batch_size": 1, "shuffle": True, **env_kwargs}
    return GymTokenEnv(make_reasoning_gym_env, render_mode=render_mode, **env_kwargs)


gym_env.metadata = GymTokenEnv.metadata  # read by gymnasium.make to validate render_mode
