"""How a contract with SGLang is checked: its entry kinds and the two views of an SGLang.

An entry (``Signature``, ``Attribute``, ``Contains``, ``Named``) names one thing in SGLang; a
target is ``"module:Qualified.name"``. ``problems(sglang, entries)`` checks entries against
either view with the same code:

- ``LiveSGLang``: the running SGLang (imported objects, ``inspect``);
- ``SourceSGLang``: a release's files read with ``ast`` (an installed tree or a downloaded wheel),
  so a release can be checked without installing it.

Entries look only at what the named class or module defines itself (not its bases), so both
views see the same thing. The entries themselves are ``adapters/contract.py``'s. This module
imports nothing from SGLang at import time.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path


class Missing(Exception):
    """A contract target that the SGLang being checked does not define."""


# --- the two views of an SGLang: the running one, and release source read with ast ----------


def _split(target: str) -> tuple[str, list[str]]:
    module, _, qualname = target.partition(":")
    return module, qualname.split(".") if qualname else []


def _format_params(params: list[tuple[str, str, bool]], decorator: str) -> str:
    """``classmethod (cls, a, b=, *, c=, **kw)`` from (name, kind, has_default) triples.

    Kinds are ``posonly``, ``positional``, ``varargs``, ``kwonly`` and ``varkw``; annotations and
    default values are left out (a default is marked ``=``), so live and source agree.
    """
    tokens: list[str] = []
    for i, (name, kind, has_default) in enumerate(params):
        previous = params[i - 1][1] if i else None
        if previous == "posonly" and kind != "posonly":
            tokens.append("/")
        if kind == "kwonly" and previous not in ("kwonly", "varargs"):
            tokens.append("*")
        prefix = {"varargs": "*", "varkw": "**"}.get(kind, "")
        tokens.append(prefix + name + ("=" if has_default else ""))
    if params and params[-1][1] == "posonly":
        tokens.append("/")
    return f"{decorator} ({', '.join(tokens)})".lstrip()


def _self_attributes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names assigned as ``self.NAME`` (first parameter) anywhere in a method."""
    arguments = function.args.posonlyargs + function.args.args
    if not arguments:
        return set()
    receiver = arguments[0].arg
    return {
        node.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == receiver
    }


def _string_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


class LiveSGLang:
    """The SGLang this process imports."""

    def __init__(self):
        self.version = _installed_version("sglang")

    def _owner(self, target: str) -> tuple[object, str]:
        module_name, path = _split(target)
        try:
            owner = importlib.import_module(module_name)
        except Exception as e:
            raise Missing(f"module {module_name} cannot be imported ({type(e).__name__}: {e})") from e
        for part in path[:-1]:
            if part not in vars(owner):
                raise Missing(f"{_short(target)}: {part} is not defined")
            owner = vars(owner)[part]
        return owner, path[-1]

    def _own(self, target: str) -> object:
        owner, name = self._owner(target)
        if name not in vars(owner):
            raise Missing(f"{_short(target)} is not defined")
        return vars(owner)[name]

    def signature(self, target: str) -> str:
        raw = self._own(target)
        decorator = {classmethod: "classmethod", staticmethod: "staticmethod", property: "property"}.get(
            type(raw), ""
        )
        function = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
        function = inspect.unwrap(function)  # a hook SGLang already applied wraps the original
        if not callable(function):
            raise Missing(f"{_short(target)} is not a function")
        kinds = {
            inspect.Parameter.POSITIONAL_ONLY: "posonly",
            inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
            inspect.Parameter.VAR_POSITIONAL: "varargs",
            inspect.Parameter.KEYWORD_ONLY: "kwonly",
            inspect.Parameter.VAR_KEYWORD: "varkw",
        }
        params = [
            (p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()
        ]
        return _format_params(params, decorator)

    def has_attribute(self, target: str) -> bool:
        owner, name = self._owner(target)
        if name in vars(owner) or name in vars(owner).get("__annotations__", {}):
            return True
        return inspect.isclass(owner) and name in self._instance_attributes(owner)

    @cache  # noqa: B019 (classes live as long as the process)
    def _instance_attributes(self, cls: type) -> set[str]:
        """``self.NAME`` assignments in the class's own methods, read from their current source."""
        names: set[str] = set()
        for member in vars(cls).values():
            function = getattr(member, "fget", None) or getattr(member, "__func__", member)
            if not inspect.isfunction(function):
                continue
            try:
                source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
            except (OSError, TypeError):  # no source (built at run time): it proves no name
                continue
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names |= _self_attributes(node)
        return names

    def strings(self, target: str) -> set[str]:
        value = self._own(target)
        if isinstance(value, str):
            return {value}
        return {v for v in value if isinstance(v, str)}

    def names_string(self, module_name: str, word: str) -> bool:
        module, _ = self._owner(f"{module_name}:_")
        return word in _string_constants(ast.parse(inspect.getsource(module)))


class SourceSGLang:
    """An SGLang release read as source: an installed ``site-packages`` folder or a wheel."""

    def __init__(self, root: Path | zipfile.ZipFile, version: str):
        self.root = root
        self.version = version

    @cache  # noqa: B019 (one instance per release; the cache lives as long as the check)
    def _module(self, module_name: str) -> ast.Module:
        relative = module_name.replace(".", "/")
        for candidate in (f"{relative}.py", f"{relative}/__init__.py"):
            if isinstance(self.root, zipfile.ZipFile):
                source = self.root.read(candidate) if candidate in self.root.namelist() else None
            else:
                source = (self.root / candidate).read_bytes() if (self.root / candidate).is_file() else None
            if source is not None:
                try:
                    return ast.parse(source)
                except SyntaxError as e:  # newer syntax than this Python reads
                    raise Missing(f"module {module_name} cannot be parsed ({e})") from e
        raise Missing(f"module {module_name} does not exist")

    def _find(self, module_name: str, path: list[str], target: str, follow: int = 3) -> ast.AST:
        """The definition of ``path`` in a module, following ``from X import name`` re-exports."""
        scope: ast.AST = self._module(module_name)
        for depth, part in enumerate(path):
            found = None
            for statement in _statements(scope.body):
                if isinstance(statement, ast.ImportFrom) and depth == 0 and follow:
                    for alias in statement.names:
                        if (alias.asname or alias.name) == part:
                            source = _absolute(module_name, statement, self._is_package(module_name))
                            return self._find(source, [alias.name, *path[1:]], target, follow - 1)
                if _defines(statement, part):
                    found = statement
            if found is None:
                raise Missing(f"{_short(target)} is not defined")
            scope = found
        return scope

    def _is_package(self, module_name: str) -> bool:
        init = module_name.replace(".", "/") + "/__init__.py"
        if isinstance(self.root, zipfile.ZipFile):
            return init in self.root.namelist()
        return (self.root / init).is_file()

    def signature(self, target: str) -> str:
        module_name, path = _split(target)
        node = self._find(module_name, path, target)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            raise Missing(f"{_short(target)} is not a function")
        decorators = {
            d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list
        }
        decorator = next((d for d in ("classmethod", "staticmethod", "property") if d in decorators), "")
        a = node.args
        positional = a.posonlyargs + a.args
        first_default = len(positional) - len(a.defaults)
        params = [
            (arg.arg, "posonly" if i < len(a.posonlyargs) else "positional", i >= first_default)
            for i, arg in enumerate(positional)
        ]
        if a.vararg:
            params.append((a.vararg.arg, "varargs", False))
        params += [(arg.arg, "kwonly", d is not None) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
        if a.kwarg:
            params.append((a.kwarg.arg, "varkw", False))
        return _format_params(params, decorator)

    def has_attribute(self, target: str) -> bool:
        module_name, path = _split(target)
        owner = self._find(module_name, path[:-1], target) if len(path) > 1 else self._module(module_name)
        name = path[-1]
        if any(_defines(s, name) for s in _statements(owner.body)):
            return True
        return isinstance(owner, ast.ClassDef) and any(
            name in _self_attributes(f)
            for f in owner.body
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        )

    def strings(self, target: str) -> set[str]:
        module_name, path = _split(target)
        node = self._find(module_name, path, target)
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            raise Missing(f"{_short(target)} is not a constant")
        return _string_constants(node.value)

    def names_string(self, module_name: str, word: str) -> bool:
        return word in _string_constants(self._module(module_name))


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a module or class body, including those under if/try/with (not the body of
    ``if TYPE_CHECKING:``, which never runs: its imports are often cycles back to the module)."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If | ast.Try | ast.With):
            type_checking = isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test)
            nested = [
                *([] if type_checking else statement.body),
                *getattr(statement, "orelse", []),
                *getattr(statement, "finalbody", []),
            ]
            for handler in getattr(statement, "handlers", []):
                nested += handler.body
            yield from _statements(nested)


def _defines(statement: ast.stmt, name: str) -> bool:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return statement.name == name
    if isinstance(statement, ast.Assign):
        return any(name in _assigned_names(t) for t in statement.targets)
    if isinstance(statement, ast.AnnAssign):
        return name in _assigned_names(statement.target)
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return any((a.asname or a.name.split(".")[0]) == name for a in statement.names)
    return False


def _assigned_names(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_assigned_names(t) for t in target.elts))
    return set()


def _absolute(module_name: str, statement: ast.ImportFrom, is_package: bool) -> str:
    if not statement.level:
        return statement.module or ""
    base = module_name.split(".")
    base = base[: len(base) - statement.level + (1 if is_package else 0)]
    return ".".join([*base, *([statement.module] if statement.module else [])])


def _short(target: str) -> str:
    """``Class.method`` (or ``module.name``) for messages."""
    module_name, path = _split(target)
    return ".".join(path) if len(path) > 1 else f"{module_name}.{'.'.join(path)}"


def _installed_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


# --- entries ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """A function or method the plugin calls, overrides or hooks, with its parameter list.

    ``params`` is what ``_format_params`` prints, e.g. ``"(self, x, y=)"``; None accepts any
    parameters (hooks that pass ``*args`` through).
    """

    target: str
    params: str | None

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        found = sglang.signature(self.target)
        if self.params is not None and found != self.params:
            return f"{_short(self.target)} takes {found}, not {self.params}"
        return None


@dataclass(frozen=True)
class Attribute:
    """A name the class (or module) defines: a method, property, field, enum member, a
    module-level name or import, or an instance attribute assigned on ``self`` in one of the
    class's own methods (an assignment the code can make, not one proven to run)."""

    target: str

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        return None if sglang.has_attribute(self.target) else f"{_short(self.target)} is not defined"


@dataclass(frozen=True)
class Contains:
    """A constant collection (a set literal, a frozenset) that must hold a string."""

    target: str
    value: str

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        if self.value in sglang.strings(self.target):
            return None
        return f"{_short(self.target)} no longer holds {self.value!r}"


@dataclass(frozen=True)
class Named:
    """A name SGLang resolves dynamically (``__getattr__`` over tables): the weaker check is
    that the module's source still spells it as a string."""

    module: str
    word: str

    @property
    def target(self) -> str:
        return f"{self.module}:{self.word}"

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        return (
            None
            if sglang.names_string(self.module, self.word)
            else f"{self.module} no longer names {self.word!r}"
        )


Entry = Signature | Attribute | Contains | Named


def problems(sglang: LiveSGLang | SourceSGLang, entries: tuple[Entry, ...]) -> list[str]:
    """What ``sglang`` lacks or changed, one short phrase per broken entry."""
    found = []
    for entry in entries:
        try:
            problem = entry.problem(sglang)
        except Missing as e:
            problem = str(e)
        if problem is not None and problem not in found:
            found.append(problem)
    return found
