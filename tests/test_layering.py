"""The layers of the code, kept apart; read from the source with ``ast`` (no Django, no imports run).

From the bottom: ``core/`` (Django-free, shared by every process), ``platform/base/`` (what the apps
and the workers share), the apps, and the project shell ``platform/server/`` (settings, URLs, ASGI).
``inference/`` and the platform meet only in ``core`` (the wire contract between them). Within
``inference/``, the engine (``inference/engine/``, the code that runs inside vLLM's processes) and
the pool (every other module, Ray Serve's included) meet only in ``inference/engine_contract.py``. Every
import counts, those inside functions too: a function-local import is a dependency all the same.
A failure names each file, line and import that breaks the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORM = ROOT / "platform"
TESTS = ROOT / "tests"
BASE, PROJECT = "base", "server"
# The Django apps: every package in platform/ but the shared room and the project shell.
APPS = frozenset(
    folder.name for folder in PLATFORM.iterdir() if (folder / "__init__.py").is_file() and folder.name not in (BASE, PROJECT)
)
# The apps from the bottom up: an app imports only apps of a lower level, so no two can import each other,
# however indirectly. Shared helpers go down to base; a new app must be given its level here.
APP_LEVELS = {
    "accounts": 0, "health": 0, "webhooks": 1, "finetuning": 2, "usage": 3, "answering": 4, "gateway": 5,
    "evals": 6, "batches": 6, "training_loops": 6, "dashboard": 7,
}
DJANGO = frozenset({"django", "rest_framework", "drf_spectacular"})
# The web process and the pool import core; neither should pay for these on import.
HEAVY = frozenset({"torch", "vllm"})
INFERENCE = ROOT / "inference"
ENGINE = INFERENCE / "engine"
CONTRACT = "inference.engine_contract"


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # absolute and dotted: "gateway.views", or "gateway" for ``from gateway import views``
    names: tuple[str, ...]  # what ``from module import ...`` takes: attributes, or modules
    at_module_level: bool  # run on import (not in a function, nor under ``if TYPE_CHECKING:``)

    @property
    def top(self) -> str:
        return self.module.partition(".")[0]

    def reaches(self, submodule: str) -> bool:
        """Whether it imports a module named ``submodule`` below its top package."""
        return submodule in self.module.split(".")[1:] or submodule in self.names

    def __str__(self) -> str:
        statement = f"from {self.module} import {', '.join(self.names)}" if self.names else f"import {self.module}"
        return f"{self.path.relative_to(ROOT)}:{self.line}: {statement}"


def _module_name(path: Path) -> str:
    """As the file is imported: platform/ is on sys.path (``gateway.views``), the checkout too (``core.x``)."""
    relative = path.relative_to(PLATFORM if path.is_relative_to(PLATFORM) else ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> Iterator[Import]:
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]

    def visit(node: ast.AST, at_module_level: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(path, child.lineno, alias.name, (), at_module_level)
            elif isinstance(child, ast.ImportFrom):
                # A relative import starts from the file's own package (one level up per extra dot).
                anchor = package[: len(package) - child.level + 1] if child.level else []
                module = ".".join([*anchor, *([child.module] if child.module else [])])
                yield Import(path, child.lineno, module, tuple(alias.name for alias in child.names), at_module_level)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                yield from visit(child, False)
            else:
                yield from visit(child, at_module_level)

    yield from visit(ast.parse(path.read_text(), filename=str(path)), True)


def _sources(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.py") if "migrations" not in path.relative_to(folder).parts)


def _breaking(folders: list[Path], breaks: Callable[[Import], bool]) -> list[str]:
    return sorted({str(imp) for folder in folders for path in _sources(folder) for imp in _imports(path) if breaks(imp)})


def _report(rule: str, broken: list[str]) -> str:
    return f"{rule}:\n  " + "\n  ".join(broken)


def test_the_layers_are_where_the_rules_expect_them():
    """The rules below would pass vacuously on folders that moved or were renamed."""
    assert {"accounts", "dashboard", "finetuning", "gateway", "health", "usage"} <= APPS
    for folder in (ROOT / "core", ROOT / "inference", ROOT / "workers", PLATFORM / BASE, PLATFORM / PROJECT):
        assert _sources(folder), f"no Python files in {folder.relative_to(ROOT)}"


def test_no_app_imports_another_apps_views():
    """Views are an app's door, not a library: what two apps need goes in a service module or in base.
    (The project's URLconf routes to the apps' views: server is not an app.)"""

    def breaks(imp: Import) -> bool:
        own = imp.path.relative_to(PLATFORM).parts[0]
        return imp.top in APPS and imp.top != own and imp.reaches("views")

    broken = _breaking([PLATFORM / app for app in sorted(APPS)] + [PLATFORM / BASE], breaks)
    assert not broken, _report("an app imports another app's views", broken)


def _imports_upward(imp: Import) -> bool:
    """An app importing an app of its own level or above it (APP_LEVELS)."""
    own = imp.path.relative_to(PLATFORM).parts[0]
    return imp.top in APPS and imp.top != own and APP_LEVELS[imp.top] >= APP_LEVELS[own]


def test_every_app_has_a_level():
    assert APPS == set(APP_LEVELS), f"give these apps a level in APP_LEVELS: {sorted(APPS ^ set(APP_LEVELS))}"


def test_apps_import_only_apps_below_them():
    assert _imports_upward(Import(PLATFORM / "finetuning" / "files.py", 1, "gateway.limits", ("x",), True))  # the rule bites
    broken = _breaking([PLATFORM / app for app in sorted(APPS)], _imports_upward)
    assert not broken, _report("an app imports an app of its own level or above (tests/test_layering.py: APP_LEVELS)", broken)


def test_base_imports_no_app_nor_the_project():
    """Every app may import base, so base imports none of them (nor server, which imports them)."""
    broken = _breaking([PLATFORM / BASE], lambda imp: imp.top in APPS | {PROJECT})
    assert not broken, _report(f"platform/base imports an app or the project ({', '.join(sorted(APPS | {PROJECT}))})", broken)


def test_nothing_but_django_loads_the_project_shell():
    """server/ is settings, URLs, ASGI and middleware: apps, base and workers import base instead."""
    folders = [PLATFORM / app for app in sorted(APPS)] + [PLATFORM / BASE, ROOT / "workers"]
    broken = _breaking(folders, lambda imp: imp.top == PROJECT)
    assert not broken, _report("an app, base or a worker imports the project shell (server)", broken)


def test_workers_import_no_gateway():
    """The workers reach the serving backends through base.serving_client, not the web gateway."""
    broken = _breaking([ROOT / "workers"], lambda imp: imp.top == "gateway")
    assert not broken, _report("workers/ imports the gateway", broken)


def test_the_platform_imports_nothing_from_inference():
    """The platform and the pool share only core (core.openai_protocol, core.http_client)."""
    broken = _breaking([PLATFORM], lambda imp: imp.top == "inference")
    assert not broken, _report("platform/ imports from inference", broken)


def test_core_imports_no_django_no_app_and_no_inference():
    forbidden = DJANGO | APPS | {BASE, PROJECT, "inference", "workers"}
    broken = _breaking([ROOT / "core"], lambda imp: imp.top in forbidden)
    assert not broken, _report("core/ imports Django, the platform, the workers or inference", broken)


def test_core_imports_no_torch_or_vllm_on_import():
    """Inside a function it is fine: only the code that needs them pays for them."""
    broken = _breaking([ROOT / "core"], lambda imp: imp.top in HEAVY and imp.at_module_level)
    assert not broken, _report("core/ imports torch or vllm at module level", broken)


def _is_engine(imp: Import) -> bool:
    """An import of ``inference.engine`` or a module in it (``from inference import engine`` too)."""
    return (
        imp.module == "inference.engine"
        or imp.module.startswith("inference.engine.")
        or (imp.module == "inference" and "engine" in imp.names)
    )


def _is_pool_module(imp: Import) -> bool:
    """An import of one of inference's modules other than the engine's and the contract."""
    if imp.top != "inference" or _is_engine(imp) or imp.module == CONTRACT:
        return False
    return imp.module != "inference" or any(name != "engine_contract" for name in imp.names)


def _pool_sources() -> list[Path]:
    return [path for path in _sources(INFERENCE) if not path.is_relative_to(ENGINE)]


def test_pool_code_imports_no_engine_module():
    """The pool (and Ray Serve's replicas) start the engine's server and read its report: what they
    share with it is in inference/engine_contract.py, so a vLLM upgrade touches only the engine."""
    pool = INFERENCE / "replica.py"
    assert _is_engine(Import(pool, 1, "inference.engine.report", ("REPORT_PATH",), False))  # the rule bites
    assert _is_engine(Import(pool, 1, "inference", ("engine",), True))
    assert not _is_engine(Import(pool, 1, CONTRACT, ("REPORT_PATH",), True))
    assert _pool_sources() and not any(path.is_relative_to(ENGINE) for path in _pool_sources())
    broken = sorted({str(imp) for path in _pool_sources() for imp in _imports(path) if _is_engine(imp)})
    assert not broken, _report(f"pool code imports inference.engine (use {CONTRACT})", broken)


def test_engine_code_imports_only_core_the_contract_and_itself():
    """What runs inside vLLM's processes does not load the pool, the workers or the platform."""
    forbidden = APPS | {BASE, PROJECT, "workers"}

    def breaks(imp: Import) -> bool:
        return imp.top in forbidden or _is_pool_module(imp)

    engine = ENGINE / "install.py"
    assert breaks(Import(engine, 1, "inference.replica", ("REPORT_PATH",), False))  # the rule bites
    assert breaks(Import(engine, 1, "inference", ("adapters",), True))
    assert not breaks(Import(engine, 1, "inference", ("engine_contract",), True))
    assert not breaks(Import(engine, 1, "inference.engine", ("gemv",), True))
    broken = _breaking([ENGINE], breaks)
    rule = f"inference/engine imports a pool module, a worker or the platform (not core, {CONTRACT} or itself)"
    assert not broken, _report(rule, broken)


def test_the_engine_contract_is_plain_python():
    """The pool imports it: it must not load the engine, vLLM or torch."""
    path = INFERENCE / "engine_contract.py"
    broken = sorted(str(imp) for imp in _imports(path) if imp.top in HEAVY or imp.top == "inference")
    assert not broken, _report(f"{path.relative_to(ROOT)} imports inference, torch or vllm", broken)


def _imports_a_test_module(imp: Import) -> bool:
    """An import of a ``tests/test_*`` module: ``from tests.test_x import y``, ``import tests.test_x``,
    ``from tests import test_x`` (or relative, from within tests/)."""
    return any(
        module.startswith("tests.test_") for module in (imp.module, *(f"{imp.module}.{name}" for name in imp.names))
    )


def test_no_test_module_imports_another():
    """What test modules share (helpers, constants, fixtures) lives in tests/helpers.py or a themed module
    beside it (tests/file_uploads.py, tests/fake_pool.py, ...), never in a test module that others import:
    a test module's names are its own, so changing one breaks no other, and importing a helper does not
    import a module of tests. (Neither does a shared module import a test module.)"""
    assert _imports_a_test_module(Import(TESTS / "test_a.py", 1, "tests.test_b", ("helper",), True))  # the rule bites
    assert _imports_a_test_module(Import(TESTS / "test_a.py", 1, "tests", ("test_b",), True))
    broken = _breaking([TESTS], _imports_a_test_module)
    assert not broken, _report("a module of tests/ imports a test module (move what it needs to tests/helpers.py)", broken)
