"""Architecture rules checked on the source: no private reach-through across modules, every key string in
keys.py, imports one way (llm_envs <- transforms <- collectors <- tokengym)."""

import ast
import pathlib

import pytest

from tokengym.llm_envs import keys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"llm_envs": 0, "transforms": 1, "collectors": 2, "tokengym": 3}
MODULES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _private_names_defined(tree) -> set[str]:
    """`_x` names a module defines: functions, classes, methods, class attributes, `self._x = ...`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_members():
    trees = {path: _tree(path) for path in MODULES}
    defined = {path: _private_names_defined(tree) for path, tree in trees.items()}
    ours = set().union(*defined.values())
    offences = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokengym"):
                folder = ROOT / (node.module.split(".")[1] if "." in node.module else "tokengym")
                offences += [f"{path.name}: imports {a.name} from {node.module}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")
                             and not (folder / f"{a.name}.py").exists()]  # a private module, not a member  # fmt: skip
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if node.attr in ours and node.attr not in defined[path]:
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert not offences, "private members read across modules:\n" + "\n".join(offences)


def _key_strings() -> set[str]:
    out = set()
    for name in dir(keys):
        value = getattr(keys, name)
        if name.isupper() and isinstance(value, str):
            out.add(value)
        elif name.isupper() and isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            out.update(value)
    return out - {""}


_NESTED_ROOTS = {k[0] for k in vars(keys).values() if isinstance(k, tuple) and k and isinstance(k[0], str)}
# names that equal a key string but are not TensorDict keys: fields of metrics dicts and checkpoint dicts
_NOT_TENSORDICT = {
    ("tokengym/training.py", "kl"): "a row of train() metrics",
    ("tokengym/_demo.py", "reward"): "a row of the demo's metrics",
    ("tokengym/_demo.py", "kl"): "a row of the demo's metrics",
    ("tokengym/_recipe_reasoning_gym.py", "reward"): "a row of the recipe's metrics",
    ("tokengym/_recipe_reasoning_gym.py", "kl"): "a row of the recipe's metrics",
    ("tokengym/evaluation.py", "reward"): "evaluate()'s running totals",
    ("tokengym/evaluation.py", "prompts"): "evaluate()'s metrics",
    ("collectors/_metrics.py", "tokens"): "a collector's metrics",
    ("collectors/token_collector.py", "tokens"): "a collector's metrics",
    ("collectors/async_collector.py", "tokens"): "a collector's metrics",
    ("collectors/async_collector.py", "policy_version"): "a collector's metrics",
    ("collectors/async_collector.py", "collector"): "a checkpoint field",
    ("collectors/_checkpoint.py", "prompts"): "a checkpoint field",
    ("collectors/policies/kv_cache.py", "mask"): "a checkpoint field",
    ("collectors/sources.py", "done"): "a checkpoint field",
    ("llm_envs/_slots.py", "tokens"): "a checkpoint field",
    ("llm_envs/_slots.py", "done"): "a checkpoint field",
    ("llm_envs/_slots.py", "prompts"): "a checkpoint field",
}
_KEY_METHODS = {"get", "set", "set_non_tensor", "get_non_tensor", "exclude", "select", "pop", "rename_key_"}
_KEYWORD_WRITERS = {"update", "TensorDict", "_new_unsafe", "from_dict"}  # calls whose keyword names are keys


def _key_literals(tree):
    """``(line, name)`` of strings used as TensorDict keys: arguments of get/set/exclude/..., nested-key tuples,
    keyword names given to ``update(...)`` / ``TensorDict(...)``, and string subscripts (``out["reward"]``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KEY_METHODS:
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield arg.lineno, arg.value
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if callee in _KEYWORD_WRITERS:
                yield from ((node.lineno, kw.arg) for kw in node.keywords if kw.arg is not None)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            yield node.lineno, node.slice.value
        if isinstance(node, ast.Tuple) and len(node.elts) >= 2:  # a nested key: ("next", "reward")
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                if node.elts[0].value in _NESTED_ROOTS:
                    yield from ((e.lineno, e.value) for e in node.elts)


def _offences(key_strings, paths):
    out = []
    for path in paths:
        if path.name == "keys.py":
            continue
        where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        for line, name in _key_literals(_tree(path)):
            if name in key_strings and (where, name) not in _NOT_TENSORDICT:
                out.append(f"{where}:{line} {name!r}")
    return out


def test_key_strings_are_only_typed_in_keys_py():
    offences = _offences(_key_strings(), MODULES)
    assert not offences, "key strings typed outside llm_envs/keys.py:\n" + "\n".join(offences)


def test_the_key_check_sees_keyword_names_and_subscripts(tmp_path):
    """The forms the env used to write keys in (``out.update(done=...)``, ``out["reward"]``, ``nxt.update(reward=...)``,
    ``flags["done"]``, ``TensorDict(action=...)``) are offences; the constants are not."""
    bad = tmp_path / "bad.py"
    bad.write_text("out.update(done=d, terminated=t)\nout['reward'] = r\nx = flags['done']\n"
                   "td = TensorDict(action=a)\nok = out[keys.REWARD_NAME]\n")  # fmt: skip
    assert _offences(_key_strings(), [bad]) == ["bad.py:1 'done'", "bad.py:1 'terminated'", "bad.py:2 'reward'",
                                                "bad.py:3 'done'", "bad.py:4 'action'"]  # fmt: skip


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_one_way(path):
    level = PACKAGES[path.relative_to(ROOT).parts[0]]
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokengym."):
            target = node.module.split(".")[1]
            if target in PACKAGES:
                assert PACKAGES[target] <= level, f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}"


def _runtime_imports(tree):
    """``(line, module, names)`` of every import ``tree`` runs (function bodies included, ``if TYPE_CHECKING:`` not)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            todo += node.orelse
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, []) for a in node.names)
        todo += ast.iter_child_nodes(node)


def _env_imports(path) -> list[str]:
    """Imports of the env module (``llm_envs/token_env.py``, or a name of the package that is not a submodule,
    such as ``TokenEnv``) that ``path`` runs: the env module imports the turns package, so they go one way."""
    folder = ROOT / "llm_envs"
    submodules = {p.stem for p in folder.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    out = []
    for line, module, names in _runtime_imports(_tree(path)):
        if module.startswith("tokengym.llm_envs.token_env") or (
                module == "tokengym.llm_envs" and any(n not in submodules for n in names)):  # fmt: skip
            out.append(f"{path.name}:{line} imports {module}" + (f" {names}" if names else ""))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "llm_envs" / "turns").rglob("*.py")), ids=lambda p: p.name)
def test_the_turns_package_does_not_import_the_env(path):
    assert not _env_imports(path)


def test_the_env_import_check_sees_imports_in_functions_and_skips_type_checking(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nfrom tokengym.llm_envs import keys\nif TYPE_CHECKING:\n"
                   "    from tokengym.llm_envs.token_env import TokenEnv\ndef f():\n"
                   "    from tokengym.llm_envs import TokenEnv\n    import tokengym.llm_envs.token_env\n")  # fmt: skip
    assert sorted(_env_imports(bad)) == ["bad.py:6 imports tokengym.llm_envs ['TokenEnv']",
                                         "bad.py:7 imports tokengym.llm_envs.token_env"]  # fmt: skip


def _classes():
    """Every class of ours: name -> (module path, base names, private names it defines, `self._x` uses)."""
    out = {}
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, ast.Name | ast.Attribute)]
            defined, used = set(), []
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.name.startswith("_"):
                    defined.add(sub.name)
                    if not sub.name.startswith("__"):
                        used.append((sub.name, sub.lineno))  # an override of a parent's private hook counts too
                elif isinstance(sub, ast.Assign | ast.AnnAssign):
                    for target in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                        for t in ast.walk(target):
                            if isinstance(t, ast.Name) and t.id.startswith("_"):
                                defined.add(t.id)  # a class attribute
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")
                        and sub.attr.startswith("_") and not sub.attr.startswith("__")):  # fmt: skip
                    used.append((sub.attr, sub.lineno))
                    if isinstance(sub.ctx, ast.Store):
                        defined.add(sub.attr)
            out.setdefault(node.name, (path, bases, defined, used))
    return out


def test_no_class_reaches_into_a_parent_of_another_module():
    """A subclass uses only its own private members or those of parents in its own module: extending a class
    of another module goes through its public methods (or composition: a turn handler, a policy)."""
    classes = _classes()
    offences = []
    for name, (path, bases, _defined, used) in classes.items():
        inherited = {}  # private name -> module of the parent defining it
        todo = list(bases)
        while todo:
            base = todo.pop()
            if base not in classes:
                continue
            bpath, bbases, bdefined, _ = classes[base]
            for attr in bdefined:
                inherited.setdefault(attr, bpath)
            todo += bbases
        for attr, line in used:
            owner = inherited.get(attr)
            if owner is not None and owner != path:
                offences.append(f"{path.relative_to(ROOT)}:{line} {name} uses .{attr} of a parent in {owner.relative_to(ROOT)}")
    assert not offences, "private members of a parent class of another module:\n" + "\n".join(sorted(set(offences)))

