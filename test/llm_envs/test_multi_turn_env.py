import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.errors import RewardFunctionError
from tokengym.llm_envs import PromptSource, check_env, keys
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn
from tokengym.llm_envs.tasks import WRONG_FEEDBACK, MultiTurnMathFeedback, make_multi_turn_math_env
from tokengym.transforms import ScaleReward, TurnDiscount, decode, to_padded
from tokengym.transforms.sequences import sequence_layout

PROMPTS = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3+4=", "answer": "7"}]


class ScriptedPolicy:
    """Writes ``scripts[slot][turn][i]`` as the i-th token of a turn, then EOS (log-prob 0, version 0)."""

    def __init__(self, scripts: dict[int, list[list[int]]], eos: int) -> None:
        self.scripts, self.eos, self.version = scripts, eos, 0

    def __call__(self, td):
        turn, pos = td.get(keys.TURN), td.get(keys.SEQ_LEN) - td.get(keys.PROMPT_LEN)
        action = []
        for b in range(len(turn)):
            script = self.scripts[b][min(int(turn[b]), len(self.scripts[b]) - 1)]
            action.append(script[int(pos[b])] if int(pos[b]) < len(script) else self.eos)
        td.set(keys.ACTION, torch.tensor(action, dtype=torch.int64))
        td.set(keys.ACTION_LOG_PROB, torch.zeros(len(turn)))
        td.set(keys.POLICY_VERSION, torch.zeros(len(turn), dtype=torch.int64))
        return td


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def scripted(tokenizer):
    env = MultiTurnTokenEnv(PROMPTS, tokenizer, MultiTurnMathFeedback(wrong=-0.5), max_turns=3, batch_size=2,
                            max_new_tokens=16, max_length=128)  # fmt: skip
    # slot 0: "12" (wrong), then "19" (right); slot 1: "7" (right at once)
    policy = ScriptedPolicy({0: [_ids(tokenizer, "12"), _ids(tokenizer, "19")], 1: [_ids(tokenizer, "7")]},
                            tokenizer.eos_token_id)  # fmt: skip
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=2, total_steps=20)))
    order = batch[keys.GROUP_ID][:, 0].argsort()
    batch = batch[order]
    batch.set_non_tensor(keys.PROMPTS, batch.get_non_tensor(keys.PROMPTS))
    return env, batch


def test_scripted_rewards_turns_and_steps(scripted, tokenizer):
    env, batch = scripted
    n0, n1 = len(_ids(tokenizer, "12")) + 1, len(_ids(tokenizer, "19")) + 1
    mask = batch[keys.MASK]
    assert mask.sum(-1).tolist() == [n0 + n1, len(_ids(tokenizer, "7")) + 1]  # one step per generated token
    reward = batch[keys.REWARD].squeeze(-1)
    assert reward[0, : n0 + n1].tolist() == [0.0] * (n0 - 1) + [-0.5] + [0.0] * (n1 - 1) + [1.0]
    assert reward[1, mask[1]].tolist()[-1] == 1.0
    assert batch[keys.TURN][0, : n0 + n1].tolist() == [0] * n0 + [1] * n1
    assert batch[keys.DONE].squeeze(-1)[0, : n0 + n1].tolist() == [False] * (n0 + n1 - 1) + [True]
    # feedback: the user message + generation prompt, in the full sequence, with no step of its own
    full = batch.get_non_tensor(keys.PROMPTS).sequence(int(batch[keys.TRAJ_ID][0, 0]))
    first_turn = torch.tensor(_ids(tokenizer, "12") + [tokenizer.eos_token_id])
    feedback = env.feedback_ids(first_turn, WRONG_FEEDBACK, "user")  # the template's turn close, then the message
    prompt_len = int(batch[keys.SEQ_LEN][0, 0])
    table, actions = batch.get_non_tensor(keys.PROMPTS), batch[keys.ACTION][0]
    expect = [*table.ids(int(batch[keys.GROUP_ID][0, 0])).tolist(), *actions[:n0].tolist(), *feedback.tolist(),
              *actions[n0 : n0 + n1].tolist()]  # fmt: skip
    assert full.tolist() == expect
    assert int(batch[keys.SEQ_LEN][0, n0]) == prompt_len + n0 + len(feedback)  # seq_len jumps over the feedback
    turns = env.turn_metrics["feedback_turns"]  # refilled slots may have started more episodes
    assert turns >= 1 and env.turn_metrics["feedback_tokens"] == turns * len(feedback)


def test_turn_discount_and_scale_reward(scripted, tokenizer):
    _, batch = scripted
    n0 = len(_ids(tokenizer, "12")) + 1
    last = int(batch[keys.MASK][0].sum()) - 1
    discounted = TurnDiscount(0.5)(batch.clone())[keys.REWARD].squeeze(-1)
    assert discounted[0, n0 - 1].item() == pytest.approx(-0.5 + 0.5 * 1.0)
    assert discounted[0, last].item() == 1.0
    scaled = ScaleReward(scale=2.0, bias=0.25)(batch.clone())[keys.REWARD].squeeze(-1)
    assert scaled[0, last].item() == pytest.approx((1.0 - 0.25) * 2.0)  # the done step
    assert scaled[0, n0 - 1].item() == pytest.approx((-0.5 - 0.25) * 2.0)  # every turn's reward is scaled (AReaL)


def test_padded_action_mask_marks_generated_tokens_only(scripted, tokenizer):
    env, batch = scripted
    padded = to_padded(batch, pad_id=tokenizer.pad_token_id)
    action_mask, tokens = padded[keys.ACTION_MASK], padded[keys.TOKENS]
    width = padded.get_non_tensor(keys.RESPONSE_START)
    mask = batch[keys.MASK]
    assert action_mask.sum(-1).tolist() == mask.sum(-1).tolist()
    assert tokens[action_mask].tolist() == batch[keys.ACTION][mask].tolist()
    first_turn = torch.tensor(_ids(tokenizer, "12") + [tokenizer.eos_token_id])
    feedback = env.feedback_ids(first_turn, WRONG_FEEDBACK, "user")  # the template's turn close, then the message
    n0 = len(_ids(tokenizer, "12")) + 1
    gap = slice(width + n0, width + n0 + len(feedback))
    assert tokens[0, gap].tolist() == feedback.tolist() and not action_mask[0, gap].any()
    assert not action_mask[:, :width].any()
    layout = sequence_layout(batch)
    assert torch.equal(layout.tokens.gather(1, layout.columns)[mask], batch[keys.ACTION][mask])


def test_check_env_passes(tokenizer):
    fn = lambda r, p, m, t: [Turn(0.5, "again") if ti < 2 else Turn(1.0) for ti in t]  # noqa: E731
    env = MultiTurnTokenEnv(["1+1=", "2+2=", "3+3="], tokenizer, fn, max_turns=3, batch_size=3, max_new_tokens=8,
                            max_length=64)  # fmt: skip
    check_env(env, steps=60)
    assert env.turn_metrics["feedback_turns"] > 0
    check_env(make_multi_turn_math_env(tokenizer=tokenizer, batch_size=2, n_prompts=4, max_new_tokens=8), steps=40)


@pytest.mark.parametrize("max_turns", [0, -1, 1.5, True])
def test_bad_max_turns(tokenizer, max_turns):
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        MultiTurnTokenEnv(["1+1="], tokenizer, lambda *a: [], max_turns=max_turns)


def test_bad_turn_fn_and_reward_fn(tokenizer):
    with pytest.raises(TypeError, match="turn_fn must be callable"):
        MultiTurnTokenEnv(["1+1="], tokenizer, "not a function")
    with pytest.raises(ValueError, match="rewards through turn_fn; pass reward_fn=None"):
        MultiTurnTokenEnv(["1+1="], tokenizer, lambda *a: [], reward_fn=lambda *a: [1.0])
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        make_multi_turn_math_env(tokenizer=tokenizer, max_turns=0)


def _boom(*args):
    raise RuntimeError("scorer down")


@pytest.mark.parametrize(
    ("turn_fn", "match"),
    [
        (_boom, r"turn_fn raised RuntimeError: scorer down for slots \[0, 1\]"),
        (lambda r, p, m, t: [Turn(1.0)], r"one Turn per finished slot \(2 for slots \[0, 1\]\)"),
        (lambda r, p, m, t: [1.0, 1.0], r"one Turn per finished slot"),
        (lambda r, p, m, t: [Turn(float("nan"))] * 2, r"reward nan for slot 0; rewards must be finite"),
    ],
)
def test_failing_turn_fn_leaves_env_unchanged(tokenizer, turn_fn, match):
    env = MultiTurnTokenEnv(["1+1=", "2+2="], tokenizer, turn_fn, max_turns=2, batch_size=2, max_new_tokens=8,
                            max_length=64)  # fmt: skip
    td = env.reset()
    before = env.state_dict()
    with pytest.raises(RewardFunctionError, match=match):
        env.step(td.set(keys.ACTION, torch.full((2,), tokenizer.eos_token_id)))
    after = env.state_dict()
    assert torch.equal(before["tokens"], after["tokens"])
    assert all(torch.equal(before["state"][k], after["state"][k]) for k in before["state"])
    assert not env.pop_finished_sequences()


# -- multi-turn token sequences == tokenizer.apply_chat_template of the same conversation --

# a Qwen2.5-like template (its structure: default system prompt, <|im_start|>role\n...<|im_end|>\n turns,
# tool results as a user turn wrapped in <tool_response>), written here so the test runs offline
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _chat_tokenizer(kind):
    from tokengym.testing import tiny_tokenizer

    tok = tiny_tokenizer()  # a fresh object: the session tokenizer stays untouched
    if kind == "qwen":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = QWEN_TEMPLATE
    return tok


def _template_ids(tok, conversation):
    return _ids(tok, tok.apply_chat_template(conversation, tokenize=False))


def _play(tok, conversation, turn_fn):
    """Run the conversation's assistant turns through a MultiTurnTokenEnv; tool calls end on the stop
    string, other turns on the template's end-of-turn token. Returns the env's full token sequence."""
    from tokengym.llm_envs.tools import TOOL_STOP

    prompt = [m for m in conversation if m["role"] in ("system", "user")][: 2 if conversation[0]["role"] == "system" else 1]
    assistant = [m["content"] for m in conversation if m["role"] == "assistant"]
    end = int(MultiTurnTokenEnv([prompt], tok, turn_fn, batch_size=1, max_new_tokens=8, max_length=64).turn_close_ids[0])
    scripts = [_ids(tok, a) if a.endswith(TOOL_STOP) else _ids(tok, a) + [end] for a in assistant]
    env = MultiTurnTokenEnv([prompt], tok, turn_fn, max_turns=len(assistant), batch_size=1, max_new_tokens=96,
                            max_length=512, stop_strings=[TOOL_STOP])  # fmt: skip
    policy = ScriptedPolicy({0: scripts}, end)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=1, total_steps=200)))
    sequence = batch.get_non_tensor(keys.PROMPTS).sequence(int(batch[keys.TRAJ_ID][0, 0])).tolist()
    # the episode ends on the model's end-of-turn token; the template closes the last turn with the rest
    # of its turn close (Qwen: the "\n" after <|im_end|>), which nobody generates
    return batch, sequence + env.turn_close_ids[1:].tolist()


def _tool_turns(tok):
    from tokengym.llm_envs.tools import ToolRegistry, ToolTurns

    return ToolTurns(ToolRegistry.default(), lambda r, p, m, t: [Turn(1.0) for _ in r], tokenizer=tok)


@pytest.mark.parametrize("kind", ["tiny", "qwen"])
def test_tool_turn_sequence_equals_the_chat_template(kind):
    tok = _chat_tokenizer(kind)
    conversation = [
        {"role": "user", "content": "What is 12+7?"},
        {"role": "assistant", "content": "<tool>calculator: 12+7</tool>"},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": "19"},
    ]
    batch, sequence = _play(tok, conversation, _tool_turns(tok))
    assert sequence == _template_ids(tok, conversation)
    turns = decode(batch, tok, by_turn=True)[0]
    assert [s["role"] for s in turns] == ["assistant", "feedback", "assistant"]
    assert turns[0]["content"] == "<tool>calculator: 12+7</tool>" and turns[2]["content"] == "19"
    assert "19" in turns[1]["content"] and (kind == "qwen" or turns[1]["content"] == "19")
    assert decode(batch, tok) == ["<tool>calculator: 12+7</tool>19"]  # the joined text: generated tokens only


@pytest.mark.parametrize("kind", ["tiny", "qwen"])
def test_user_feedback_sequence_equals_the_chat_template(kind):
    tok = _chat_tokenizer(kind)
    conversation = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "12+7="},
        {"role": "assistant", "content": "20"},
        {"role": "user", "content": "Wrong, try again."},
        {"role": "assistant", "content": "19"},
    ]

    def retry(responses, prompts, metadata, turns):
        return [Turn(0.0, "Wrong, try again.") if t == 0 else Turn(1.0) for t in turns]

    batch, sequence = _play(tok, conversation, retry)
    assert sequence == _template_ids(tok, conversation)
    assert batch[keys.REWARD][batch[keys.DONE]].tolist() == [1.0]


def test_shipped_multi_turn_math_task_matches_the_chat_template(tokenizer):
    env = make_multi_turn_math_env(tokenizer=tokenizer, batch_size=1, n_prompts=2, tools=True, max_turns=2)
    question = env.source.prompts[0]["prompt"]
    answer = env.source.prompts[0]["answer"]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert end in env.eos_token_ids  # the template's end of turn ends a turn
    scripts = [_ids(tokenizer, "<tool>calculator: 1+1</tool>"), _ids(tokenizer, answer) + [end]]
    batch = next(iter(TokenCollector(env, ScriptedPolicy({0: scripts}, end), mode="trajectories", batch_size=1,
                                     total_steps=200)))  # fmt: skip
    sequence = batch.get_non_tensor(keys.PROMPTS).sequence(int(batch[keys.TRAJ_ID][0, 0])).tolist()
    assert env.turn_close_ids.tolist() == [end]
    conversation = [*question, {"role": "assistant", "content": "<tool>calculator: 1+1</tool>"},
                    {"role": "tool", "content": "2"}, {"role": "assistant", "content": answer}]  # fmt: skip
    assert sequence == _template_ids(tokenizer, conversation)


def _again(responses, prompts, metadata, turns):
    return [Turn(1.0, "again") for _ in responses]


def test_turn_limit_lets_a_four_turn_episode_play_every_turn(tokenizer):
    """max_turn_tokens ends each turn, not the episode: 4 turns of 8 tokens within a 64-token episode budget."""
    env = MultiTurnTokenEnv(["1+1="], tokenizer, _again, max_turns=4, batch_size=1, max_new_tokens=64,
                            max_turn_tokens=8, max_length=256)  # fmt: skip
    td, turns, steps = env.reset(), [], 0
    while True:
        td, nxt = env.step_and_maybe_reset(td.set(keys.ACTION, torch.tensor([40])))
        steps += 1
        turns.append(int(td["turn"]))
        if bool(td[keys.DONE]):
            break
        td = nxt
    assert steps == 32 and turns == [t for t in range(4) for _ in range(8)]
    assert bool(td[keys.TRUNCATED]) and not bool(td[keys.TERMINATED])  # the last turn was cut
    assert td[keys.REWARD].item() == 1.0


def test_turn_limit_in_waves(tokenizer):
    from tokengym.llm_envs.waves import WaveResult

    env = MultiTurnTokenEnv(["1+1="], tokenizer, _again, max_turns=4, batch_size=1, max_new_tokens=20,
                            max_turn_tokens=8, max_length=256)  # fmt: skip
    env.reset()
    budgets, dones = [], []
    for _ in range(3):  # 8 + 8 + 4: the episode budget cuts the third turn
        request = env.wave_request()
        n = int(request.max_new_tokens[0])
        budgets.append(n)
        actions = torch.full((1, n), 40)
        out = env.unroll(request, WaveResult(actions, torch.tensor([n]), torch.zeros(1, n)))
        dones.append(bool(out["next", "done"][0, n - 1]))
    assert budgets == [8, 8, 4] and dones == [False, False, True]
    assert bool(out["next", "truncated"][0, 3]) and int(out["turn"][0, 0]) == 2


def test_single_turn_limit_truncates(tokenizer):
    from tokengym.llm_envs import TokenEnv

    env = TokenEnv(["1+1="], tokenizer, batch_size=1, max_new_tokens=63, max_turn_tokens=3, max_length=64)
    td = env.reset()
    for _ in range(3):
        td, nxt = env.step_and_maybe_reset(td.set(keys.ACTION, torch.tensor([40])))
        last, td = td, nxt
    assert bool(last[keys.TRUNCATED]) and env.config()["max_turn_tokens"] == 3
    with pytest.raises(ValueError, match="max_turn_tokens"):
        TokenEnv(["1+1="], tokenizer, batch_size=1, max_turn_tokens=0, max_length=64)


def _stop_or_again(responses, prompts, metadata, turns):
    """A reward per turn; a response with a 4 in it ends the episode, others get feedback."""
    return [Turn(float(len(r)), None if "4" in r else "again") for r in responses]


def test_unroll_cells_equals_the_padded_unroll_at_its_real_steps(tokenizer):
    """Waves of 3-turn episodes in slots that fall out of step (one prompt fails to fit, EOS in some rows, idle
    slots at the end of the source): every key of ``unroll_cells`` equals ``unroll``'s at its real steps, in slot
    order, and both envs stay equal."""
    from tokengym.llm_envs.waves import WaveResult

    prompts = [f"{a}+{a}=" for a in range(10)]
    envs = [MultiTurnTokenEnv(PromptSource(prompts, tokenizer, epochs=1), tokenizer, _stop_or_again, max_turns=3,
                              batch_size=4, max_new_tokens=24, max_turn_tokens=9, max_length=96) for _ in range(2)]  # fmt: skip
    for env in envs:
        env.reset()
    gen, four, eos = torch.Generator().manual_seed(0), _ids(tokenizer, "4")[0], tokenizer.eos_token_id
    waves = 0
    while len(request := envs[0].wave_request()):
        assert torch.equal(request.slots, envs[1].wave_request().slots)
        n, T = len(request), int(request.max_new_tokens.max())
        actions = torch.randint(20, 40, (n, T), generator=gen)
        actions[0, 1], actions[-1, 0] = four, eos  # an episode that ends, a turn ended by EOS
        lengths = torch.minimum(torch.randint(1, T + 1, (n,), generator=gen), request.max_new_tokens)
        result = WaveResult(actions, lengths, -torch.rand(n, T, generator=gen), raw_log_probs=-torch.rand(n, T, generator=gen))
        padded = envs[0].unroll(request, result)
        cells, counts = envs[1].unroll_cells(request, result)
        real = padded[keys.ACTIVE]
        assert torch.equal(counts, real.sum(1)) and cells.batch_size == (int(real.sum()),)
        assert set(cells.keys(True, True)) == set(padded.keys(True, True))
        for key in padded.keys(True, True):
            assert torch.equal(cells[key], padded[key][real]), key
        assert torch.equal(envs[0].tokens, envs[1].tokens)
        done = padded["next", "done"].squeeze(-1).any(1).nonzero().squeeze(-1).tolist()
        for env in envs:
            if done:
                env.refill(done)
        waves += 1
    assert waves >= 4
