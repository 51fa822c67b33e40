"""reasoning-gym adapter: rewards of collected batches equal the dataset's own score_answer on the decoded
responses (six generators of different kinds, a mix, the three generation sources), wrong formats score 0,
bad names and configs get clear errors, the gymnasium id and pickling work; an answer that makes
score_answer raise (prime_factorization, coin_flip, boxnet) scores 0, is counted in the metrics and logged."""

import pickle

import gymnasium
import pytest
import reasoning_gym
import torch
from adapter_helpers import SOURCES, collect
from reasoning_gym.utils import extract_answer

from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import ReasoningGymReward, make_reasoning_gym_env

# arithmetic, strings, word counting, lists, number bases, number theory, grids, kinship logic
GENERATORS = ("chain_sum", "spell_backward", "letter_counting", "number_sorting", "base_conversion", "gcd", "maze",
              "family_relationships")  # fmt: skip


class Answering:
    """A scripted step policy: trajectory ``i`` writes the gold answer in tags (i % 3 == 0), a wrong
    answer in tags (1) or the gold answer without tags (2), then EOS."""

    def __init__(self, env, tok):
        self.env, self.tok, self.eos = env, tok, tok.eos_token_id

    def text(self, traj, entry):
        return [f"<answer>{entry['answer']}</answer>", "<answer>no idea</answer>", str(entry["answer"])][traj % 3]

    def __call__(self, td):
        actions = []
        for b in range(self.env.batch_size[0]):
            prompt = self.env.slot_prompt(b)
            if prompt is None or not bool(td[keys.ACTIVE][b]):
                actions.append(self.eos)
                continue
            plan = self.tok(self.text(int(td[keys.TRAJ_ID][b]), prompt.metadata["entry"]))["input_ids"]
            n = int(td[keys.RESPONSE_LEN][b])
            actions.append(plan[n] if n < len(plan) else self.eos)
        td.set(keys.ACTION_LOG_PROB, torch.zeros(len(actions)))
        td.set(keys.POLICY_VERSION, torch.zeros(len(actions), dtype=torch.int64))
        return td.set(keys.ACTION, torch.tensor(actions))


def _check_rewards(tok, batches, dataset):
    """Every trajectory's reward is score_answer(extract_answer(decoded response), entry); returns the rewards."""
    got = []
    for batch in batches:
        table = batch.get_non_tensor(keys.PROMPTS)
        for row in range(batch.shape[0]):
            mask = batch[keys.MASK][row]
            entry = table.metadata(int(batch[keys.GROUP_ID][row, 0]))["entry"]
            response = tok.decode(batch[keys.ACTION][row][mask], skip_special_tokens=True)
            answer = extract_answer(response)
            expected = 0.0 if answer is None else float(dataset.score_answer(answer, entry))
            reward = float(batch[keys.REWARD][row, int(mask.nonzero()[-1]), 0])
            assert reward == pytest.approx(expected), (response, entry["answer"])
            got.append((int(batch[keys.TRAJ_ID][row, 0]) % 3, reward))
    return got


@pytest.mark.parametrize("name", GENERATORS)
def test_rewards_are_the_datasets_score_answer(tok, name):
    env = make_reasoning_gym_env(name, tokenizer=tok, size=6, batch_size=3, max_new_tokens=120, max_length=1024)
    batches = collect(env, Answering(env, tok), "step", trajectories=6)
    got = _check_rewards(tok, batches, reasoning_gym.create_dataset(name, size=6, seed=0))
    assert len(got) >= 6
    gold, untagged = [r for kind, r in got if kind == 0], [r for kind, r in got if kind == 2]
    assert gold and set(gold) == {1.0}  # the gold answer in tags
    assert untagged and set(untagged) == {0.0}  # the gold answer in the wrong format


@pytest.mark.parametrize("source", SOURCES)
def test_mix_with_every_source(tok, lm, make_policy, source):
    mix = [{"name": "chain_sum", "weight": 2.0, "config": {"min_terms": 2, "max_terms": 2}}, "gcd", "spell_backward"]
    env = make_reasoning_gym_env(mix, tokenizer=tok, size=16, batch_size=4, max_new_tokens=16, max_length=1024,
                                 model_config=lm.config)  # fmt: skip
    policy, kind = make_policy(env, source)
    batches = collect(env, policy, kind, trajectories=8)
    _check_rewards(tok, batches, env.reward_fn.dataset)
    sources = {batch.get_non_tensor(keys.PROMPTS).metadata(g)["entry"]["metadata"]["source_dataset"]
               for batch in batches for g in batch[keys.GROUP_ID][:, 0].tolist()}  # fmt: skip
    assert len(sources) >= 2


def test_bad_names_and_configs_name_the_choices(tok):
    with pytest.raises(KeyError, match="no dataset 'chain_sums'; available: .*chain_sum.*spell_backward"):
        make_reasoning_gym_env("chain_sums", tokenizer=tok)
    with pytest.raises(ValueError, match=r"'chain_sum' has no option\(s\) \['terms'\]; its options: .*max_terms"):
        make_reasoning_gym_env("chain_sum", tokenizer=tok, config={"terms": 3})
    with pytest.raises(ValueError, match="'chain_sum' rejected config .*min_terms.*its options"):
        make_reasoning_gym_env("chain_sum", tokenizer=tok, config={"min_terms": 0})
    with pytest.raises(KeyError, match="no dataset 'nope'"):
        make_reasoning_gym_env(["gcd", "nope"], tokenizer=tok)
    with pytest.raises(ValueError, match="size must be a positive int"):
        make_reasoning_gym_env("gcd", tokenizer=tok, size=0)
    with pytest.raises(KeyError, match=r"no metadata\['entry'\]"):
        ReasoningGymReward("gcd")(["<answer>1</answer>"], ["q"], [{"answer": "1"}])


def test_gymnasium_id_and_pickling(tok):
    import tokengym.llm_envs.adapters  # noqa: F401  (registers the id)

    env = gymnasium.make("tokengym/ReasoningGym-v0", tokenizer=tok, dataset="gcd", size=4, max_new_tokens=2)
    obs, info = env.reset(seed=0)
    assert "<answer>" in info["prompt"] or "answer" in info["prompt"].lower()
    assert info["metadata"]["entry"]["metadata"]["source_dataset"] == "gcd"
    reward = pickle.loads(pickle.dumps(ReasoningGymReward("gcd", size=4)))
    entry = info["metadata"]["entry"]
    assert reward([f"<answer>{entry['answer']}</answer>"], ["q"], [{"entry": entry}]).tolist() == [1.0]
    built = pickle.loads(pickle.dumps(make_reasoning_gym_env("gcd", tokenizer=tok, size=4).reward_fn))
    assert built.spec.datasets == (("gcd", 1.0, {}),)


@pytest.mark.parametrize("module, extra, make", [
    ("reasoning_gym.factory", "reasoning-gym", lambda: ReasoningGymReward("gcd")),
    ("textarena", "textarena", lambda: __import__("tokengym.llm_envs.adapters", fromlist=["x"]).TextArenaEnv("x")),
    ("websockets.sync.client", "openenv", lambda: __import__("tokengym.llm_envs.adapters._ws", fromlist=["x"]).Session(
        "ws://127.0.0.1:1/ws", timeout_s=1.0)),
])  # fmt: skip
def test_a_missing_package_names_its_extra(monkeypatch, module, extra, make):
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=rf"pip install 'tokengym\[{extra}\]'"):
        make()


GARBAGE = ("1e999", "not a number", "")


def _raises(dataset, answer, entry) -> bool:
    try:
        dataset.score_answer(answer, entry)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("name", ("prime_factorization", "coin_flip", "boxnet"))
def test_answers_that_make_score_answer_raise_score_0_and_are_counted(tok, caplog, name):
    env = make_reasoning_gym_env(name, tokenizer=tok, size=4, batch_size=1, max_length=4096)
    env.reset()
    entry = env.slot_prompt(0).metadata["entry"]
    dataset = reasoning_gym.create_dataset(name, size=4, seed=0)
    raising = [g for g in GARBAGE if _raises(dataset, g, entry)]
    assert "1e999" in raising  # reasoning-gym's score_answer raises on it
    responses = [f"<answer>{g}</answer>" for g in GARBAGE] * 2
    with caplog.at_level("WARNING", logger="tokengym.rewards"):
        got = env.reward_fn(responses, ["q"] * len(responses), [{"entry": entry}] * len(responses)).tolist()
    expected = [0.0 if g in raising else float(dataset.score_answer(g, entry)) for g in GARBAGE] * 2
    assert got == pytest.approx(expected)
    assert env.reward_fn.counts == {"reward_errors": 2 * len(raising)}
    assert env.prompt_counts["reward_errors"] == 2 * len(raising)
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokengym.rewards"]
    assert len(warnings) == 1 and name in warnings[0] and repr(raising[0]) in warnings[0]  # the first one only


class Garbage(Answering):
    """Every trajectory answers ``<answer>1e999</answer>``, then EOS."""

    def text(self, traj, entry):
        return "<answer>1e999</answer>"


def test_a_garbage_answer_scores_0_in_a_collection_and_the_run_goes_on(tok, caplog):
    from tokengym.collectors import TokenCollector

    env = make_reasoning_gym_env(["prime_factorization", "coin_flip"], tokenizer=tok, size=8, batch_size=2,
                                 max_new_tokens=32)  # fmt: skip
    collector = TokenCollector(env, Garbage(env, tok), mode="trajectories", batch_size=2, source="step")
    with caplog.at_level("WARNING", logger="tokengym.rewards"):
        batches = [batch for _, batch in zip(range(4), collector, strict=False)]
    assert sum(batch.shape[0] for batch in batches) >= 8
    for batch in batches:
        for row in range(batch.shape[0]):
            mask = batch[keys.MASK][row]
            assert tok.decode(batch[keys.ACTION][row][mask], skip_special_tokens=True) == "<answer>1e999</answer>"
            assert float(batch[keys.REWARD][row, int(mask.nonzero()[-1]), 0]) == 0.0
    assert env.prompt_counts["reward_errors"] >= 8
    assert 8 <= collector.metrics["reward_errors"] <= env.prompt_counts["reward_errors"]  # copied at each batch's end
    warned = sorted(r.getMessage().split(":")[0] for r in caplog.records if r.name == "tokengym.rewards")
    assert warned == ["coin_flip", "prime_factorization"]  # the first error of each dataset, logged once
