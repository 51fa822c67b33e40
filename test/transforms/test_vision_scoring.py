"""Teacher forcing and training of a vision-language model (Qwen2-VL) on batches whose prompts have images: the
actors, the reference log-probs and micro-batches take each row's images and M-RoPE positions, exactly."""

import copy

import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym._micro_batches import micro_batches
from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    PolicyWithReference,
    SequenceActor,
    SharedPrefixActor,
    StepwiseReference,
    TransformersPolicy,
)
from tokengym.llm_envs import TokenEnv, keys, mrope_positions
from tokengym.llm_envs.tasks.visual import digit_reading_prompts, shape_count_prompts
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.testing import tiny_model, tiny_vl_model, tiny_vl_processor, tiny_vl_tokenizer
from tokengym.training import TrainOptions, train, train_step
from tokengym.transforms import (
    GroupAdvantage,
    KLRewardTransform,
    sequence_log_probs,
    step_log_probs,
    to_padded,
)
from tokengym.transforms.token_log_probs import final_hidden_states

TOL = 1e-5


def _reward(responses, prompts, metadata):
    return torch.tensor([float(len(r)) for r in responses])  # responses of several lengths: nonzero advantages


def _items():
    """Prompts with one image, two images and none."""
    items = shape_count_prompts(3, seed=1) + [{"prompt": "no image here", "answer": "1"}]
    items[1]["images"].append(items[2]["images"][0])
    items[1]["prompt"][0]["content"].insert(0, {"type": "image"})
    return items


def _collector(tok, model, *, seed=1):
    env = TokenEnv(_items(), tok, _reward, batch_size=4, max_new_tokens=8, processor=tiny_vl_processor(tok),
                   model_config=model.config, group_size=2, eos_token_ids=list(range(100, 130)), seed=seed)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=seed)
    return TokenCollector(env, policy, mode="trajectories", batch_size=8), policy


@pytest.fixture(scope="module")
def tok():
    return tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def run(tok):
    torch.manual_seed(0)
    model = tiny_vl_model(tok).eval()
    collector, policy = _collector(tok, model)
    batch = next(iter(collector))
    return model, policy, batch


def _table(batch):
    return batch.get_non_tensor(keys.PROMPTS)


def _images_per_row(batch):
    table = _table(batch)
    return [0 if table.images(g) is None else table.images(g).num_images for g in batch[keys.GROUP_ID][:, 0].tolist()]


def _by_hand(model, batch, banned=None, *, with_images=True):
    """Each row teacher-forced alone: ``model(full sequence, M-RoPE positions, its images)``, no layout helpers
    (``with_images=False``: the image tokens scored without the images, what dropping them would give)."""
    table, out = _table(batch), torch.zeros(batch.shape)
    image_id, merge = model.config.image_token_id, model.config.vision_config.spatial_merge_size
    for row in range(batch.shape[0]):
        group, mask = int(batch[keys.GROUP_ID][row, 0]), batch[keys.MASK][row]
        prompt, actions, images = table.ids(group), batch[keys.ACTION][row][mask], table.images(group)
        full = torch.cat([prompt, actions])
        grid = None if images is None else images.image_grid_thw
        positions, _ = mrope_positions(full, grid, image_token_id=image_id, merge_size=merge)
        extra = {} if images is None or not with_images else images.model_inputs()
        with torch.no_grad():
            logits = model(input_ids=full[None], position_ids=positions[:, None], **extra).logits[0].float()
        if banned is not None:
            logits = logits.index_fill(-1, torch.tensor(banned), -float("inf"))
        logp = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(-1, actions[:, None]).squeeze(-1)
        out[row, : len(actions)] = logp
    return out


def _gap(a, b, mask):
    return float(((a - b) * mask).abs().max())


def test_the_batch_has_rows_with_zero_one_and_two_images(run):
    _, _, batch = run
    assert {0, 1, 2} <= set(_images_per_row(batch))
    assert len(set(batch[keys.MASK].sum(-1).tolist())) > 1  # responses of several lengths: padding in every layout


def test_the_actors_reproduce_the_collected_log_probs(run):
    model, policy, batch = run
    collected, mask = batch[keys.ACTION_LOG_PROB], batch[keys.MASK]
    padded = to_padded(batch)
    generated = padded[keys.ACTION_MASK]
    with torch.no_grad():
        gaps = {
            "by_hand": _gap(_by_hand(model, batch, policy.sampling.banned_token_ids), collected, mask),
            "SequenceActor": _gap(SequenceActor(model).log_prob(batch), collected, mask),
            "SequenceActor(full_logits)": _gap(SequenceActor(model, full_logits=True).log_prob(batch), collected, mask),
            "teacher_forced_log_probs": _gap(policy.teacher_forced_log_probs(batch), collected, mask),
            "PaddedSequenceActor": _gap(PaddedSequenceActor(model).log_prob(padded), padded[keys.LOG_PROBS], generated),
            "PaddedSequenceActor(full_logits)": _gap(PaddedSequenceActor(model, full_logits=True).log_prob(padded),
                                                     padded[keys.LOG_PROBS], generated),  # fmt: skip
        }
    assert max(gaps.values()) < TOL, gaps


def test_the_reference_log_probs_take_the_images(run):
    model, _, batch = run
    mask = batch[keys.MASK]
    expected = _by_hand(model, batch)  # the reference scores without the sampler's banned tokens
    kl = KLRewardTransform(ref_model=model)(batch.clone())
    assert _gap(step_log_probs(model, batch), expected, mask) < TOL
    assert _gap(kl[keys.REF_LOG_PROB], expected, mask) < TOL
    assert _gap(_by_hand(model, batch, with_images=False), expected, mask) > 1e-3  # the images change the answer


@pytest.mark.parametrize("split", [{"max_rows": 3}, {"max_tokens": 240}])
def test_micro_batches_score_with_their_own_rows_images(run, split):
    model, _, batch = run
    padded = to_padded(batch)
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    with torch.no_grad():
        parts = micro_batches(padded, loss, **split)
        assert len(parts) > 1
        seen = 0
        for part in parts:
            data = part.data
            lp = PaddedSequenceActor(model).log_prob(data)
            generated = data[keys.ACTION_MASK]
            assert _gap(lp, data[keys.LOG_PROBS], generated) < TOL
            seen += int(generated.sum())
        assert seen == int(padded[keys.ACTION_MASK].sum())
        ppo = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)
        steps = micro_batches(batch, ppo, max_rows=3)  # the step layout
        for part in steps:
            data = part.data
            assert _gap(SequenceActor(model).log_prob(data), data[keys.ACTION_LOG_PROB], data[keys.MASK]) < TOL


def test_a_vision_model_scores_rows_without_images_as_text(run):
    model, _, batch = run
    table = _table(batch)
    text = [g for g in batch[keys.GROUP_ID][:, 0].unique().tolist() if table.images(g) is None]
    rows = torch.isin(batch[keys.GROUP_ID][:, 0], torch.tensor(text))
    sub = batch[rows]
    sub.set_non_tensor(keys.PROMPTS, table.subset(text))
    assert not _table(sub).has_images
    with torch.no_grad():
        lp = SequenceActor(model).log_prob(sub)
        shared = SharedPrefixActor(model).log_prob(to_padded(sub))
    assert _gap(lp, sub[keys.ACTION_LOG_PROB], sub[keys.MASK]) < TOL
    padded = to_padded(sub)
    assert _gap(shared, padded[keys.LOG_PROBS], padded[keys.ACTION_MASK]) < TOL


def test_a_text_only_model_is_refused_a_batch_with_images(run, tok):
    _, _, batch = run
    text_model = tiny_model(tok)
    with torch.no_grad():
        for score in (lambda: SequenceActor(text_model).log_prob(batch),
                      lambda: PaddedSequenceActor(text_model).log_prob(to_padded(batch)),
                      lambda: step_log_probs(text_model, batch),
                      lambda: KLRewardTransform(ref_model=text_model)(batch.clone())):  # fmt: skip
            with pytest.raises(ValueError, match="is text only, so it would score the image tokens without the images"):
                score()
        pixels = _table(batch).images(int(batch[keys.GROUP_ID][0, 0])).model_inputs()
        with pytest.raises(ValueError, match="got images .pixel_values. but .* is text only"):
            final_hidden_states(text_model, input_ids=batch[keys.ACTION][:1], **pixels)


def test_image_tokens_without_their_images_are_refused(run):
    model, _, batch = run
    table = _table(batch)
    group = next(g for g in batch[keys.GROUP_ID][:, 0].tolist() if table.images(g) is not None)
    ids = table.ids(group)[None]
    with torch.no_grad(), pytest.raises(ValueError, match="row 0 holds image tokens but no images were given"):
        sequence_log_probs(model, ids, torch.ones_like(ids))
    with torch.no_grad(), pytest.raises(ValueError, match="got image tokens but no images"):
        final_hidden_states(model, input_ids=ids)
    other = next(g for g in table.group_ids() if table.images(g) is not None and g != group
                 and table.images(g).num_images != table.images(group).num_images)  # fmt: skip
    with torch.no_grad(), pytest.raises(ValueError, match="row 0's tokens do not match the images of its prompt"):
        sequence_log_probs(model, ids, torch.ones_like(ids), images=[table.images(other)])


def test_the_shared_prefix_actor_refuses_a_batch_with_images(run):
    model, _, batch = run
    with torch.no_grad(), pytest.raises(ValueError, match=r"PaddedSequenceActor\(model\) on to_padded\(batch\)"):
        SharedPrefixActor(model).log_prob(to_padded(batch))


def _grpo_data(batch):
    return to_padded(GroupAdvantage("grpo")(batch.clone()))


@pytest.mark.parametrize("is_frozen", [False, True])
def test_the_vision_tower_trains_unless_frozen(run, is_frozen):
    model, _, batch = run
    model = copy.deepcopy(model)
    visual = model.model.visual
    visual.requires_grad_(not is_frozen)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    row = train_step(_grpo_data(batch), loss, optim, options=TrainOptions(micro_batch_rows=3))
    assert torch.isfinite(torch.tensor(row["loss"]))
    grads = [p.grad for p in visual.parameters()]
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    if is_frozen:
        assert all(g is None for g in grads)
        assert changed and not any(name.startswith("model.visual.") for name in changed)
    else:
        assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)
        assert any(name.startswith("model.visual.") for name in changed)


def test_one_grpo_iteration_on_a_vision_collector_changes_the_weights(tok):
    torch.manual_seed(0)
    model = tiny_vl_model(tok, seed=3)
    collector, policy = _collector(tok, model, seed=2)
    before = [p.detach().clone() for p in model.parameters()]
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    rows = train(collector, loss, optim, iterations=1, prepare=_grpo_data,
                 options=TrainOptions(micro_batch_tokens=240))  # fmt: skip
    assert len(rows) == 1 and policy.version == 1
    assert sum(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)) > len(before) // 2


def test_a_stepwise_reference_prefills_with_the_images(tok):
    model = tiny_vl_model(tok).eval()
    env = TokenEnv(_items(), tok, _reward, batch_size=4, max_new_tokens=4, processor=tiny_vl_processor(tok),
                   model_config=model.config, group_size=2, seed=1)  # fmt: skip
    policy = PolicyWithReference(TransformersPolicy(model, env, seed=1), StepwiseReference(model, env))
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=8)))
    assert _gap(batch[keys.REF_LOG_PROB], _by_hand(model, batch), batch[keys.MASK]) < TOL
    with pytest.raises(ValueError, match="is text only"):
        StepwiseReference(tiny_model(tok), env)


class _ShowsABoard(TurnHandler):
    """Answers an episode's first turn with an image to read and ends it after the second."""

    def __init__(self):
        self.boards = [item["images"][0] for item in digit_reading_prompts(2, seed=3)]

    def end_turns(self, turns):
        look = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this one?"}]}]
        return [Turn(0.0, feedback=look, images=[self.boards[episode % 2]]) if turn == 0 else Turn(1.0)
                for episode, turn in zip(turns.episodes, turns.turns, strict=True)]  # fmt: skip


def test_multi_turn_rows_keep_their_trajectorys_images(tok):
    """Rows whose feedback showed an image (a text prompt's too) are scored with all their trajectory's images."""
    model = tiny_vl_model(tok).eval()
    items = [*shape_count_prompts(1, seed=1), {"prompt": "text only prompt"}]
    env = TokenEnv(items, tok, turns=_ShowsABoard(), max_turns=2, batch_size=4, group_size=2, max_new_tokens=8,
                   max_turn_tokens=3, processor=tiny_vl_processor(tok), model_config=model.config, max_length=300)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=1)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
    table = _table(batch)
    counts = {table.trajectory_images(int(t), int(g)).num_images
              for t, g in zip(batch[keys.TRAJ_ID][:, 0], batch[keys.GROUP_ID][:, 0], strict=True)}  # fmt: skip
    assert counts == {1, 2} and int(batch[keys.TURN].max()) == 1
    padded = to_padded(batch)
    with torch.no_grad():
        gaps = {"SequenceActor": _gap(SequenceActor(model).log_prob(batch), batch[keys.ACTION_LOG_PROB], batch[keys.MASK]),
                "PaddedSequenceActor": _gap(PaddedSequenceActor(model).log_prob(padded), padded[keys.LOG_PROBS],
                                            padded[keys.ACTION_MASK])}  # fmt: skip
    assert max(gaps.values()) < TOL, gaps
