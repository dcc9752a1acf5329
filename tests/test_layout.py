"""The layout holds its promises: every import points down a floor of the house (FLOORS), no module imports
itself round a circle, a function-level import says why it is not at the top, production code never imports the
demo material, every infra folder is in ARCHITECTURE.md's map, and every contract fails loudly when a piece of it
is missing. Function-level imports count as arrows like the others.

``python tests/test_layout.py`` prints the counts (upward arrows, circles, function-level imports and their
reasons) and every offender."""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.config import STEP_SETTINGS, BuildConfig, step_settings
from infra.formats.base import Format
from infra.models.base import FamilySpec
from infra.publish.base import Remote
from infra.registry import Registry
from infra.sources.base import Source

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "infra")

#: The house, bottom up. A folder of infra/ (or a top-level module of infra/) may import only from a floor below
#: its own; two folders on one floor never import each other. ARCHITECTURE.md shows the same table.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("infra", "errors", "faults", "heap", "runtime", "urls"),  # ground: imports nothing of the project
    ("bounds", "outstore", "records"),  # the sanity bounds; OUT in an object store; records read back bounded
    ("config", "outdir", "fetch"),  # the settings; the door to OUT; a model by URL fetched: only infra.errors
    ("storage", "registry", "recipes", "devices", "media", "procs", "job"),
    ("report_files", "models"),
    ("sources",),  # a metadata file's columns: the roles its mode reads, as the families declare them
    ("cache",),
    ("ops", "formats"),
    ("plan",),
    ("gates",),
    ("preprocess",),
    ("audit",),
    ("publish",),
    ("demo", "tasks"),
    ("flows",),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}

#: The accepted reason of a function-level import: ``noqa: PLC0415 - <why>`` in the comment on its line (other codes
#: may come first: ``noqa: F401, PLC0415 - <why>``), or ``PLC0415 - <why>`` in a comment line just above it where
#: the line would be too long. Imports that follow one another share the first one's reason. <why> names what
#: forbids the top of the module: a circle, a heavy import (``heavy: torch``), an optional one (``optional: the `s3`
#: extra``), demo material (``demo material: this command only``).
REASON = re.compile(r"#.*\bPLC0415\b\s*-\s*\S")

#: The only production code that imports the demo material: the two commands that make it.
DEMO_IMPORTERS = {("flows.cli", "make_tiny_model"), ("flows.cli", "make_demo_data")}


@dataclass(frozen=True)
class Import:
    """One project module imported by one statement."""

    module: str  # the importer
    target: str  # the imported project module
    line: int
    function: str | None  # the enclosing function; None at module level
    explained: bool  # a function-level import's reason is given

    @property
    def where(self) -> str:
        return f"{MODULES[self.module].relative_to(ROOT)}:{self.line}"


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = _modules()


def _project_module(name: str) -> str | None:
    """The project module `name` names, or the nearest package above it; None outside the project."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


Statement = tuple[ast.Import | ast.ImportFrom, str | None, bool]


def _bodies(node: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists inside `node` (a function's, a branch's, a handler's, a case's)."""
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value
    yield from (handler.body for handler in getattr(node, "handlers", []))
    yield from (case.body for case in getattr(node, "cases", []))


def statements(text: str) -> Iterator[Statement]:
    """Every import statement of a module's `text` (inside functions too), the function it is in (None at module
    level), and whether it is explained: at module level always; inside a function when its reason is given."""
    lines = text.splitlines()

    def reason_at(node: ast.stmt) -> bool:
        own = lines[node.lineno - 1 : node.end_lineno]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        return any(REASON.search(line) for line in own) or (above.startswith("#") and bool(REASON.search(above)))

    def walk(body: list[ast.stmt], function: str | None) -> Iterator[Statement]:
        shared = False  # a run of imports shares its first one's reason
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                shared = reason_at(node) or shared
                yield node, function, function is None or shared
                continue
            shared = False
            inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            for inside in _bodies(node):
                yield from walk(inside, inner)

    yield from walk(ast.parse(text).body, None)


def _statements(module: str) -> Iterator[Statement]:
    return statements(MODULES[module].read_text())


def _imports(module: str) -> list[Import]:
    """The project modules `module` imports, at the top or inside functions."""
    found = []
    for node, function, explained in _statements(module):
        if isinstance(node, ast.ImportFrom):
            if node.level or not node.module:
                continue
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            ]
        else:
            names = [a.name for a in node.names]
        for name in dict.fromkeys(names):
            target = _project_module(name)
            if target is not None and target != module:
                found.append(Import(module, target, node.lineno, function, explained))
    return found


def _unit(module: str) -> str:
    """flows, tasks, or the folder (or top-level module) of infra/ that holds `module`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "infra" and len(parts) > 1 else parts[0]


IMPORTS = {name: _imports(name) for name in sorted(MODULES)}


def _upward() -> list[tuple[Import, str]]:
    """Every import that does not point to a lower floor, with what is wrong with it."""
    found = []
    for imports in IMPORTS.values():
        for imp in imports:
            a, b = _unit(imp.module), _unit(imp.target)
            if a == b:
                continue
            if a not in FLOOR or b not in FLOOR:
                found.append((imp, f"{a if a not in FLOOR else b} has no floor"))
            elif FLOOR[b] >= FLOOR[a]:
                side = "the same floor as" if FLOOR[a] == FLOOR[b] else f"floor {FLOOR[b]}, over floor {FLOOR[a]} of"
                found.append((imp, f"{b} on {side} {a}"))
    return found


def upward_arrows() -> list[str]:
    """Every import that does not point to a lower floor, as `file:line importer → imported (why)`."""
    return [f"{imp.where} {imp.module} → {imp.target} ({why})" for imp, why in _upward()]


def circles() -> list[str]:
    """Every import circle between modules (function-level imports count), with the import lines that make it."""
    graph = {name: {imp.target for imp in imports} for name, imports in IMPORTS.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def strongconnect(name: str) -> None:  # Tarjan's strongly connected components
        index[name] = low[name] = len(index)
        stack.append(name)
        for dep in graph[name]:
            if dep not in index:
                strongconnect(dep)
                low[name] = min(low[name], low[dep])
            elif dep in stack:
                low[name] = min(low[name], index[dep])
        if low[name] == index[name]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == name:
                    break
            if len(component) > 1:
                lines = [f"{i.where} {i.module} → {i.target}" for m in sorted(component) for i in IMPORTS[m]]
                found.append(
                    "circle of "
                    + ", ".join(sorted(component))
                    + ": "
                    + "; ".join(line for line in lines if line.rsplit(" → ", 1)[1] in component)
                )

    for name in sorted(graph):
        if name not in index:
            strongconnect(name)
    return found


def unexplained_function_imports() -> list[str]:
    """Every function-level import in flows/, tasks/ and infra/ (of anything) without its reason."""
    return [
        f"{MODULES[name].relative_to(ROOT)}:{node.lineno} in {function}()"
        for name in sorted(MODULES)
        for node, function, explained in _statements(name)
        if not explained
    ]


def function_imports() -> tuple[int, int]:
    """How many function-level imports flows/, tasks/ and infra/ hold, and how many of them say why."""
    counts = [explained for name in MODULES for _, function, explained in _statements(name) if function]
    return len(counts), sum(counts)


def test_every_arrow_points_down_a_floor():
    found = upward_arrows()
    assert not found, f"{len(found)} imports do not point down a floor (FLOORS in tests/test_layout.py):\n" + "\n".join(
        found
    )


def test_no_module_imports_itself_round_a_circle_not_even_inside_a_function():
    found = circles()
    assert not found, f"{len(found)} import circles:\n" + "\n".join(found)


def test_every_function_level_import_says_why():
    found = unexplained_function_imports()
    assert not found, (
        f"{len(found)} function-level imports without `# noqa: PLC0415 - <why>` (move them to the top of the "
        "module unless a circle or a heavy or optional import forbids it):\n" + "\n".join(found)
    )


def test_production_code_never_imports_the_demo_material():
    found = [
        f"{imp.where} {imp.module} → {imp.target} in {imp.function}()"
        for imports in IMPORTS.values()
        for imp in imports
        if _unit(imp.target) == "demo" and _unit(imp.module) != "demo"
        if (imp.module, imp.function) not in DEMO_IMPORTERS
    ]
    assert not found, "production code imports infra/demo/:\n" + "\n".join(found)


def test_the_layout_test_sees_function_level_imports_and_their_reasons():
    """The checks above can fail: an import inside a function is seen, and a bare `noqa` is not a reason."""
    text = (
        "import os\n"
        "def f():\n"
        "    import torch  # noqa: PLC0415\n"
        "    if os.sep:\n"
        "        # noqa: PLC0415 - heavy: torch\n"
        "        import torch\n"
        "        import numpy  # noqa: PLC0415\n"
        "    try:\n"
        "        import boto3  # noqa: F401, PLC0415 - optional: the `s3` extra\n"
        "    except ImportError:\n"
        "        import yaml\n"
    )
    seen = [(node.lineno, function, explained) for node, function, explained in statements(text)]
    assert seen == [(1, None, True), (3, "f", False), (6, "f", True), (7, "f", True), (9, "f", True), (11, "f", False)]
    cli = {(imp.target, imp.function) for imp in IMPORTS["flows.cli"]}
    assert any(function == "make_demo_data" and target.startswith("infra.demo") for target, function in cli)


def test_the_architecture_map_names_every_infra_folder():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    folders = sorted(p.name for p in (ROOT / "infra").iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders and [f for f in folders if f"infra/{f}/" not in text] == []


def test_the_architecture_map_shows_the_tested_floors():
    """ARCHITECTURE.md's floor table (``NN    folder/ module.py ...   what they hold``) is FLOORS, for what exists."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    shown = {}
    for line in text[text.index("floor  folders") :].splitlines()[1:]:
        if line.startswith("```"):
            break
        number, *words = line.split()
        names = itertools.takewhile(lambda w: w.endswith(("/", ".py")), words)
        shown[int(number)] = {w.removesuffix("/").removesuffix(".py") for w in names}
    units = {_unit(name) for name in MODULES}
    assert shown == {i: {u for u in floor if u in units and u != "infra"} for i, floor in enumerate(FLOORS)}


def test_the_config_stands_on_the_errors_and_bounds_only_and_every_step_names_real_settings():
    # nothing above it (infra.urls: the ground floor's check of a URL setting)
    assert {i.target for i in _imports("infra.config")} == {"infra.errors", "infra.bounds", "infra.urls"}
    assert {i.target for i in _imports("infra.bounds")} == {"infra.errors"}
    for step in STEP_SETTINGS:
        assert set(step_settings(step)) <= set(BuildConfig.settings()), step


#: The stages below the plan: they take the plan's frozen job (`infra.job.Job`, and the plan's shards where they walk
#: them), never the raw config nor the whole `BuildPlan`.
BELOW_THE_PLAN = ("preprocess", "audit", "gates", "media", "models")


def below_the_plan(offends: Callable[[ast.AST], bool]) -> list[str]:
    """Where a module below the plan has a node that `offends`: ``path:line``."""
    found = []
    for name, path in MODULES.items():
        if _unit(name) in BELOW_THE_PLAN:
            tree = ast.parse(path.read_text())
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree) if offends(node)]
    return found


def _imports_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names)


def raw_config_reads() -> list[str]:
    """Where a module below the plan imports BuildConfig or reads a plan's ``.config`` (``plan.config``,
    ``recorded_plan.config``; a model's ``vae.config`` is its own)."""

    def reads(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "config" and "plan" in ast.unparse(node.value)

    return below_the_plan(lambda node: _imports_name(node, "BuildConfig") or reads(node))


def build_plan_uses() -> list[str]:
    """Where a module below the plan imports `BuildPlan` or names it in a parameter's annotation."""

    def annotated(node: ast.AST) -> bool:
        return isinstance(node, ast.arg) and node.annotation is not None and "BuildPlan" in ast.unparse(node.annotation)

    return below_the_plan(lambda node: _imports_name(node, "BuildPlan") or annotated(node))


def test_no_stage_below_the_plan_reads_the_raw_config():
    assert raw_config_reads() == []


def test_no_stage_below_the_plan_takes_the_whole_plan():
    assert build_plan_uses() == []


#: flows → tasks → infra: every Prefect task lives in tasks/, and a flow calls the task, never the infra function the
#: task wraps (that would run the step with no task run, no retries). The flow modules that may, by (module, name),
#: and why.
TASK_BYPASSES_ALLOWED = {
    ("flows.cli", "make_plan"): "`latentforge verify` and `reconcile` plan in-process: one step, no flow run",
    ("flows.cli", "verify_plan"): "`latentforge verify`: the step in-process, no flow run (nothing is written)",
    ("flows.cli", "reconcile"): "`latentforge reconcile`: the step in-process, no flow run",
    ("flows.cli", "write_reconcile_report"): "`latentforge reconcile`: the step in-process, no flow run",
    ("flows.cli", "decode_and_verify"): "`latentforge decode`: the step in-process, no flow run",
    ("flows.cli", "audio_check"): "`latentforge audio-check`: the step in-process, no flow run",
}


def _is_task(decorator: ast.expr) -> bool:
    return ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator) in ("task", "prefect.task")


def prefect_tasks_in(text: str) -> list[int]:
    """The lines of a module's `text` that make a Prefect task: ``@task``, ``prefect.task``, `task` imported."""
    lines = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module in ("prefect", "prefect.tasks"):
            lines |= {node.lineno for a in node.names if a.name == "task"}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= {d.lineno for d in node.decorator_list if _is_task(d)}
        elif isinstance(node, ast.Attribute) and ast.unparse(node) == "prefect.task":
            lines.add(node.lineno)
    return sorted(lines)


def defines_a_task(text: str) -> bool:
    """Whether a module's `text` defines a ``@task``."""
    functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return any(_is_task(d) for n in functions for d in n.decorator_list)


InfraNames = tuple[dict[str, tuple[str, str]], dict[str, str]]


def _infra_imports(tree: ast.Module) -> InfraNames:
    """What a module imported from infra/: local name → (module, name) for a function or class; local name →
    module for a module."""
    names: dict[str, tuple[str, str]] = {}
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "infra":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in MODULES:
                    modules[a.asname or a.name] = full
                else:
                    names[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname: a.name for a in node.names if a.asname and a.name.startswith("infra.")}
    return names, modules


def _infra_name(node: ast.expr, imported: InfraNames) -> set[tuple[str, str]]:
    """The infra function `node` names (``f`` imported, or ``module.f``), as {(module, name)}; empty otherwise."""
    names, modules = imported
    if isinstance(node, ast.Name) and node.id in names:
        return {names[node.id]}
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
        return {(modules[node.value.id], node.attr)}
    return set()


def task_wrapped(text: str) -> set[tuple[str, str]]:
    """The infra functions the ``@task``s of a tasks module's `text` call: {(module, name)}."""
    tree = ast.parse(text)
    imported = _infra_imports(tree)
    tasks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_is_task, node.decorator_list))
    ]
    return {
        name
        for task in tasks
        for call in ast.walk(task)
        if isinstance(call, ast.Call)
        for name in _infra_name(call.func, imported)
    }


def task_bypasses(text: str, wrapped: set[tuple[str, str]]) -> list[tuple[str, int]]:
    """Where a flow module's `text` imports or names an infra function in `wrapped`: (its name, line)."""
    tree = ast.parse(text)
    imported = _infra_imports(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [(a.name, node.lineno) for a in node.names if (node.module, a.name) in wrapped]
        elif isinstance(node, ast.Attribute):
            found += [(name, node.lineno) for _, name in _infra_name(node, imported) & wrapped]
    return sorted(found)


WRAPPED = {name for module in MODULES if _unit(module) == "tasks" for name in task_wrapped(MODULES[module].read_text())}


def test_every_prefect_task_lives_in_tasks():
    found = [
        f"{MODULES[name].relative_to(ROOT)}:{line}"
        for name in sorted(MODULES)
        if _unit(name) != "tasks"
        for line in prefect_tasks_in(MODULES[name].read_text())
    ]
    assert found == [], "Prefect tasks outside tasks/:\n" + "\n".join(found)
    taskless = [
        n for n in MODULES if _unit(n) == "tasks" and n != "tasks" and not defines_a_task(MODULES[n].read_text())
    ]
    assert taskless == [], f"modules of tasks/ that hold no task: {taskless}"


def test_a_flow_calls_the_task_not_the_infra_function_it_wraps():
    seen = {
        (name, function, line)
        for name in sorted(MODULES)
        if _unit(name) == "flows"
        for function, line in task_bypasses(MODULES[name].read_text(), WRAPPED)
    }
    found = [
        f"{MODULES[m].relative_to(ROOT)}:{line} {f}"
        for m, f, line in sorted(seen)
        if (m, f) not in TASK_BYPASSES_ALLOWED
    ]
    assert found == [], "flows that call what a task wraps (call the task in tasks/):\n" + "\n".join(found)
    assert set(TASK_BYPASSES_ALLOWED) == {(m, f) for m, f, _ in seen}, "an allowed bypass that is gone: drop it"


def test_the_task_checks_can_fail():
    tasks_text = (
        "from prefect import task\n"
        "from infra.audit import reconcile as counting\n"
        "from infra.plan import make_plan, make_spec\n"
        "@task(name='t')\n"
        "def t(config):\n"
        "    return counting.reconcile(make_plan(config))\n"
        "def helper(config):\n"
        "    return make_spec(config)\n"
    )
    wrapped = task_wrapped(tasks_text)
    assert wrapped == {("infra.audit.reconcile", "reconcile"), ("infra.plan", "make_plan")}
    assert prefect_tasks_in(tasks_text) == [1, 4]
    assert defines_a_task(tasks_text) and not defines_a_task("from prefect import task\n")
    flow_text = (
        "import prefect\n"
        "from infra.plan import make_plan, make_spec\n"
        "from infra.audit import reconcile\n"
        "@prefect.task\n"
        "def f(config):\n"
        "    return reconcile.reconcile(make_spec(config))\n"
    )
    assert task_bypasses(flow_text, wrapped) == [("make_plan", 2), ("reconcile", 6)]
    assert prefect_tasks_in(flow_text) == [4]
    assert ("infra.plan", "make_plan") in WRAPPED and ("infra.preprocess.shard", "process_shard") in WRAPPED


@pytest.mark.parametrize("contract", [Source, Format, FamilySpec, Remote])
def test_a_contract_with_a_missing_method_fails_at_construction(contract):
    incomplete = type(f"Incomplete{contract.__name__}", (contract,), {"name": "x", "keys": {}, "components": ()})
    with pytest.raises(TypeError, match="abstract"):
        incomplete()


def test_a_family_or_format_that_does_not_declare_its_names_fails_at_import():
    with pytest.raises(TypeError, match="does not declare name"):
        type("Nameless", (Format,), {"writer": None, "paths": None, "read": None, "keys": {}})
    methods = dict.fromkeys(("matches", "rules", "latent_shape", "text_shape", "load"))
    with pytest.raises(TypeError, match="does not declare components"):
        type("Partless", (FamilySpec,), {**methods, "name": "x", "latent_norm": "n"})


def test_one_registry_error_for_every_kind():
    registry: Registry[int] = Registry("widget")
    registry.add("a", 1)
    with pytest.raises(ValueError, match=r"unknown widget 'b'; known widgets: a"):
        registry.get("b")
    from infra.formats import get_format  # noqa: PLC0415
    from infra.models import get_family  # noqa: PLC0415
    from infra.sources import open_source  # noqa: PLC0415

    for lookup, kind in (
        (get_format, "format"),
        (get_family, "family"),
        (lambda n: open_source(f"{n}:x"), "source kind"),
    ):
        with pytest.raises(ValueError, match=rf"unknown {kind} 'nope'; known "):
            lookup("nope")


def main() -> None:
    """The counts for a note, and every offender."""
    arrows, found = upward_arrows(), circles()
    pairs = {(_unit(imp.module), _unit(imp.target)) for imp, _ in _upward()}
    total, explained = function_imports()
    print(f"upward arrows: {len(arrows)} imports, {len(pairs)} between folders: {sorted(pairs)}")
    print(f"circles: {len(found)}")
    print(f"function-level imports: {total}, {explained} with a reason, {total - explained} without")
    for line in [*arrows, *found, *unexplained_function_imports()]:
        print(" ", line)


if __name__ == "__main__":
    main()
