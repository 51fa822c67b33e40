"""docs/reference/metrics.md lists every key the collectors, the transforms, ``train`` and ``evaluate`` write.

The keys are read from the page's tables: every row whose first cell is a backquoted key (`` `mean_reward` ``);
``{k}`` / ``{n}`` in a key stand for a number (``pass@{k}``). They are compared with the keys of real runs of small
collectors (``TokenCollector`` in both modes, with dynamic sampling, a verifying reward and a KL transform, on an agent env;
``AsyncCollector``; ``RayTokenCollector``), of the transforms' ``metrics()``, of ``train`` and of ``evaluate``.
"""

from __future__ import annotations

import copy
import pathlib
import re
import sys

import pytest
import torch
from ray import cloudpickle
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import (
    AsyncCollector,
    CollectorOptions,
    DynamicSampling,
    RayTokenCollector,
    TokenCollector,
)
from tokengym.collectors.branching import SegmentRule
from tokengym.collectors.policies import SequenceActor, TransformersPolicy
from tokengym.evaluation import evaluate
from tokengym.llm_envs import MathAnswerReward, PromptSource, TokenEnv
from tokengym.llm_envs.agents import make_agent_env
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import train
from tokengym.transforms import (
    AdaptiveKLController,
    GroupAdvantage,
    KLRewardTransform,
    MismatchCorrection,
    ZeroStdGroupFilter,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules by name

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md"
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|([^|]*)\|", re.M)
# rows written by what this test cannot run here cheaply; their own tests check them (a fleet needs servers)
NOT_RUN_HERE = ("VLLMServerPolicy",)


def documented() -> dict[str, str]:
    """``key -> written by`` of every table row of the page."""
    return {key: by.strip() for key, by in _ROW.findall(PAGE.read_text())}


def is_documented(key: str, keys: dict[str, str]) -> bool:
    return any(re.fullmatch(re.escape(doc).replace(r"\{k\}", r"\d+").replace(r"\{n\}", r"\d+"), key) for doc in keys)


def _env(tok, model, *, reward=None, prompts=None, group_size=2):
    prompts = prompts if prompts is not None else [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    reward = reward or (lambda r, p, m: torch.rand(len(r)))
    return TokenEnv(prompts, tok, reward, batch_size=4, group_size=group_size, max_new_tokens=3, max_length=32,
                    model_config=model.config)  # fmt: skip


def _ray_env():
    tok = tiny_tokenizer()
    return TokenEnv([f"{i}+1=" for i in range(20)], tok, lambda r, p, m: torch.rand(len(r)), batch_size=2,
                    group_size=2, max_new_tokens=3, max_length=32)  # fmt: skip


async def _agent(client, task):
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task}])
    return 1.0


def _ray_policy(env):
    return TransformersPolicy(tiny_model(env.tokenizer), env)


@pytest.fixture(scope="module")
def written() -> dict[str, set[str]]:
    """What each run wrote: ``{"collector": keys, "train": keys, "evaluate": keys}``."""
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model, ref = tiny_model(tok), tiny_model(tok)
    collector_keys: set[str] = set()

    def run(collector):
        with collector:
            next(iter(collector))
            collector_keys.update(collector.metrics)

    env = _env(tok, model, reward=MathAnswerReward())
    kl = KLRewardTransform(controller=AdaptiveKLController(0.1, target=1.0, horizon=10), ref_model=ref)
    run(TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4, postproc=kl))
    env = _env(tok, model)
    run(TokenCollector(env, TransformersPolicy(model, env), mode="steps", batch_size=4))
    env = _env(tok, model)
    options = CollectorOptions(dynamic_sampling=DynamicSampling())
    run(TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4, options=options,
                       source="wave", postproc=MismatchCorrection("truncate", trainer=SequenceActor(model).log_prob)))  # fmt: skip
    env = _env(tok, model)
    run(TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4,
                       options=CollectorOptions(tree=SegmentRule(1, 2))))  # fmt: skip
    env = _env(tok, model)
    inner = TokenCollector(env, TransformersPolicy(copy.deepcopy(model), env), mode="trajectories", batch_size=4,
                           postproc=ZeroStdGroupFilter())  # fmt: skip
    run(AsyncCollector(inner, max_staleness=1))
    run(RayTokenCollector(_ray_env, _ray_policy, num_workers=2, mode="trajectories", batch_size=4))
    env = make_agent_env(_agent, ["1+1=", "2+2="], tok, batch_size=2, max_new_tokens=3, max_length=32,
                         model_config=model.config)  # fmt: skip
    run(TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=2))
    env.close()
    for transform in (kl, kl.controller, ZeroStdGroupFilter(), MismatchCorrection("mask")):
        collector_keys.update(transform.metrics())

    env = _env(tok, model)
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4)
    loss = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)
    rows = train(collector, loss, torch.optim.Adam(model.parameters(), lr=1e-4), iterations=1,
                 prepare=GroupAdvantage("grpo"))  # fmt: skip
    loss_scalars = {k for k, v in loss(GroupAdvantage("grpo")(next(iter(collector)))).items() if v.numel() == 1}

    source = PromptSource([{"prompt": "1+1=", "answer": "2"}], tok, group_size=4, epochs=1)
    env = TokenEnv(source, tok, MathAnswerReward(), batch_size=4, max_new_tokens=3, max_length=32)
    result = evaluate(env, TransformersPolicy(model, env))
    return {"collector": collector_keys, "train": set(rows[0]) - loss_scalars, "loss": loss_scalars,
            "evaluate": set(result.metrics)}  # fmt: skip


def test_the_page_lists_every_key_a_run_writes(written):
    keys = documented()
    missing = {run: sorted(k for k in found if not is_documented(k, keys)) for run, found in written.items() if run != "loss"}
    assert not any(missing.values()), f"keys written but not in docs/reference/metrics.md: {missing}"
    assert "loss_objective" in written["loss"] and is_documented("loss_objective", keys)


def test_every_key_on_the_page_is_written_by_a_run(written):
    produced = set().union(*written.values())
    stale = [key for key, by in documented().items() if not any(name in by for name in NOT_RUN_HERE)
             and not any(re.fullmatch(re.escape(key).replace(r"\{k\}", r"\d+").replace(r"\{n\}", r"\d+"), k) for k in produced)]  # fmt: skip
    assert not stale, f"docs/reference/metrics.md lists keys no run writes (renamed? removed?): {stale}"


def test_key_extraction_reads_table_rows_only():
    text = "| key | written by | meaning |\n|---|---|---|\n| `a_key` | every collector | x |\nprose `not_a_key` here\n"
    assert dict(_ROW.findall(text)) == {"a_key": " every collector "}
    assert is_documented("pass@4", {"pass@{k}": ""}) and not is_documented("pass@k4", {"pass@{k}": ""})
