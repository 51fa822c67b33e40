"""Starting a group: its prompt prefilled once and copied into the G slots, against today's batched prefill of the G
rows, and the start of one later sample from a held prompt against its own prefill.

Configurations: the small tiny Qwen2 (4 layers x 256, vocabulary 2,048) and a Qwen2 with the real vocabulary
(2 layers x 128, vocabulary 151,936), prompt P = 64, 512, 2048 tokens, G = 4, 8, 16 slots. Each contestant is the
KV cache's ``sync`` of G fresh slots (what a ``TransformersPolicy`` step does on a refill), contestants interleaved
per round, the median of the per-round ratios; one torch thread. Prints a markdown table at the end.
"""

from __future__ import annotations

import datetime
import functools
import platform
import statistics
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tokengym.collectors.policies import SlotKVCache
from tokengym.testing import tiny_model, tiny_tokenizer

ROUNDS = 5
_ROWS: list[tuple] = []


def _model(kind: str):
    tok = tiny_tokenizer()
    if kind == "small":
        return tiny_model(tok, size="small", max_positions=4096), "small Qwen2 4x256, vocab 2048"
    config = Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval(), "Qwen2 2x128, vocab 151936"


def _start(model, G: int, P: int, *, share: bool, held: bool = False):
    """A function that starts G slots on one prompt of P tokens (+1, fed by the first decode) in a fresh cache and
    returns the seconds the start took; with ``held`` an earlier sample prefilled the prompt first (not timed) and one
    slot starts."""
    gen = torch.Generator().manual_seed(P)
    prompt = torch.randint(3, 500, (P + 1,), generator=gen)
    rows = 1 if held else G
    tokens = prompt.expand(rows, -1).clone()
    seq_len, active = torch.full((rows,), P + 1), torch.ones(rows, dtype=torch.bool)

    def run() -> float:
        cache = SlotKVCache(model, rows, share_prefixes=share)
        if held:  # an earlier sample of the group: its prompt is in the store when sharing
            cache.sync(tokens, seq_len, torch.tensor([-2]), active)
        start = time.perf_counter()
        cache.sync(tokens, seq_len, torch.arange(rows), active)
        return time.perf_counter() - start

    return run


def _median_ratio(a, b) -> tuple[float, float, float]:
    times: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(ROUNDS + 1):
        for name, fn in (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a)):
            seconds = fn()
            if r:  # round 0 warms up
                times[name].append(seconds)
    ratios = [x / y for x, y in zip(times["a"], times["b"], strict=True)]
    return statistics.median(ratios), statistics.median(times["a"]), statistics.median(times["b"])


@pytest.fixture(scope="module", autouse=True)
def _report(write_uncaptured):
    yield
    if not _ROWS:
        return
    lines = ["", f"Shared prompt prefill, {datetime.date.today().isoformat()}, {platform.machine()}, torch "
             f"{torch.__version__}, median of {ROUNDS} interleaved rounds", "",
             "| model | P | G | case | shared ms | separate ms | shared ÷ separate |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {d} | {P} | {G} | {case} | {a * 1e3:.1f} | {b * 1e3:.1f} | {r:.3f} |" for d, P, G, case, a, b, r in _ROWS]
    write_uncaptured(lambda write: [write(line) for line in lines])


@pytest.mark.parametrize("kind", ["small", "qwen2-151k"])
@pytest.mark.parametrize("P", [64, 512, 2048])
@pytest.mark.parametrize("G", [4, 8, 16])
def test_group_start_shared_over_batched(kind, P, G):
    model, description = _model(kind)
    with torch.inference_mode():
        ratio, shared_s, separate_s = _median_ratio(_start(model, G, P, share=True), _start(model, G, P, share=False))
    _ROWS.append((description, P, G, "group starts together", shared_s, separate_s, ratio))
    assert ratio < 1.0  # one forward of the prompt instead of G


@pytest.mark.parametrize("P", [512, 2048])
def test_a_later_sample_from_a_held_prompt(P):
    model, description = _model("small")
    with torch.inference_mode():
        ratio, held_s, own_s = _median_ratio(_start(model, 8, P, share=True, held=True),
                                             _start(model, 8, P, share=False, held=True))  # fmt: skip
    _ROWS.append((description, P, 1, "a later sample (prompt held)", held_s, own_s, ratio))
    assert ratio < 1.0


def _iteration_seconds(run, patch_target, share: bool, monkeypatch) -> float:
    """Median seconds between consecutive iteration log lines of ``run`` (the demo or the recipe)."""
    from tokengym.collectors.policies import TransformersPolicy

    monkeypatch.setattr(patch_target, "TransformersPolicy", functools.partial(TransformersPolicy, share_prefixes=share))
    stamps: list[float] = []
    run(lambda *args, **kwargs: stamps.append(time.perf_counter()))
    monkeypatch.undo()
    return statistics.median(b - a for a, b in zip(stamps[2:], stamps[3:], strict=False))


@pytest.mark.parametrize("job", ["demo", "recipe"])
def test_demo_and_recipe_seconds_per_iteration(job, monkeypatch):
    """The jobs' seconds per iteration with the shared prefill on and off, alternating in one run (3 each)."""
    if job == "demo":
        from tokengym import _demo as module

        run = lambda log: module.train(module.DemoConfig(iterations=40, eval_every=1000), log=log)  # noqa: E731
    else:
        from tokengym import _recipe_reasoning_gym as module

        config = module.RecipeConfig(iterations=12, eval_every=1000, warm_start_steps=20, samples=1)
        run = lambda log: module.train(config, log=log)  # noqa: E731
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(3):
        for share in (True, False) if r % 2 == 0 else (False, True):
            times[share].append(_iteration_seconds(run, module, share, monkeypatch))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    _ROWS.append((f"the {job}'s iteration", "-", "-", "shared on / off", on, off, on / off))
