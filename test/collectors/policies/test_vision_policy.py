"""Vision-language rollouts (issue 52): a tiny Qwen2-VL stepped one token at a time with its prompts' images in the KV
cache (M-RoPE positions, the per-row rope delta), on waves, across forks and a resume; each log-prob checked against
one teacher-forced forward of the whole sequence with its images, computed here by hand."""

import io

import pytest
import torch
from PIL import Image

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.branching import EntropyRule, SegmentRule
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys, mrope_positions, vision_token_ids
from tokengym.llm_envs.tasks.visual import digit_reading_prompts, shape_count_prompts
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.testing import tiny_model, tiny_tokenizer, tiny_vl_model, tiny_vl_processor, tiny_vl_tokenizer


@pytest.fixture(scope="module")
def vl():
    tok = tiny_vl_tokenizer()
    return tok, tiny_vl_processor(tok), tiny_vl_model(tok)


def mixed_items():
    """Prompts with 1 image, 2 images (a second one prepended), 1 image, and none."""
    items = shape_count_prompts(3, seed=1)
    items[1]["images"].append(digit_reading_prompts(1)[0]["images"][0])
    items[1]["prompt"][0]["content"].append({"type": "image"})
    return [*items, {"prompt": [{"role": "user", "content": "no image: 2+2="}], "answer": "4"}]


def make(vl, items=None, *, source="step", batch=8, options=None, seed=1, max_new_tokens=10, **env_args):
    tok, processor, model = vl
    env = TokenEnv(items or mixed_items(), tok, batch_size=4, group_size=2, max_new_tokens=max_new_tokens,
                   processor=processor, model_config=model.config, eos_token_ids=[], **env_args)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=seed)
    return TokenCollector(env, policy, mode="trajectories", batch_size=batch, source=source,
                          options=options or CollectorOptions())  # fmt: skip


def forced(model, ids: torch.Tensor, images, banned) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j >= 1 from one forward of the whole sequence with its images (float32)."""
    kwargs = {}
    if images is not None:
        positions, _ = mrope_positions(ids, images.image_grid_thw, image_token_id=model.config.image_token_id,
                                       merge_size=model.config.vision_config.spatial_merge_size)  # fmt: skip
        kwargs = {"position_ids": positions[:, None], **images.model_inputs()}
    with torch.no_grad():
        logits = model(input_ids=ids[None], **kwargs).logits[0].float()
    logp = logits.index_fill(-1, torch.tensor(banned), -float("inf")).log_softmax(-1)
    return logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)


def worst_gap(model, batch, banned) -> tuple[float, list]:
    """The largest |collected - teacher-forced| log-prob over the batch, and each row's number of images."""
    table = batch.get_non_tensor(keys.PROMPTS)
    worst, counts = 0.0, []
    for row in range(batch.shape[0]):
        mask = batch[keys.MASK][row]
        actions, logp = batch[keys.ACTION][row][mask], batch[keys.ACTION_LOG_PROB][row][mask]
        group = int(batch[keys.GROUP_ID][row, 0])
        prompt, images = table.ids(group), table.images(group)
        ref = forced(model, torch.cat([prompt, actions]), images, banned)[len(prompt) - 1 :]
        worst = max(worst, float((ref - logp).abs().max()))
        counts.append(0 if images is None else images.num_images)
    return worst, counts


@pytest.mark.parametrize("source", ["step", "wave"])
def test_stepwise_and_wave_log_probs_equal_teacher_forcing_with_zero_one_and_two_images(vl, source):
    collector = make(vl, source=source)
    batch = next(iter(collector))
    worst, counts = worst_gap(vl[2], batch, collector.policy.sampling.banned_token_ids)
    assert sorted(set(counts)) == [0, 1, 2]
    assert worst < 1e-5, worst
    # the vision placeholders are never sampled, and the table records them as banned
    assert not bool(torch.isin(batch[keys.ACTION][batch[keys.MASK]], torch.tensor(vision_token_ids(vl[2]))).any())
    assert set(vision_token_ids(vl[2])) <= set(batch.get_non_tensor(keys.PROMPTS).sampling["banned_token_ids"])


def test_without_the_rope_delta_the_log_probs_would_differ(vl):
    """The control: decoding image rows at text positions (no delta) changes their log-probs, so the equality above
    tests the positions."""
    collector = make(vl)
    cache_type = type(collector.policy.cache)
    original = cache_type.decode

    def no_delta(self, tokens, live):
        saved, self.delta = self.delta, torch.zeros_like(self.delta)
        try:
            return original(self, tokens, live)
        finally:
            self.delta = saved

    cache_type.decode = no_delta
    try:
        batch = next(iter(collector))
    finally:
        cache_type.decode = original
    assert worst_gap(vl[2], batch, collector.policy.sampling.banned_token_ids)[0] > 1e-4


def test_the_same_text_with_other_images_is_not_shared(vl):
    """Two groups with the same text (the same ids: image tokens are all one id) and different images: each gets its
    own prefill (the prefix store keys prompts by ids and image digest), and every log-prob is its own image's."""
    a, b = shape_count_prompts(2, seed=5)
    assert a["prompt"] == b["prompt"] and a["images"][0].tobytes() != b["images"][0].tobytes()
    collector = make(vl, [a, b], max_new_tokens=6)
    batches = [bt for _, bt in zip(range(2), collector, strict=False)]
    for batch in batches:
        worst, _ = worst_gap(vl[2], batch, collector.policy.sampling.banned_token_ids)
        assert worst < 1e-5, worst


@pytest.mark.parametrize("rule", [SegmentRule(3, 2), EntropyRule()], ids=["segment", "entropy"])
def test_forks_inside_a_vlm_trajectory_equal_teacher_forcing(vl, rule):
    collector = make(vl, options=CollectorOptions(tree=rule), batch=4)
    batches = [bt for _, bt in zip(range(2), collector, strict=False)]
    assert collector.metrics["tree_forks"] > 0
    for batch in batches:
        assert worst_gap(vl[2], batch, collector.policy.sampling.banned_token_ids)[0] < 1e-5


@pytest.mark.parametrize("source", ["step", "wave"])
def test_a_checkpoint_with_images_in_flight_resumes_exactly(vl, source):
    first = make(vl, source=source, batch=2, seed=3)
    batches = iter(first)
    next(batches)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # what a checkpoint file holds: tensors and plain data
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    expected = [next(batches) for _ in range(2)]
    resumed = make(vl, source=source, batch=2, seed=3)
    resumed.load_state_dict(state)
    got = [bt for _, bt in zip(range(2), resumed, strict=False)]
    for x, y in zip(expected, got, strict=True):
        for key in x.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(x[key], y[key]), key
        tx, ty = x.get_non_tensor(keys.PROMPTS), y.get_non_tensor(keys.PROMPTS)
        for group in tx.group_ids():
            assert tx.images(group) is None or tx.images(group).digest == ty.images(group).digest


class ShowsABoard(TurnHandler):
    """Answers an episode's first turn with a drawn number to read (an image) and ends it after the second."""

    def __init__(self):
        self.boards = [item["images"][0] for item in digit_reading_prompts(4, seed=3)]

    def end_turns(self, turns):
        look = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this one?"}]}]
        return [Turn(0.0, feedback=look, images=[self.boards[episode % 4]]) if turn == 0 else Turn(1.0)
                for episode, turn in zip(turns.episodes, turns.turns, strict=True)]  # fmt: skip


@pytest.mark.parametrize("source", ["step", "wave"])
def test_a_multi_turn_episode_whose_feedback_shows_an_image_equals_teacher_forcing(vl, source):
    """The feedback's image is expanded into the slot and prefilled with its pixels at its M-RoPE positions; the
    trajectory's images (prompt's, then feedback's) are recorded once in the prompt table; every log-prob of both
    turns equals one forward of the whole episode with both images."""
    tok, processor, model = vl
    items = [*shape_count_prompts(3, seed=1), {"prompt": "text only prompt"}]
    env = TokenEnv(items, tok, turns=ShowsABoard(), max_turns=2, batch_size=4, group_size=2, max_new_tokens=12,
                   max_turn_tokens=5, processor=processor, model_config=model.config, max_length=400)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=1)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=8, source=source)))
    table, banned = batch.get_non_tensor(keys.PROMPTS), torch.tensor(policy.sampling.banned_token_ids)
    worst, counts = 0.0, set()
    for row in range(batch.shape[0]):
        mask, traj = batch[keys.MASK][row], int(batch[keys.TRAJ_ID][row, 0])
        full, images = table.sequence(traj), table.trajectory_images(traj, int(batch[keys.GROUP_ID][row, 0]))
        counts.add(images.num_images)
        at, actions = batch[keys.SEQ_LEN][row][mask], batch[keys.ACTION][row][mask]
        assert torch.equal(full[at], actions) and int(batch[keys.TURN][row][mask].max()) == 1  # both turns' tokens
        forced_all = torch.zeros(len(full))
        forced_all[1:] = forced(model, full, images, banned.tolist())
        worst = max(worst, float((forced_all[at] - batch[keys.ACTION_LOG_PROB][row][mask]).abs().max()))
    assert counts == {1, 2}  # the text prompt's episodes hold the board alone
    assert worst < 1e-5, worst


def test_feedback_images_without_a_processor_or_with_token_ids_name_the_fix(vl):
    from tokengym.errors import RewardFunctionError

    tok, processor, model = vl
    image = shape_count_prompts(1)[0]["images"][0]

    class Gives(TurnHandler):
        def __init__(self, feedback):
            self.feedback = feedback

        def end_turns(self, turns):
            return [Turn(0.0, feedback=self.feedback, images=[image]) for _ in turns.slots]

    for env_args, feedback, match in [({}, "look: <|image_pad|>", "no processor"),
                                      ({"processor": processor}, torch.tensor([5, 6]), "token ids with images"),
                                      ({"processor": processor}, "no placeholder", "0 image placeholder")]:  # fmt: skip
        env = TokenEnv(["hi"], tok, turns=Gives(feedback), max_turns=2, batch_size=1, max_new_tokens=6,
                       max_turn_tokens=2, max_length=200, model_config=model.config, **env_args)  # fmt: skip
        td = env.reset()
        with pytest.raises(RewardFunctionError, match=match):
            for _ in range(3):
                td = env.step_and_maybe_reset(td.set("action", torch.tensor([7])))[1]


def test_an_env_with_images_and_a_text_only_model_is_refused(vl):
    tok, processor, _ = vl
    env = TokenEnv(mixed_items(), tok, batch_size=2, max_new_tokens=4, max_length=256, processor=processor)
    text_model = tiny_model(tok)
    with pytest.raises(ValueError, match="text only"):
        TransformersPolicy(text_model, env)
    with pytest.raises(ValueError, match="text only"):
        TokenEnv(mixed_items(), tok, batch_size=2, max_new_tokens=4, processor=processor, model_config=text_model.config)


def test_a_processor_that_does_not_match_the_model_is_refused(vl):
    tok, processor, _ = vl
    other = tiny_vl_model(tiny_vl_tokenizer(vocab_size=2048))
    with pytest.raises(ValueError, match="does not match the model"):
        TokenEnv(mixed_items(), tok, batch_size=2, max_new_tokens=4, processor=processor, model_config=other.config)
    with pytest.raises(ValueError, match="not the env's tokenizer"):
        TokenEnv(mixed_items(), tiny_tokenizer(), batch_size=2, max_new_tokens=4, processor=processor)


def test_a_vlm_policy_refuses_the_static_decode(vl):
    tok, processor, model = vl
    env = TokenEnv(mixed_items(), tok, batch_size=2, max_new_tokens=4, processor=processor, model_config=model.config)
    with pytest.raises(ValueError, match="decode='dynamic'"):
        TransformersPolicy(model, env, decode="static")


def test_a_text_prompt_through_a_vlm_policy_is_plain_text(vl):
    """No processor at all: a VLM steps text prompts as a text model (its delta stays 0)."""
    tok, _, model = vl
    env = TokenEnv(["1+1=", "hello"], tok, batch_size=2, group_size=2, max_new_tokens=6, model_config=model.config,
                   eos_token_ids=[])  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)
    batch = next(iter(collector))
    assert worst_gap(model, batch, collector.policy.sampling.banned_token_ids)[0] < 1e-5
    assert int(collector.policy.cache.delta.abs().sum()) == 0


def test_an_image_given_as_a_path_or_array_equals_the_pil_image(vl, tmp_path):
    tok, processor, model = vl
    item = shape_count_prompts(1, seed=2)[0]
    path = tmp_path / "shape.png"
    item["images"][0].save(path)
    import numpy as np

    images = []
    for given in (item["images"][0], str(path), np.asarray(item["images"][0])):
        env = TokenEnv([{**item, "images": [given]}], tok, batch_size=1, max_new_tokens=2, processor=processor,
                       model_config=model.config)  # fmt: skip
        env.reset()
        images.append(env.slot_prompt(0).images.digest)
    assert len(set(images)) == 1


def test_an_image_too_large_for_the_context_names_the_fix(vl):
    from tokengym.llm_envs.errors import PromptError

    tok, processor, model = vl
    item = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
            "images": [Image.new("RGB", (64, 64))]}  # fmt: skip
    for overlong in ("error", "truncate"):
        env = TokenEnv([item], tok, batch_size=1, max_new_tokens=4, max_length=40, processor=processor,
                       model_config=model.config, overlong_prompts=overlong)  # fmt: skip
        with pytest.raises(PromptError, match="max_pixels"):
            env.reset()


def test_a_qwen2_5_vl_steps_and_is_scored_exactly(vl):
    """The tiny Qwen2.5-VL (windowed vision attention, the same M-RoPE for images): stepping equals teacher forcing by
    hand, and the policy's own teacher forcing (the actors' path) equals the collected log-probs."""
    tok, processor, _ = vl
    model = tiny_vl_model(tok, family="qwen2_5_vl")
    collector = make((tok, processor, model), batch=4)
    batch = next(iter(collector))
    worst, counts = worst_gap(model, batch, collector.policy.sampling.banned_token_ids)
    assert worst < 1e-5 and max(counts) >= 1, (worst, counts)
    forced_by_policy = collector.policy.teacher_forced_log_probs(batch)
    mask = batch[keys.MASK]
    assert float((forced_by_policy[mask] - batch[keys.ACTION_LOG_PROB][mask]).abs().max()) < 1e-5
