"""Load prompts from a local JSONL or Parquet file into a ``datasets.Dataset`` (offline)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["load_prompt_file"]

_READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


def load_prompt_file(path: str | os.PathLike, *, prompt_key: str = "prompt", answer_key: str | None = "answer"):
    """Read a local ``.jsonl``/``.json``/``.parquet`` file of prompts; columns become ``prompt`` and ``answer``.

    The result can be passed to :class:`~tokengym.llm_envs.token_env.TokenEnv` directly: ``prompt`` is
    the prompt and every other column becomes metadata (e.g. ``answer`` for
    :class:`~tokengym.llm_envs.rewards.MathAnswerReward`).

    Args:
        path: the file.
        prompt_key: the column holding the prompt; renamed to ``prompt``.
        answer_key: the column holding the reference answer, renamed to ``answer``; ``None`` if the
            file has none.

    Raises:
        ValueError: the file is missing, its extension is unknown, or a column is missing.

    Example:
        >>> import json, tempfile
        >>> path = Path(tempfile.mkdtemp()) / "p.jsonl"
        >>> _ = path.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\\n")
        >>> load_prompt_file(path, prompt_key="q", answer_key="a")[0]
        {'prompt': '1+1=', 'answer': '2'}
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist (or is not a file); check the path")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(
            f"prompt file {str(path)!r} has extension {path.suffix!r}; use one of {sorted(_READERS)} "
            "(JSON lines or Parquet)"
        )
    import datasets

    datasets.disable_progress_bars()
    if reader == "json":
        data = datasets.Dataset.from_json(str(path), keep_in_memory=True)
    else:
        data = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    renames = {prompt_key: "prompt"}
    if answer_key is not None:
        renames[answer_key] = "answer"
    for role, column in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if column is not None and column not in data.column_names:
            hint = "" if role == "prompt_key" else " or answer_key=None if the file has no answers"
            raise ValueError(
                f"prompt file {str(path)!r} has no column {column!r} ({role}); its columns are "
                f"{data.column_names}; set {role}=<one of them>{hint}"
            )
    renames = {old: new for old, new in renames.items() if old != new}
    clash = [new for new in renames.values() if new in data.column_names and new not in renames]
    if clash:
        raise ValueError(
            f"prompt file {str(path)!r} already has a column {clash[0]!r}, so {prompt_key!r}/{answer_key!r} "
            f"cannot be renamed to it; its columns are {data.column_names}"
        )
    return data.rename_columns(renames) if renames else data
