"""The API reference, generated from ``__all__``: one page per public package, every name with its signature.

``.. tokengym-api:: tokengym.transforms`` writes the package's docstring, a summary table and one autodoc entry
per name of its ``__all__`` (members inherited from tokengym's own base classes included, torch's and TorchRL's
left out: ``help(GroupAdvantage)`` lists every ``nn.Module`` method, its page does not; nor private names, the hooks
torch and TorchRL call, or a collector core's hooks on each collector: the page's right-hand list holds what a user
calls). A few types that are not exported but appear in public signatures (``WaveRequest``...) are documented
under their own module path.

Every reference resolves to where a name is documented: type hints name an object by the module that defines it
(``tokengym.transforms.group_advantages.GroupAdvantage``) and docstrings often by a short name
(``GroupAdvantage``); :func:`resolve` maps both to the object's public home, so nitpicky mode fails only on
references to nothing documented.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pathlib
import re

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _public_packages() -> list[str]:
    """Every public package of the three folders (a directory with ``__init__.py``, no ``_`` in its path) and every
    public module of ``tokengym/`` with an ``__all__`` (``tokengym.errors``, ``.testing``...), the top level aside."""
    found = []
    for folder in ("llm_envs", "transforms", "collectors"):
        root = pathlib.Path(importlib.import_module(f"tokengym.{folder}").__file__).parent
        for init in sorted(root.rglob("__init__.py")):
            parts = init.parent.relative_to(root).parts
            if not any(part.startswith("_") for part in parts):
                found.append(".".join(("tokengym", folder, *parts)))
    top = pathlib.Path(importlib.import_module("tokengym").__file__).parent
    for module in sorted(top.glob("*.py")):
        if not module.stem.startswith("_") and hasattr(importlib.import_module(f"tokengym.{module.stem}"), "__all__"):
            found.append(f"tokengym.{module.stem}")
    return found


# Every package with a public ``__all__``: each gets a page. The first that exports an object is its home
# (``tokengym.errors`` first); test/test_public_surface.py checks that there is only one, the top level aside.
PACKAGES = _public_packages()
# Public modules documented whole (constants without ``__all__``), and the top level (links to the homes).
MODULES = ["tokengym.llm_envs.keys", "tokengym.llm_envs.devices", "tokengym.collectors.sinks"]
TOP = "tokengym"
# Types that public signatures and docstrings name but no ``__all__`` exports: documented on the page of the
# package they belong to, under their defining module's path.
IN_SIGNATURES = {
    "tokengym.llm_envs": ["tokengym.llm_envs.waves.WaveRequest", "tokengym.llm_envs.waves.WaveResult",
                          "tokengym.llm_envs.prompts.OverlongPrompts", "tokengym.llm_envs.image_inputs.ImageInputs",
                          "tokengym.llm_envs.image_inputs.encode_with_images"],
    "tokengym.llm_envs.agents": ["tokengym.llm_envs.agents.runner.AgentRunner", "tokengym.llm_envs.agents.runner.Episode"],
    "tokengym.collectors": ["tokengym.collectors.core.CollectorBase"],
    "tokengym.collectors.policies": ["tokengym.collectors.policies._server_weights.WeightTransport",
                                     "tokengym.collectors.policies.server_guard.ServerKeyGuard"],
}  # fmt: skip
_LONG_VALUE = 60  # characters: a longer constant is shown without its value
_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?: <([^>]*)>)?`")


def public_names(package: str) -> list[str]:
    """The names ``package`` exports, modules left out (they have pages of their own)."""
    module = importlib.import_module(package)
    return [name for name in module.__all__ if not inspect.ismodule(getattr(module, name))]


def homes() -> dict[int, str]:
    """``id(object) -> documented name`` for every public object and module, at its home: the first package of
    :data:`PACKAGES` that exports it, ``tokengym.errors`` first (an exception also exported by the package of the
    class that raises it is documented among the errors)."""
    found: dict[int, str] = {}
    for package in sorted(PACKAGES, key=lambda name: name != "tokengym.errors"):
        module = importlib.import_module(package)
        found.setdefault(id(module), package)
        for name in module.__all__:
            obj = getattr(module, name)
            found.setdefault(id(obj), obj.__name__ if inspect.ismodule(obj) else f"{package}.{name}")
    for package in MODULES:
        found.setdefault(id(importlib.import_module(package)), package)
    for paths in IN_SIGNATURES.values():
        for path in paths:
            found.setdefault(id(_lookup(path)), path)
    return found


def _summary(obj: object) -> str:
    """The first sentence of ``obj``'s own docstring, cross-references as literals (a table has no context)."""
    doc = obj.__doc__ if inspect.isclass(obj) or inspect.isroutine(obj) else None
    first = (inspect.cleandoc(doc).split("\n\n")[0] if doc else "").replace("\n", " ")
    first = re.split(r"(?<=[a-z0-9)`])\. (?=[A-Z])", first)[0]  # not at "et al. 2019"
    return _ROLE.sub(lambda m: f"``{(m.group(2) or m.group(1)).rsplit('.', 1)[-1]}``", first)


def _entry(target: str) -> list[str]:
    """The autodoc directive documenting ``target`` (a dotted path)."""
    obj = _lookup(target)
    inheritance = ["   :show-inheritance:"] if inspect.isclass(obj) and public_bases(obj.__bases__) else []
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return [f".. autoexception:: {target}", "   :members:", *inheritance]
    if inspect.isclass(obj):
        lines = [f".. autoclass:: {target}", "   :members:", "   :inherited-members:", *inheritance]
        hidden = internal_members(obj)
        if hidden:
            lines.append(f"   :exclude-members: {', '.join(hidden)}")
        if issubclass(obj, enum.Enum):
            lines.append("   :undoc-members:")
        return lines
    if inspect.isroutine(obj):
        return [f".. autofunction:: {target}"]
    lines = [f".. autodata:: {target}"]
    if not isinstance(obj, (int, float, str, tuple)) or len(repr(obj)) > _LONG_VALUE:
        lines.append("   :no-value:")
    return lines


def package_rst(package: str) -> list[str]:
    """The reST of one package's page (below its title): docstring, summary table, one entry per name whose home
    is this package (a name exported here too links to its home)."""
    module = importlib.import_module(package)
    names, found = public_names(package), homes()
    lines = [f".. automodule:: {package}", "   :no-members:", "", f".. currentmodule:: {package}", ""]
    if names:
        lines += [".. list-table::", "   :widths: 30 70", ""]
        for name in names:
            home = found[id(getattr(module, name))]
            link = f":py:obj:`{name}`" if home == f"{package}.{name}" else f":py:obj:`{name} <{home}>`"
            lines += [f"   * - {link}", f"     - {_summary(getattr(module, name)) or ' '}"]
        lines.append("")
    for name in names:
        if found[id(getattr(module, name))] == f"{package}.{name}":
            lines += _entry(f"{package}.{name}") + [""]
    extra = IN_SIGNATURES.get(package, [])
    if extra:
        lines += ["Types in signatures", "-------------------", "",
                  "Not exported, but named by the signatures above.", ""]  # fmt: skip
        for path in extra:
            lines += _entry(path) + [""]
    return lines


def top_level_rst() -> list[str]:
    """The top level's page: every name ``import tokengym`` gives, linked to its home."""
    top = importlib.import_module(TOP)
    found = homes()
    lines = [f".. py:module:: {TOP}", "", ".. list-table::", "   :header-rows: 1", "   :widths: 30 70", "",
             "   * - name", "     - home (documented there)"]  # fmt: skip
    for name in top.__all__:
        home = found[id(getattr(top, name))]
        role = "mod" if inspect.ismodule(getattr(top, name)) else "obj"
        lines += [f"   * - ``tokengym.{name}``", f"     - :py:{role}:`{home}`"]
    return lines + [""]


class TokengymApi(SphinxDirective):
    """``.. tokengym-api:: <package>``: the generated reference of one package (see the module docstring)."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        package = self.arguments[0]
        if package == TOP:
            rst = top_level_rst()
        elif package in PACKAGES:
            rst = package_rst(package)
        elif package in MODULES:
            rst = [f".. automodule:: {package}", "   :members:", "   :undoc-members:", ""]
        else:
            raise self.error(f"tokengym-api: {package!r} is not in PACKAGES or MODULES of docs/_ext/tokengym_api.py")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(rst, source=f"<tokengym-api {package}>"), node)
        return node.children


def _lookup(path: str) -> object | None:
    """The object a dotted path names, or None: the longest importable module, then attributes (a package's
    attribute wins over its submodule of the same name: ``tokengym.transforms.group_advantages`` the function)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def _defined_in(obj: object) -> str:
    """The module that defines a class member (a function, property, classmethod...), or ``""``."""
    for attr in ("fget", "__func__"):
        obj = getattr(obj, attr, obj)
    return getattr(obj, "__module__", None) or ""


# Members a user never calls, left out of a class's entry and so of the page's "On this page" list:
# hooks torch and TorchRL call on a module, env or transform (a user calls the module: ``transform(batch)``)...
FRAMEWORK_HOOKS = frozenset({"forward", "extra_repr", "get_extra_state", "set_extra_state", "transform_output_spec",
                             "step_and_maybe_reset"})  # fmt: skip
# ...and what a collector core calls on the collectors built on it, documented once, on the core (a user iterates a
# collector and calls update_policy_weights_, state_dict...).
CORE_HOOKS = {"tokengym.collectors.core.CollectorBase": frozenset({
    "collect_batch", "commit_batch", "push_weights", "batch_metrics", "describe", "undelivered",
    "needs_weights_because"}),
    "tokengym.collectors.policies._wave_core.WaveCore": frozenset({
    "check_open", "send_wave", "push_weights", "budget_where"})}  # fmt: skip


def internal_members(cls: type) -> list[str]:
    """The members of ``cls`` its entry leaves out (``:exclude-members:``): framework hooks it has, and a core's
    hooks where ``cls`` is built on that core (the core's own entry keeps them). Private names are never shown."""
    hidden = {name for name in FRAMEWORK_HOOKS if hasattr(cls, name)}
    for core, hooks in CORE_HOOKS.items():
        base = _lookup(core)
        if cls is not base and issubclass(cls, base):
            hidden |= hooks
    return sorted(hidden)


def skip_foreign_members(app, what, name, obj, skip, options):
    """``autodoc-skip-member``: leave out private names, what a class inherits from torch, TorchRL, str... (not
    tokengym), and a named tuple's field accessors (the class docstring's ``Attributes:`` describes the fields)."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    if name.startswith("_"):
        return True
    if what in ("class", "exception") and (inspect.isroutine(obj) or isinstance(obj, property)):
        if not _defined_in(obj).startswith("tokengym"):  # "" for a builtin's method: str.encode, tuple.count
            return True
    return None


def drop_foreign_docstrings(app, what, name, obj, options, lines):
    """``autodoc-process-docstring``: a tokengym method without a docstring of its own shows none, rather than
    the one of the torch / TorchRL method it overrides (``forward``'s "Define the computation performed..."),
    and a constant shows none rather than its type's (``SIZES``: "dict() -> new empty dictionary")."""
    type_doc = inspect.getdoc(type(obj))
    if what in ("data", "attribute") and type_doc and lines and lines[0] == type_doc.splitlines()[0]:
        lines.clear()
        return
    if what not in ("method", "property") or "." not in name:
        return
    owner_path, member = name.rsplit(".", 1)
    owner = _lookup(owner_path)
    if not inspect.isclass(owner):
        return
    for cls in owner.__mro__:
        doc = getattr(cls.__dict__.get(member), "__doc__", None)
        if doc:
            if not cls.__module__.startswith("tokengym"):
                lines.clear()
            return


def public_bases(bases) -> list:
    """``bases`` with each private base class replaced by its own bases, and without ``object``."""
    out = []
    for base in bases:
        if getattr(base, "__name__", "").startswith("_"):
            out += public_bases(base.__bases__)
        elif base is not object:
            out.append(base)
    return out


def drop_private_bases(app, name, obj, options, bases):
    """``autodoc-process-bases``: show a private base class's public bases instead of it, and no ``object``."""
    bases[:] = public_bases(bases)


class _Resolver:
    """Maps a reference that names a documented object by another path to where it is documented."""

    def __init__(self) -> None:
        self.homes = homes()
        self.by_short: dict[str, set[str]] = {}
        for full in self.homes.values():
            self.by_short.setdefault(full.rsplit(".", 1)[-1], set()).add(full)

    def public_target(self, target: str, module: str | None, cls: str | None) -> str | None:
        """The documented name of ``target`` (dotted or short, seen from ``module`` and ``cls``), or None."""
        target = target.lstrip("~.")
        candidates = [target] + [f"{prefix}.{target}" for prefix in (f"{module}.{cls}" if module and cls else "",
                                                                     module or "") if prefix]  # fmt: skip
        for candidate in candidates:
            if _lookup(candidate) is None:
                continue
            head, tail = candidate, ""
            while head.startswith("tokengym."):  # a documented object, then attributes of it (Class.method)
                obj = _lookup(head)
                if obj is not None and id(obj) in self.homes and (not tail or not inspect.ismodule(obj)):
                    return self.homes[id(obj)] + tail
                if "." not in head:
                    break
                head, last = head.rsplit(".", 1)
                tail = f".{last}{tail}"
        first, _, rest = target.partition(".")
        short = self.by_short.get(first, set())
        if len(short) == 1:
            return next(iter(short)) + (f".{rest}" if rest else "")
        return None


_RESOLVER: list[_Resolver] = []


def resolve(app, env, node, contnode):
    """``missing-reference``: retry a Python reference under the documented name of the object it names."""
    if node.get("refdomain") != "py":
        return None
    if not _RESOLVER:  # built once per process (object ids do not survive a pickled environment)
        _RESOLVER.append(_Resolver())
    target = _RESOLVER[0].public_target(node["reftarget"], node.get("py:module"), node.get("py:class"))
    if target is None or target == node["reftarget"]:
        return None
    # searched as "obj": a short name in a :class: role may name a function or a constant
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, "obj", target, node, contnode)


def _attribute_docstring_as_written(self) -> list[str]:
    """An attribute's docstring as written: napoleon would read a first line ``A thing: ...`` as ``type: ...``."""
    return self._consume_to_end()


def setup(app):
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    GoogleDocstring._parse_attribute_docstring = _attribute_docstring_as_written
    app.add_directive("tokengym-api", TokengymApi)
    app.connect("missing-reference", resolve)
    app.connect("autodoc-skip-member", skip_foreign_members)
    app.connect("autodoc-process-docstring", drop_foreign_docstrings)
    app.connect("autodoc-process-bases", drop_private_bases)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
