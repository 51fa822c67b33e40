"""Visual tasks with a verifiable answer, their images drawn at run time (no data files, no fonts): count the red
squares among blue squares and red circles; read a number drawn in seven-segment strokes. Each item is a prompt with
its images, ``{"prompt": messages, "images": [PIL image], "answer": "3"}``, for a vision-language model's processor and
:class:`~tokengym.llm_envs.rewards.MathAnswerReward` (the answer as the response's number).

Example:
    >>> items = shape_count_prompts(5, seed=0)
    >>> [item["answer"] for item in items], items[0]["images"][0].size, items[0]["prompt"][0]["content"][0]
    (['0', '0', '1', '3', '3'], (48, 48), {'type': 'image'})
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from tokengym.llm_envs.tasks._common import check_positive_int

__all__ = ["digit_reading_prompts", "shape_count_prompts"]

RED, BLUE, WHITE = (220, 0, 0), (0, 0, 220), (255, 255, 255)
_SEGMENTS = {0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg", 5: "acdfg", 6: "acdefg", 7: "abc",
             8: "abcdefg", 9: "abcdfg"}  # fmt: skip


def _item(image: Image.Image, question: str, answer: int) -> dict:
    content = [{"type": "image"}, {"type": "text", "text": question}]
    return {"prompt": [{"role": "user", "content": content}], "images": [image], "answer": str(answer)}


def shape_count_prompts(n: int, *, seed: int = 0, size: int = 48, cell: int = 12, max_count: int = 4,
                        distractors: int = 3) -> list[dict]:  # fmt: skip
    """``n`` seeded images of ``size`` x ``size`` pixels, a grid of ``cell``-pixel cells holding 0 to ``max_count``
    red squares and ``distractors`` blue squares or red circles; the answer is the number of red squares."""
    for name, value in (("n", n), ("size", size), ("cell", cell), ("max_count", max_count)):
        check_positive_int(name, value)
    cells = (size // cell) ** 2
    if max_count + distractors > cells:
        raise ValueError(f"{max_count} squares and {distractors} distractors need {max_count + distractors} cells, "
                         f"but a {size}-pixel image of {cell}-pixel cells has {cells}: enlarge size or lower the counts")  # fmt: skip
    out = []
    for i in range(n):
        rng = random.Random(f"shapes-{seed}-{i}")
        k = rng.randint(0, max_count)
        side = size // cell
        spots = rng.sample([(x, y) for x in range(side) for y in range(side)], k + distractors)
        image = Image.new("RGB", (size, size), WHITE)
        draw = ImageDraw.Draw(image)
        for j, (x, y) in enumerate(spots):
            box = (x * cell + 2, y * cell + 2, (x + 1) * cell - 3, (y + 1) * cell - 3)
            if j < k:
                draw.rectangle(box, fill=RED)
            elif rng.random() < 0.5:
                draw.rectangle(box, fill=BLUE)
            else:
                draw.ellipse(box, fill=RED)
        out.append(_item(image, "How many red squares? Answer with a number.", k))
    return out


def digit_reading_prompts(n: int, *, seed: int = 0, max_value: int = 99) -> list[dict]:
    """``n`` seeded 48 x 32 images of a number in ``[0, max_value]`` (1 or 2 digits) drawn in seven-segment strokes
    of a dark colour at a random place; the answer is the number."""
    check_positive_int("n", n)
    if isinstance(max_value, bool) or not isinstance(max_value, int) or not 0 <= max_value <= 99:
        raise ValueError(f"max_value must be an int in [0, 99] (one or two digits), got {max_value!r}")
    out = []
    for i in range(n):
        rng = random.Random(f"digits-{seed}-{i}")
        value = rng.randint(0, max_value)
        image = Image.new("RGB", (48, 32), WHITE)
        draw = ImageDraw.Draw(image)
        digits = [int(c) for c in str(value)]
        w, h, t, gap = 12, 22, 3, 4
        x0, y0 = rng.randint(1, 48 - len(digits) * (w + gap)), rng.randint(1, 32 - h - 1)
        color = tuple(rng.randint(0, 90) for _ in range(3))
        for j, digit in enumerate(digits):
            x, y, half = x0 + j * (w + gap), y0, h // 2
            segments = {"a": (x, y, x + w, y + t), "d": (x, y + h - t, x + w, y + h),
                        "g": (x, y + half - t // 2, x + w, y + half + t // 2), "f": (x, y, x + t, y + half),
                        "b": (x + w - t, y, x + w, y + half), "e": (x, y + half, x + t, y + h),
                        "c": (x + w - t, y + half, x + w, y + h)}  # fmt: skip
            for segment in _SEGMENTS[digit]:
                draw.rectangle(segments[segment], fill=color)
        out.append(_item(image, "What number is shown? Answer with the number.", value))
    return out
