"""SlotKVCache and StaticSlotKVCache: per-slot refills, extensions, retries and trims give the logits of a plain
forward. The static cache runs every test in buffers of 10 columns, so its window is copied back to the front and its
buffers grow along the way."""

import pytest
import torch

from tokengym.collectors.policies import SlotKVCache, StaticSlotKVCache

L = 48  # the env's buffer length in these tests


@pytest.fixture(params=["dynamic", "static"])
def new_cache(request, model):
    if request.param == "dynamic":
        return lambda rows: SlotKVCache(model, rows)
    return lambda rows: StaticSlotKVCache(model, rows, capacity=10)


def _full_logits(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits after ``ids``, from one forward over the whole sequence (no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


class _Slots:
    """A stand-in for a TokenEnv's buffer and observation, tensors replaced (never mutated) when they change."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.tokens = torch.zeros(len(prompts), L, dtype=torch.int64)
        self.seq = [list(p) for p in prompts]
        self.traj = torch.arange(len(prompts))
        self.active = torch.ones(len(prompts), dtype=torch.bool)
        self.next_traj = len(prompts)
        for b, p in enumerate(prompts):
            self.tokens[b, : len(p)] = torch.tensor(p)

    def obs(self):
        return self.tokens, torch.tensor([len(s) for s in self.seq]), self.traj, self.active

    def last(self) -> torch.Tensor:
        return torch.tensor([s[-1] for s in self.seq])

    def append(self, b: int, ids: list[int]) -> None:
        self.tokens[b, len(self.seq[b]) : len(self.seq[b]) + len(ids)] = torch.tensor(ids)
        self.seq[b] += ids

    def refill(self, b: int, prompt: list[int]) -> None:
        self.tokens[b, : len(prompt)] = torch.tensor(prompt)
        self.seq[b] = list(prompt)
        self.traj = self.traj.clone()
        self.traj[b] = self.next_traj
        self.next_traj += 1


def _step(cache, slots: _Slots) -> torch.Tensor:
    tokens, seq_len, traj, active = slots.obs()
    cache.sync(tokens, seq_len, traj, active)
    return cache.decode(slots.last(), active)


def _check(model, cache, slots: _Slots, logits: torch.Tensor) -> None:
    for b, seq in enumerate(slots.seq):
        if bool(slots.active[b]):
            assert torch.allclose(logits[b], _full_logits(model, seq), atol=1e-4), b


def test_decoding_with_refills_matches_full_forwards_and_stays_narrow(model, new_cache):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20]]  # one-token prompts included
    slots, cache = _Slots(prompts), new_cache(4)
    widest = 0
    for t in range(14):
        logits = _step(cache, slots)
        _check(model, cache, slots, logits)
        action = logits.argmax(-1)
        for b in range(4):
            slots.append(b, [int(action[b])])
        if t % 4 == 1:  # slots finish at different steps; the new prompts have other lengths
            slots.refill(t % 3, [30 + t, 31, 32][: 1 + t % 3])
        widest = max(widest, cache.columns)
        longest = max(len(s) for s in slots.seq)
        assert cache.columns <= longest  # trimmed at every refill: never wider than the longest slot
    assert widest > 0
    if isinstance(cache, StaticSlotKVCache):  # a slot of 22 tokens outgrew the 10 columns: the buffers grew
        assert cache.capacity > 10 and cache.layout > 1


def test_env_inserted_tokens_and_idle_slots(model, new_cache):
    slots, cache = _Slots([[5, 6, 7], [8, 9, 10, 11]]), new_cache(2)
    _step(cache, slots)
    slots.append(0, [40])
    slots.append(1, [41])
    _check(model, cache, slots, _step(cache, slots))
    slots.append(0, [42, 43, 44, 45])  # feedback the env inserted (multi-turn)
    slots.append(1, [46])
    _check(model, cache, slots, _step(cache, slots))
    slots.active = torch.tensor([True, False])  # the source ran dry for slot 1: it idles
    slots.append(0, [47])
    logits = _step(cache, slots)
    _check(model, cache, slots, logits)
    assert bool(torch.isfinite(logits).all())  # an idle row attends to its own token: never fully masked
    assert all(bool(torch.isfinite(k).all() and torch.isfinite(v).all()) for k, v in cache.kv)


def test_a_retried_step_is_re_prefilled(model, new_cache):
    """A step the env rolled back (a reward error) and that is retried: the cache was one token ahead."""
    slots, cache = _Slots([[5, 6, 7], [8, 9]]), new_cache(2)
    first = _step(cache, slots)
    again = _step(cache, slots)  # the same observation again
    assert torch.allclose(first, again, atol=1e-5)
    assert cache.length.tolist() == [3, 2]


def test_clear_and_checkpoint_round_trip(model, new_cache):
    slots, cache = _Slots([[5, 6, 7], [8, 9, 10]]), new_cache(2)
    _step(cache, slots)
    slots.append(0, [20])
    slots.append(1, [21])
    state = cache.state_dict()
    restored = new_cache(2)
    restored.load_state_dict(state)
    assert torch.equal(_step(cache, slots), _step(restored, slots))  # exact, not re-prefilled
    held = cache.nbytes()
    cache.clear()
    static = isinstance(cache, StaticSlotKVCache)  # keeps its buffers (and a graph of them) through a clear
    assert cache.columns == 0 and cache.nbytes() == (held if static else 0)
    slots.append(0, [22])
    slots.append(1, [23])
    _check(model, cache, slots, _step(cache, slots))  # everything prefilled again


def test_a_waiting_slot_keeps_its_tokens_through_refills_and_wakes_exactly(model, new_cache):
    """Self-play: a slot waits (inactive, same trajectory) while others decode and are refilled, then wakes with the
    other player's move appended; an idle slot that moved on to a new trajectory forgets its tokens."""
    slots, cache = _Slots([[5, 6, 7], [8, 9, 10, 11], [12, 13]]), new_cache(3)
    slots.active = torch.tensor([True, False, True])  # slot 1 waits from the start: never prefilled yet
    for t in range(6):
        logits = _step(cache, slots)
        _check(model, cache, slots, logits)
        for b in (0, 2):
            slots.append(b, [20 + t])
        if t == 1:  # slot 1 wakes for its first turn; slot 0 waits from now on
            slots.append(1, [30, 31, 32])
            slots.active = torch.tensor([False, True, True])
        if t == 3:  # slot 2 ends and is refilled while slot 0 waits: slot 0's columns stay
            slots.refill(2, [40, 41, 42, 43, 44, 45, 46, 47, 48])
        if t >= 1:
            slots.append(1, [21 + t])
    state = cache.state_dict()  # a checkpoint while slot 0 waits
    slots.append(0, [50, 51, 52, 53])  # slot 0 wakes with the other player's move (several tokens)
    slots.active = torch.tensor([True, True, True])
    restored = new_cache(3)
    restored.load_state_dict(state)
    logits = _step(cache, slots)
    _check(model, cache, slots, logits)
    assert torch.equal(logits, _step(restored, slots))
    slots.active = torch.tensor([True, False, True])  # slot 1 waits a step, then wakes with one token (no prefill)
    for b in (0, 2):
        slots.append(b, [60])
    _check(model, cache, slots, _step(cache, slots))
    slots.append(1, [61])
    slots.active = torch.tensor([True, True, True])
    for b in (0, 2):
        slots.append(b, [62])
    _check(model, cache, slots, _step(cache, slots))
    # slot 1 moves on to a new trajectory while idle (a new seat that waits), then slot 2 is refilled: slot 1's old
    # tokens are forgotten, and its new trajectory is prefilled when it wakes
    slots.refill(1, [70, 71, 72])
    slots.active = torch.tensor([True, False, True])
    slots.refill(2, [73, 74])
    slots.append(0, [63, 64])  # and slot 0 gets env-inserted tokens (a cache realignment)
    _check(model, cache, slots, _step(cache, slots))
    assert cache.length[1] == 0
    slots.append(1, [75, 76])
    slots.active = torch.tensor([True, True, True])
    for b in (0, 2):
        slots.append(b, [65])
    _check(model, cache, slots, _step(cache, slots))
