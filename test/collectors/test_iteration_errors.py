"""An exception out of ``next(it)`` ends that call only: the same iterator goes on, nothing lost.

Users write ``it = iter(collector)`` and catch a ``PromptError`` (or a reward function's error) around
``next(it)``; a generator-based ``__iter__`` ended at the first exception, so the next ``next(it)`` raised
``StopIteration`` with prompts still to collect.
"""

import concurrent.futures
import copy

import pytest

from tokengym.collectors import TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.errors import PromptError
from tokengym.llm_envs import PromptSource, TokenEnv, keys

GOOD = [f"{i}+{i}=" for i in range(8)]
BAD = "1+" * 20 + "1="  # 42 tokens, over max_length=24: a PromptError under overlong_prompts="error"
WITH_BAD = GOOD[:3] + [BAD] + GOOD[3:]
GROUP, NEW_TOKENS = 2, 4


def make_collector(tokenizer, model, prompts, *, mode, source):
    env = TokenEnv(PromptSource(prompts, tokenizer, group_size=GROUP, epochs=1), tokenizer, batch_size=3,
                   max_new_tokens=NEW_TOKENS, max_length=24, model_config=model.config)  # fmt: skip
    # no end of sequence: every trajectory is NEW_TOKENS long, so the two runs' step counts compare exactly
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=tuple(env.eos_token_ids)))
    return TokenCollector(env, policy, mode=mode, batch_size=4 if mode == "trajectories" else 3, source=source)


def collected(batches):
    """(prompt text of every trajectory, sorted; total real steps)."""
    texts, steps = [], 0
    for batch in batches:
        mask, table = batch[keys.MASK], batch.get_non_tensor(keys.PROMPTS)
        steps += int(mask.sum())
        starts = mask & (batch[keys.RESPONSE_LEN].reshape(mask.shape) == 0)  # each trajectory's first step
        texts += [table.text(int(g)) for g in batch[keys.GROUP_ID][starts].tolist()]
    return sorted(texts), steps


@pytest.mark.parametrize("source", ["step", "wave"])
@pytest.mark.parametrize("mode", ["trajectories", "steps"])
def test_next_on_the_same_iterator_goes_on_after_a_prompt_error(tokenizer, model, mode, source):
    collector = make_collector(tokenizer, model, WITH_BAD, mode=mode, source=source)
    it = iter(collector)
    batches = []
    with pytest.raises(PromptError, match="prompt 3 '1\\+1\\+"):
        while True:
            batches.append(next(it))
    batches.append(next(it))  # was StopIteration: the generator had ended at the exception
    batches += list(it)
    assert next(it, None) is None and collector.metrics["failed_prompts"] == 1

    reference = list(make_collector(tokenizer, model, GOOD, mode=mode, source=source))
    texts, steps = collected(batches)
    assert (texts, steps) == collected(reference)  # nothing lost, nothing twice: the bad prompt only is missing
    assert texts == sorted(GOOD * GROUP) and steps == len(GOOD) * GROUP * NEW_TOKENS


def test_async_collector_goes_on_after_a_prompt_error(tokenizer, model):
    """The background thread ended at the error: the next ``next()`` waited forever."""
    inner = make_collector(tokenizer, copy.deepcopy(model), WITH_BAD, mode="trajectories", source="step")
    batches, errors = [], 0
    with AsyncCollector(inner, max_staleness=1) as collector, concurrent.futures.ThreadPoolExecutor(1) as pool:
        it = iter(collector)
        while True:
            try:
                batch = pool.submit(next, it, None).result(timeout=60)  # a hang fails instead of blocking the run
            except PromptError:
                errors += 1
                continue
            if batch is None:
                break
            batches.append(batch)
    assert errors == 1
    assert collected(batches) == (sorted(GOOD * GROUP), len(GOOD) * GROUP * NEW_TOKENS)
