"""Built-in reward functions: ``fn(responses, prompts, metadata) -> float32 tensor``, one value per response.

Each is a small class so its options are checked once, at construction, and it can be passed to
:class:`~tokengym.llm_envs.token_env.TokenEnv` as ``reward_fn``.

Example:
    >>> reward = MathAnswerReward()
    >>> reward(["so it is \\\\boxed{19}", "I think 20."], ["12+7=", "12+7="], [{"answer": "19"}] * 2)
    tensor([1., 0.])
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import threading
from collections.abc import Callable, Sequence

import torch

from tokengym.llm_envs.reward_errors import RewardErrors
from tokengym.llm_envs.trl_rewards import as_reward_fn

__all__ = [
    "CombinedReward",
    "FormatReward",
    "MathAnswerReward",
    "RewardModelReward",
    "extract_answer",
    "last_boxed",
    "normalize_answer",
]

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_BOXED = "\\boxed{"
_INT = re.compile(r"[-+]?\d+")
# a response that is only an integer: "19", " -3.", "\boxed{19}", "$19$"
_ONLY_INT = re.compile(r"\s*\$?\s*(?:\\boxed\{\s*([-+]?\d+)\s*\}|([-+]?\d+))\s*\$?\s*\.?\s*")
_DIGIT = re.compile(r"\d")
_VERIFIERS = ("math_verify", "exact")


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _int_text(text: str) -> str:
    """An integer string (``[-+]?\\d+``) in canonical form, of any length: int() refuses over 4300 digits.

    Example:
        >>> _int_text("-007"), _int_text("+0"), _int_text("19")
        ('-7', '0', '19')
    """
    sign, digits = ("-" if text[0] == "-" else ""), text.lstrip("+-")
    if not digits.isascii():  # \d also matches other scripts' digits, which int() reads
        digits = "".join(str(int(c)) for c in digits)
    digits = digits.lstrip("0")
    return sign + digits if digits else "0"


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces may nest), or ``None`` (none, or unclosed).

    Example:
        >>> last_boxed("\\\\boxed{1} then \\\\boxed{\\\\frac{1}{2}}"), last_boxed("\\\\boxed{3")
        ('\\\\frac{1}{2}', None)
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: not an answer


def extract_answer(text: str) -> str | None:
    """The answer in a response: the last ``\\boxed{...}`` content, else the last number, else ``None``.

    Example:
        >>> extract_answer("3 + 4 = 7, so \\\\boxed{7}"), extract_answer("it is 1,024."), extract_answer("no")
        ('7', '1,024', None)
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer) -> str:
    """Canonical form for exact matching: strip spaces, ``$``, commas, a leading ``+``, a trailing ``.0``.

    Example:
        >>> normalize_answer(" +1,000.0 "), normalize_answer("-3."), normalize_answer(19)
        ('1000', '-3', '19')
    """
    text = str(answer).strip().strip("$").replace(",", "").replace(" ", "")
    text = text.removeprefix("+").rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text[: text.index(".")]
    return "0" if text == "-0" else text


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int | None) -> tuple:
    """math-verify's parse of a reference answer, read as LaTeX math (answers repeat across a group: cached)."""
    from math_verify import parse

    is_latex_text = "$" in gold or _BOXED in gold
    parsed = parse(gold if is_latex_text else f"${gold}$", parsing_timeout=timeout_s)
    return tuple(parsed or parse(gold, parsing_timeout=timeout_s))


class MathAnswerReward:
    """Math answer verifier: ``correct`` if the response's answer equals ``metadata[answer_key]``.

    With ``verifier="math_verify"`` (the default) answers are compared by HuggingFace
    `math-verify <https://github.com/huggingface/Math-Verify>`_, the verifier TRL and Open-R1 use:
    it finds the answer (``\\boxed{}``, ``$...$``, "the answer is ...", the last expression) and
    compares values, so ``\\frac{1}{2}`` equals ``0.5``, ``10^{3}`` equals ``1000``,
    ``\\text{(B)}`` equals ``B``, ``x=4`` equals ``4`` and ``4\\%`` equals ``0.04``. A response
    that is only an integer (``"19"``, ``"\\boxed{19}"``) against an integer reference is compared
    exactly, without math-verify (microseconds instead of about a millisecond); so is a response
    with no digit at all against an integer reference (always wrong).

    ``verifier="exact"`` takes the last ``\\boxed{...}`` or else the last number and compares the
    strings after ``normalize_answer``. It suits tasks whose answers are plain numbers and where
    an unevaluated expression must not count (math-verify accepts ``3+4`` for ``7``).

    math-verify bounds parsing and comparing with ``signal.alarm`` (``timeout_s`` each), which only
    works on the main thread; on other threads (e.g. a background collector) it runs without a time
    limit.

    Args:
        answer_key: the metadata field holding the reference answer.
        correct: reward of a matching answer.
        wrong: reward of a wrong or missing answer.
        verifier: ``"math_verify"`` or ``"exact"``.
        timeout_s: seconds math-verify may spend parsing or comparing one answer (whole seconds, >= 1).

    Attributes:
        counts: ``{"reward_errors": n}``, responses the verifier raised on (scored ``wrong``; the first is
            logged under ``tokengym.rewards``). A :class:`TokenEnv` adds it to ``prompt_counts``, so it
            appears in the collector's metrics.

    Raises:
        KeyError: at call time, if a metadata dict lacks ``answer_key``.
        ImportError: at construction, for ``verifier="math_verify"`` without the ``math-verify`` package.

    Example:
        >>> reward = MathAnswerReward(correct=2.0)
        >>> reward(["7", "x", "so \\\\boxed{\\\\frac{1}{2}}"], [""] * 3, [{"answer": 7}, {"answer": 7}, {"answer": "0.5"}])
        tensor([2., 0., 2.])
        >>> MathAnswerReward(verifier="exact")(["3+4", "7"], [""] * 2, [{"answer": 7}] * 2)
        tensor([0., 1.])
    """

    def __init__(
        self,
        answer_key: str = "answer",
        *,
        correct: float = 1.0,
        wrong: float = 0.0,
        verifier: str = "math_verify",
        timeout_s: int = 5,
    ) -> None:
        if not isinstance(answer_key, str) or not answer_key:
            raise TypeError(f"answer_key must be a non-empty string (a metadata field), got {answer_key!r}")
        if verifier not in _VERIFIERS:
            raise ValueError(f"verifier must be one of {_VERIFIERS}, got {verifier!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"timeout_s must be an int >= 1 (math-verify's alarm counts whole seconds), got {timeout_s!r}")
        if verifier == "math_verify" and importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                "MathAnswerReward(verifier='math_verify') needs the math-verify package: "
                "pip install 'math-verify[antlr4_13_2]', or use verifier='exact'"
            )
        self.answer_key = answer_key
        self.correct = _check_number("correct", correct)
        self.wrong = _check_number("wrong", wrong)
        self.verifier, self.timeout_s = verifier, timeout_s
        self.errors = RewardErrors()
        self.counts = self.errors.counts

    def is_correct(self, response: str, answer) -> bool:
        """Whether ``response`` gives ``answer`` (the reference), with this reward's verifier.

        A response the verifier raises on is wrong, counted in ``counts`` (``reward_errors``).

        Example:
            >>> MathAnswerReward().is_correct("The answer is 5. Check: 5+2=7", "5")
            True
        """
        try:
            return self._is_correct(response, answer)
        except Exception as err:  # a model's output never stops a run: it scores `wrong`, counted
            self.errors.record(type(self).__name__, response, err)
            return False

    def _is_correct(self, response: str, answer) -> bool:
        if self.verifier == "exact":
            found = extract_answer(response)
            return found is not None and normalize_answer(found) == normalize_answer(answer)
        gold = str(answer).strip()
        if _INT.fullmatch(gold):  # the fast exact path: integer reference, integer-only response
            only = _ONLY_INT.fullmatch(response)
            if only is not None:
                return _int_text(only.group(1) or only.group(2)) == _int_text(gold)
            if _DIGIT.search(response) is None:
                return False
        from math_verify import parse, verify

        timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else None
        gold_parsed = _parse_gold(gold, timeout)
        if not gold_parsed:
            return False
        return verify(list(gold_parsed), parse(response, parsing_timeout=timeout), timeout_seconds=timeout)

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        out = []
        for response, meta in zip(responses, metadata, strict=True):
            if self.answer_key not in meta:
                raise KeyError(
                    f"{type(self).__name__} reads metadata[{self.answer_key!r}] but the prompt's metadata has "
                    f"keys {sorted(meta)}; give prompts as {{'prompt': ..., {self.answer_key!r}: ...}} "
                    "or set answer_key"
                )
            out.append(self.correct if self.is_correct(response, meta[self.answer_key]) else self.wrong)
        return torch.tensor(out, dtype=torch.float32)


class FormatReward:
    """``value`` for responses that match a regex (``re.search``), 0 otherwise.

    Args:
        pattern: a regex; the default asks for a ``\\boxed{...}`` answer. Use
            ``r"<answer>.*?</answer>"`` for answer tags.
        value: reward of a matching response.
        flags: ``re`` flags (``re.DOTALL`` by default so ``.`` spans lines).

    Example:
        >>> FormatReward(r"<answer>.*?</answer>", value=0.5)(["<answer>4</answer>", "4"], ["", ""], [{}, {}])
        tensor([0.5000, 0.0000])
    """

    def __init__(self, pattern: str = r"\\boxed\{.*?\}", *, value: float = 1.0, flags: int = re.DOTALL) -> None:
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a regex string, got {type(pattern).__name__} {pattern!r}")
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as err:
            raise ValueError(f"pattern {pattern!r} is not a valid regex ({err}); escape special characters") from err
        self.value = _check_number("value", value)

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        return torch.tensor([self.value if self.regex.search(r) else 0.0 for r in responses], dtype=torch.float32)


class RewardModelReward:
    """Scores ``prompt + response`` with a sequence-classification model that has one label (its logit).

    Texts are left-padded and scored ``batch_size`` at a time, one forward each, under ``torch.no_grad``.

    Args:
        model: a transformers ``*ForSequenceClassification`` model with ``config.num_labels == 1``.
        tokenizer: its tokenizer (needs a pad token).
        batch_size: texts per forward pass; ``None`` scores all at once.
        max_length: truncate longer texts (from the left, keeping the response); ``None``: no limit.

    Example:
        >>> from tokengym.testing import tiny_reward_model, tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> rm = RewardModelReward(tiny_reward_model(tok), tok)
        >>> rm(["19", "20"], ["12+7=", "12+7="], [{}, {}]).shape
        torch.Size([2])
    """

    def __init__(self, model, tokenizer, *, batch_size: int | None = None, max_length: int | None = None) -> None:
        config = getattr(model, "config", None)
        num_labels = getattr(config, "num_labels", None)
        if num_labels != 1:
            raise ValueError(
                f"the reward model must output one score (config.num_labels == 1), got num_labels={num_labels}; "
                "load it with num_labels=1"
            )
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("the tokenizer has no pad_token_id; set tokenizer.pad_token = tokenizer.eos_token")
        if getattr(config, "pad_token_id", None) is None:
            raise ValueError(
                "model.config.pad_token_id is None, so the model cannot find the last token of a padded text; "
                "set model.config.pad_token_id = tokenizer.pad_token_id"
            )
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = batch_size, max_length

    @torch.no_grad()
    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        device = next(self.model.parameters()).device
        step = self.batch_size or max(len(texts), 1)
        scores = []
        for i in range(0, len(texts), step):
            ids = self.tokenizer(texts[i : i + step], add_special_tokens=False)["input_ids"]
            input_ids, mask = self._left_pad([row[-self.max_length :] if self.max_length else row for row in ids])
            logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits  # (B, 1)
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        T = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.int64)  # (B, T)
        mask = torch.zeros(len(rows), T, dtype=torch.int64)  # (B, T)
        for b, row in enumerate(rows):
            if row:
                input_ids[b, T - len(row) :] = torch.tensor(row)
                mask[b, T - len(row) :] = 1
        return input_ids, mask


class CombinedReward:
    """Weighted sum of reward functions.

    Args:
        reward_fns: the reward functions, each ``fn(responses, prompts, metadata) -> floats`` or a TRL
            reward function ``f(prompts, completions, **columns)`` (called as TRL calls it).
        weights: one weight per function; ``None`` weighs each by 1.

    Example:
        >>> both = CombinedReward([MathAnswerReward(), FormatReward(value=1.0)], weights=[1.0, 0.1])
        >>> both(["\\\\boxed{4}", "4"], ["2+2=", "2+2="], [{"answer": "4"}] * 2)
        tensor([1.1000, 1.0000])
    """

    def __init__(self, reward_fns: Sequence[Callable], weights: Sequence[float] | None = None) -> None:
        if not isinstance(reward_fns, Sequence) or len(reward_fns) == 0:
            raise ValueError(f"reward_fns must be a non-empty list of reward functions, got {reward_fns!r}")
        for fn in reward_fns:
            if not callable(fn):
                raise TypeError(f"every reward function must be callable(responses, prompts, metadata), got {fn!r}")
        weights = [1.0] * len(reward_fns) if weights is None else list(weights)
        if len(weights) != len(reward_fns):
            raise ValueError(
                f"got {len(weights)} weights for {len(reward_fns)} reward functions; give one weight per function"
            )
        self.reward_fns = [as_reward_fn(fn) for fn in reward_fns]
        self.weights = [_check_number("weight", w) for w in weights]
        self.use_trl_inputs = any(getattr(fn, "use_trl_inputs", False) for fn in self.reward_fns)

    @property
    def counts(self) -> dict[str, int]:
        """The functions' ``counts`` summed (``reward_errors``: answers a verifier raised on)."""
        total: dict[str, int] = {}
        for fn in self.reward_fns:
            for name, n in getattr(fn, "counts", {}).items():
                total[name] = total.get(name, 0) + n
        return total

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict], **trl_inputs) -> torch.Tensor:
        total = torch.zeros(len(responses), dtype=torch.float32)
        for fn, weight in zip(self.reward_fns, self.weights, strict=True):
            extra = trl_inputs if getattr(fn, "use_trl_inputs", False) else {}
            values = torch.as_tensor(fn(responses, prompts, metadata, **extra), dtype=torch.float32).reshape(-1)
            if values.numel() != len(responses):
                raise ValueError(
                    f"reward function {fn!r} returned {values.numel()} values for {len(responses)} responses; "
                    "it must return one per response"
                )
            total += weight * values
        return total
