"""The public surface: every public name has one home, the top level stays small, help() shows real signatures."""

import ast
import importlib
import inspect
import pathlib
import typing

import pytest

import tokengym
import tokengym.errors

PACKAGES = [
    "tokengym.llm_envs",
    "tokengym.llm_envs.turns",
    "tokengym.llm_envs.tasks",
    "tokengym.llm_envs.tools",
    "tokengym.llm_envs.adapters",
    "tokengym.llm_envs.agents",
    "tokengym.transforms",
    "tokengym.collectors",
    "tokengym.collectors.policies",
    "tokengym.errors",
    "tokengym.testing",
    "tokengym.training",
    "tokengym.evaluation",
    "tokengym.warm_start",
]


def _exports():
    """object id -> (name, [packages whose __all__ has it]) for every non-module public object."""
    out: dict[int, tuple[str, list[str]]] = {}
    for name in PACKAGES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if inspect.ismodule(obj):
                continue
            out.setdefault(id(obj), (attr, []))[1].append(name)
    return out


# exceptions a user catches around a class of another package: exported there too (and from tokengym.errors)
SECOND_HOMES = {
    "NoServerError": "tokengym.collectors",  # a collector's iteration (its VLLMServerPolicy) raises it
    "DynamicSamplingError": "tokengym.collectors",
    "RequestRejected": "tokengym.collectors.policies",  # VLLMServerPolicy
    "EpisodeError": "tokengym.llm_envs.adapters",  # the adapters' envs
    "AgentError": "tokengym.llm_envs.agents",  # make_agent_env
}


def test_every_public_name_has_one_home():
    homes = {name: where for name, where in _exports().values() if len(where) > 1}
    expected = {name: sorted([package, "tokengym.errors"]) for name, package in SECOND_HOMES.items()}
    assert {name: sorted(where) for name, where in homes.items()} == expected, f"names exported from several packages: {homes}"


def test_the_top_level_re_exports_at_most_25_names_each_from_its_home():
    assert len(tokengym.__all__) <= 25
    exported = {id(obj) for name in PACKAGES for obj in map(importlib.import_module(name).__dict__.get,
                                                           getattr(importlib.import_module(name), "__all__", []))}  # fmt: skip
    homeless = [n for n in tokengym.__all__ if not inspect.ismodule(getattr(tokengym, n)) and id(getattr(tokengym, n)) not in exported]
    assert not homeless, f"top-level names with no subpackage home: {homeless}"


def test_every_exception_is_exported_from_tokengym_errors():
    exceptions = {name for name, where in _exports().values() if isinstance(getattr(importlib.import_module(where[0]), name), type)
                  and issubclass(getattr(importlib.import_module(where[0]), name), Exception)}  # fmt: skip
    assert exceptions == set(tokengym.errors.__all__), exceptions ^ set(tokengym.errors.__all__)


def test_an_exception_is_importable_where_its_class_is():
    from tokengym.collectors import NoServerError, TokenCollector  # noqa: F401  (what a collecting loop imports)
    from tokengym.collectors.policies import RequestRejected, VLLMServerPolicy  # noqa: F401
    from tokengym.errors import NoServerError as again

    assert again is NoServerError and issubclass(RequestRejected, ValueError)


def test_help_shows_the_real_signature_of_every_public_class():
    hidden = []
    for name, where in _exports().values():
        obj = getattr(importlib.import_module(where[0]), name)
        if not inspect.isclass(obj) or issubclass(obj, Exception) or typing.Protocol in obj.__mro__:
            continue
        params = list(inspect.signature(obj).parameters.values())
        if [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
            hidden.append(f"{where[0]}.{name}")
    assert not hidden, f"help() shows (*args, **kwargs) for {hidden}"


EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_import_only_public_names(example):
    """What a user copies from examples/ uses the public API only: public modules, names in their ``__all__``."""
    imported = [(node.module, alias.name) for node in ast.walk(ast.parse(example.read_text()))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokengym")
                for alias in node.names]  # fmt: skip
    assert imported
    for module, name in imported:
        assert not any(part.startswith("_") for part in module.split(".")), f"{module} is private"
        assert name in importlib.import_module(module).__all__, f"{name} is not public in {module}"
