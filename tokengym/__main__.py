"""Command line: ``python -m tokengym demo [--iterations N] [--held-out N] ...``.

Every field of :class:`~tokengym._demo.DemoConfig` is a flag (``out_dir`` -> ``--out-dir``, a
trailing ``_`` dropped so a field ``async_`` becomes ``--async``; bools get ``--x / --no-x``), with
the field's docstring as its help: a new field is a new flag, with no change here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing

_TYPES = {int: int, float: float, str: str}


def field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field (the string literal after ``name: type = default``)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):  # no source (e.g. a frozen app): flags without help
        return {}
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_dataclass_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One ``--flag`` per field of the dataclass ``cls``; a flag not given keeps the field's default."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.rstrip("_").replace("_", "-")
        kind = hints[field.name]
        text = f"{docs.get(field.name, '')} (default: {field.default})".strip()
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)  # fmt: skip
        elif kind in _TYPES:
            parser.add_argument(flag, dest=field.name, type=_TYPES[kind], default=argparse.SUPPRESS,
                                metavar=kind.__name__.upper(), help=text)  # fmt: skip
        else:
            raise TypeError(f"{cls.__name__}.{field.name} has type {kind!r}; flags support int, float, str, bool")


def build_parser() -> argparse.ArgumentParser:
    """The ``tokengym`` parser and its ``demo`` command."""
    from tokengym import _demo

    parser = argparse.ArgumentParser(prog="tokengym")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny offline model with tokengym + TorchRL's ClipPPOLoss",
                          description=(_demo.__doc__ or "").split("\n\n")[0].strip())  # fmt: skip
    add_dataclass_flags(demo, _demo.DemoConfig)
    from tokengym import _recipe_reasoning_gym as recipe

    rg = sub.add_parser("recipe-reasoning-gym", help="GRPO of the tiny model on a reasoning-gym task, with held-out problems",
                        description=(recipe.__doc__ or "").split("\n\n")[0].strip())  # fmt: skip
    add_dataclass_flags(rg, recipe.RecipeConfig)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse the command and run it."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "recipe-reasoning-gym":
        from tokengym._recipe_reasoning_gym import RecipeConfig
        from tokengym._recipe_reasoning_gym import main as run_recipe

        try:
            config = RecipeConfig(**args)
        except ValueError as err:
            parser.error(f"recipe-reasoning-gym: {err}")
        run_recipe(config)
    elif command == "demo":
        from tokengym._demo import DemoConfig
        from tokengym._demo import main as run_demo

        try:
            config = DemoConfig(**args)
        except ValueError as err:
            parser.error(f"demo: {err}")
        run_demo(config)


if __name__ == "__main__":
    main()
