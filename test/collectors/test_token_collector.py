import queue
import re

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from tokengym.collectors import CollectMode, CollectorOptions, TokenCollector
from tokengym.collectors.policies import SamplingConfig
from tokengym.llm_envs import PromptSource, keys


def _collect(collector, n):
    out = []
    for batch in collector:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_steps_batches_have_shape_b_t_and_keep_ids(make_env, make_policy):
    env = make_env(batch_size=3, max_new_tokens=5)
    collector = TokenCollector(env, make_policy(env), mode="steps", batch_size=4, total_steps=12)
    batches = list(collector)
    assert [tuple(b.shape) for b in batches] == [(3, 4)] * 3
    joined = torch.cat(batches, dim=1)
    traj, resp = joined["traj_id"], joined["response_len"]
    # along each slot, a trajectory's steps are contiguous with response_len 0, 1, 2...; ids survive batch ends
    same = traj[:, 1:] == traj[:, :-1]
    assert torch.equal(resp[:, 1:][same], resp[:, :-1][same] + 1)
    assert bool((resp[:, 1:][~same] == 0).all())
    assert batches[1]["traj_id"][:, 0].tolist() == batches[0]["traj_id"][:, -1].tolist() or bool(
        batches[0]["next", "done"][:, -1].any()
    )


def test_trajectory_batches_hold_complete_trajectories(make_env, make_policy):
    env = make_env(batch_size=3, max_new_tokens=6, eos_token_ids=[1, 5, 9, 13, 17])
    collector = TokenCollector(env, make_policy(env), mode=CollectMode.TRAJECTORIES, batch_size=5)
    for batch in _collect(collector, 3):
        mask = batch[keys.MASK]
        n = mask.sum(1)
        assert batch.shape[0] == 5
        assert torch.equal(mask, torch.arange(batch.shape[1]) < n[:, None])  # a prefix of each row
        done = batch["next", "done"].squeeze(-1) & mask
        assert done.sum(1).tolist() == [1] * 5 and bool(done[torch.arange(5), n - 1].all())
        assert bool((batch["response_len"][mask] < 6).all())
        assert bool((batch["traj_id"] == batch["traj_id"][:, :1])[mask].all())
        for key in ("action", ("next", "reward"), ("next", "done"), "action_log_prob"):  # padding is zeros
            assert not bool(batch[key].reshape(*mask.shape, -1)[~mask].any()), key


def test_prompt_table_reproduces_the_env_sequences(make_env, make_policy):
    env = make_env(batch_size=2, max_new_tokens=4)
    collector = TokenCollector(env, make_policy(env), mode="trajectories", batch_size=2)
    batch = next(iter(collector))
    table = batch.get_non_tensor(keys.PROMPTS)
    for row in range(2):
        gid = int(batch["group_id"][row, 0])
        seq = torch.cat([table.ids(gid), batch["action"][row][batch[keys.MASK][row]]])
        assert seq[: len(table.ids(gid))].tolist() == env.source.encode(env.source.prompts[gid], gid)[0].tolist()
        assert len(seq) == int(batch["next", "seq_len"][row][batch[keys.MASK][row]][-1])


def test_finite_sources_end_cleanly(tokenizer, make_env, make_policy):
    env = make_env(PromptSource(["a", "b", "c"], tokenizer, epochs=1), batch_size=2, max_new_tokens=3)
    batches = list(TokenCollector(env, make_policy(env), mode="trajectories", batch_size=2))
    assert [b.shape[0] for b in batches] == [2, 1]  # the last, shorter batch
    assert sorted(int(t) for b in batches for t in b["traj_id"][:, 0]) == [0, 1, 2]
    gen_env = make_env((p for p in ["x", "y"]), batch_size=2, max_new_tokens=3)
    steps = list(TokenCollector(gen_env, make_policy(gen_env), mode="steps", batch_size=2))
    assert sum(int(b[keys.MASK].sum()) for b in steps) == 6 and gen_env.is_exhausted


def test_postproc_metrics_and_total_steps(make_env, make_policy):
    env = make_env(batch_size=2, max_new_tokens=3)
    calls = []

    def postproc(batch):
        calls.append(batch.shape)
        batch.set("seen", torch.ones(batch.shape))
        return batch

    collector = TokenCollector(env, make_policy(env), mode="steps", batch_size=3, total_steps=9, postproc=postproc)
    batches = list(collector)
    assert len(calls) == 3 and all("seen" in b.keys() for b in batches)
    assert set(collector.metrics) >= {"tokens", "tokens_per_s", "finished", "mean_reward", "mean_response_len",
                                      "policy_version", "steps"}  # fmt: skip
    assert collector.metrics["steps"] == 9 and collector.metrics["tokens"] == 6


@pytest.mark.parametrize("kind", ["replay_buffer", "queue"])
def test_sinks_receive_batches(make_env, make_policy, kind):
    env = make_env(batch_size=2, max_new_tokens=3)
    sink = ReplayBuffer(storage=LazyTensorStorage(100)) if kind == "replay_buffer" else queue.Queue()
    yielded = list(TokenCollector(env, make_policy(env), mode="steps", batch_size=3, total_steps=6, sink=sink))
    assert yielded == [None, None]
    if kind == "queue":
        assert sink.qsize() == 2 and sink.get().shape == (2, 3)
    else:
        assert len(sink) == 4  # two (2, 3) batches stored along their first dim


def test_weight_updates_bump_versions(make_env, make_policy):
    env = make_env(batch_size=2, max_new_tokens=4)
    collector = TokenCollector(env, make_policy(env), mode="trajectories", batch_size=2)
    it = iter(collector)
    first = next(it)
    assert bool((first["policy_version"][first[keys.MASK]] == 0).all())
    assert collector.update_policy_weights_() == 1
    later = [next(it) for _ in range(3)]
    versions = torch.cat([b["policy_version"][b[keys.MASK]] for b in later])
    assert int(versions.max()) == 1
    for b in later:
        m = b[keys.MASK]
        start, end = b[keys.VERSION_START][:, 0], b[keys.VERSION_END][:, 0]
        assert torch.equal(start, b["policy_version"][:, 0])
        assert torch.equal(end, b["policy_version"][torch.arange(b.shape[0]), m.sum(1) - 1])


def test_last_step_only(make_env, make_policy):
    env = make_env(batch_size=2, max_new_tokens=4)
    batch = next(iter(TokenCollector(env, make_policy(env), mode="trajectories", batch_size=3,
                                     options=CollectorOptions(is_last_step_only=True))))  # fmt: skip
    assert batch.shape == (3,) and bool(batch["next", "done"].all())


@pytest.mark.parametrize("mode", ["steps", "trajectories"])
def test_resume_equals_uninterrupted(make_env, make_policy, mode):
    sampling = SamplingConfig(temperature=1.2, top_k=50)
    env_a = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=[1, 5, 9, 13], shuffle=True, seed=1)
    straight = _collect(TokenCollector(env_a, make_policy(env_a, sampling=sampling), mode=mode, batch_size=4), 5)

    env_b = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=[1, 5, 9, 13], shuffle=True, seed=1)
    first = TokenCollector(env_b, make_policy(env_b, sampling=sampling), mode=mode, batch_size=4)
    _collect(first, 2)
    state = first.state_dict()

    env_c = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=[1, 5, 9, 13], shuffle=True, seed=1)
    resumed = TokenCollector(env_c, make_policy(env_c, sampling=sampling, seed=123), mode=mode, batch_size=4)
    resumed.load_state_dict(state)
    for expected, got in zip(straight[2:], _collect(resumed, 3), strict=True):
        for key in expected.keys(True, True):
            if isinstance(expected.get(key), torch.Tensor):
                assert torch.equal(expected.get(key), got.get(key)), key


def test_long_run_memory_is_bounded(make_env, make_policy):
    env = make_env(batch_size=2, max_new_tokens=3)
    collector = TokenCollector(env, make_policy(env), mode="trajectories", batch_size=2)
    sizes = []
    for i, _ in enumerate(collector):
        sizes.append((len(collector.prompts), collector.policy.cache.nbytes(), len(collector.recorder.queued_trajectories())))
        if i == 300:
            break
    assert max(s[0] for s in sizes[50:]) <= max(s[0] for s in sizes[:50]) + 2
    assert max(s[1] for s in sizes[50:]) <= 1.5 * max(s[1] for s in sizes[:50])
    assert max(s[2] for s in sizes) <= 4


def test_bad_arguments(make_env, make_policy, model):
    env = make_env()
    policy = make_policy(env)
    with pytest.raises(ValueError, match=r"batch_size / frames_per_batch \(steps_per_batch \(env steps\)\) must be a positive int, got 0"):
        TokenCollector(env, policy, mode="steps", batch_size=0)
    with pytest.raises(ValueError, match=r"mode must be one of \['steps', 'trajectories'\], got 'frames'"):
        TokenCollector(env, policy, mode="frames", batch_size=2)
    with pytest.raises(ValueError, match=r"is_last_step_only=True needs mode='trajectories'"):
        TokenCollector(env, policy, mode="steps", batch_size=2, options=CollectorOptions(is_last_step_only=True))  # fmt: skip
    loose = re.escape("got collector options as keyword arguments (is_last_step_only, in_flight): pass "
                      "options=CollectorOptions(is_last_step_only=..., in_flight=...)")  # fmt: skip
    with pytest.raises(TypeError, match=loose):
        TokenCollector(env, policy, mode="steps", batch_size=2, is_last_step_only=True, in_flight="drop")
    with pytest.raises(TypeError, match=r"got unexpected arguments \['frames'\]; see its docstring"):
        TokenCollector(env, policy, mode="steps", batch_size=2, frames=3, use_progress_bar=True)
    with pytest.raises(TypeError, match=r"sink must be a ReplayBuffer \(extend\) or a queue \(put\), got object"):
        TokenCollector(env, policy, mode="steps", batch_size=2, sink=object())
    with pytest.raises(ValueError, match=r"total_steps must be a positive int or -1 \(endless\), got 0"):
        TokenCollector(env, policy, mode="steps", batch_size=2, total_steps=0)
    with pytest.raises(TypeError, match=r"env must be a TokenEnv or a TransformedEnv of one, got str"):
        TokenCollector("env", policy, mode="steps", batch_size=2)
    with pytest.raises(TypeError, match=r"postproc must be callable on a TensorDict"):
        TokenCollector(env, policy, mode="steps", batch_size=2, postproc=3)


def test_update_asked_while_another_is_being_applied_gets_the_next_version(make_env, make_policy):
    """The version update_policy_weights_ returns counts an update that is being applied in the collecting
    thread (it has left the queue, the policy's version has not moved yet)."""
    import threading

    env = make_env()
    policy = make_policy(env)
    collector = TokenCollector(env, policy, mode="steps", batch_size=2, total_steps=4)
    entered, release = threading.Event(), threading.Event()
    update = policy.update_weights

    def slow_update(weights=None):
        entered.set()
        release.wait(10)
        update(weights)

    policy.update_weights = slow_update
    v0 = policy.version
    collector._collect_thread = -1  # as if another thread iterated: updates are queued, not applied here
    assert collector.update_policy_weights_() == v0 + 1
    applier = threading.Thread(target=collector._apply_queued_weights)
    applier.start()
    assert entered.wait(10)
    assert collector.update_policy_weights_() == v0 + 2  # the first is still being applied
    release.set()
    applier.join()
    collector._apply_queued_weights()
    assert policy.version == v0 + 2
