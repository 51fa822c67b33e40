"""tokengym.warm_start.supervised_warm_start (the demo's and the recipe's warm start): the loss falls, it teaches a
tiny model the answers, renders chat prompts as the env does, and names bad input."""

import copy

import pytest
import torch

from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.evaluation import evaluate
from tokengym.llm_envs import PromptSource, TokenEnv
from tokengym.llm_envs.tasks import arithmetic_reward
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.warm_start import supervised_warm_start

PROBLEMS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_the_loss_falls_and_the_model_is_left_in_eval_mode(tok):
    model = tiny_model(tok, seed=3)
    losses = supervised_warm_start(model, tok, PROBLEMS, 15, lr=2e-3)
    assert len(losses) == 15 and losses[-1] < losses[0] and not model.training


def test_it_teaches_the_answers_and_zero_steps_change_nothing(tok):
    model = tiny_model(tok, seed=0)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    assert supervised_warm_start(model, tok, PROBLEMS, 0) == []
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    supervised_warm_start(model, tok, PROBLEMS, 150)
    source = PromptSource(PROBLEMS, tok, epochs=1)
    env = TokenEnv(source, tok, arithmetic_reward(), batch_size=9, max_new_tokens=3, max_length=32)
    greedy = evaluate(env, TransformersPolicy(model, env, sampling=SamplingConfig(greedy=True)))
    assert greedy.metrics["pass@1"] == 1.0  # the 9 training answers, greedily


def test_chat_prompts_are_rendered_as_the_env_renders_them(tok):
    chat = [{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"]} for p in PROBLEMS]
    rendered = [{"prompt": PromptSource(chat, tok).encode(item, i)[1], "answer": item["answer"]}
                for i, item in enumerate(chat)]  # fmt: skip
    a, b = tiny_model(tok, seed=1), tiny_model(tok, seed=1)
    assert supervised_warm_start(a, tok, chat, 3) == supervised_warm_start(b, tok, rendered, 3)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"steps": -1}, ValueError, r"steps must be an int >= 0 \(0: no warm start\), got -1"),
    ({"steps": 2, "lr": 0}, ValueError, "lr must be a number > 0, got 0"),
    ({"targets": []}, TypeError, r"targets must be a non-empty list of \{'prompt': ..., 'answer': ...\}"),
    ({"targets": [{"prompt": "1+1="}]}, TypeError, "target 0 must be a mapping with 'prompt' and 'answer'"),
    ({"targets": [{"prompt": 3, "answer": "3"}]}, TypeError, "target 0's prompt must be text or chat messages, got 3"),
])  # fmt: skip
def test_bad_input_names_the_value(tok, kwargs, error, match):
    args = {"targets": PROBLEMS, "steps": 1, **kwargs}
    with pytest.raises(error, match=match):
        supervised_warm_start(tiny_model(tok), tok, args.pop("targets"), args.pop("steps"), **args)


def test_a_warm_start_on_prompts_with_images_passes_them_to_the_model():
    """Targets with images (a visual task's items) go through the processor; the loss falls, and the images matter:
    the same targets scored without their pixels (blank images) give another loss."""
    from tokengym.llm_envs.tasks.visual import shape_count_prompts
    from tokengym.testing import tiny_vl_model, tiny_vl_processor, tiny_vl_tokenizer

    tok = tiny_vl_tokenizer()
    processor, model = tiny_vl_processor(tok), tiny_vl_model(tok)
    items = shape_count_prompts(8, seed=0)
    losses = supervised_warm_start(model, tok, items, steps=15, processor=processor)
    assert losses[-1] < losses[0] / 2
    blank = [{**item, "images": [item["images"][0].point(lambda _: 255)]} for item in items]
    fresh = tiny_vl_model(tok)  # the loss before any step, with the images and with blank ones
    again = supervised_warm_start(copy.deepcopy(fresh), tok, items, steps=1, processor=processor)[0]
    other = supervised_warm_start(copy.deepcopy(fresh), tok, blank, steps=1, processor=processor)[0]
    assert abs(again - other) > 1e-3
    with pytest.raises(ValueError, match="processor="):
        supervised_warm_start(model, tok, items, steps=1)
