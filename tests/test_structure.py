"""The package's shape, from every import its modules make (at module level, inside functions, and for
type checkers): no circle between its modules, the architecture adapters and the configuration at the
bottom (they import nothing, or only modules that import nothing, from the package), no module that
imports the offline assets (which run pip in a subprocess) when it is imported, and no deprecated name."""

import ast
import pathlib

import optimum_gradmap

PACKAGE = pathlib.Path(optimum_gradmap.__file__).parent
MODULES = {path: ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts) for path in PACKAGE.rglob("*.py")}
MODULES = {path: name.removesuffix(".__init__") for path, name in MODULES.items()}


def _imports(path: pathlib.Path, module_level_only: bool = False, runtime_only: bool = False) -> set[str]:
    """Modules of the package that `path` imports: everywhere in it, or only at module level (outside
    functions), or only at run time (not under `if TYPE_CHECKING:`)."""
    module = MODULES[path]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if runtime_only and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if module_level_only and in_function:
            return
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(0, node.level - 1)):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    names = set(MODULES.values())
    return {name for name in found if name in names and name != module}


def test_no_import_circle_between_the_packages_modules_counting_imports_inside_functions_and_for_type_checkers():
    graph = {MODULES[path]: _imports(path) for path in MODULES}
    # a package's __init__ importing its submodules is not a circle; a submodule importing its own
    # package's __init__ back (or any module importing one that imports it) is
    edges = {module: {target for target in targets if not module.startswith(target + ".")} for module, targets in graph.items()}
    visiting, done, cycles = set(), set(), []

    def visit(module, trail):
        visiting.add(module)
        for target in edges.get(module, ()):
            if target in visiting:
                cycles.append(trail[trail.index(target) :] + [target] if target in trail else [module, target])
            elif target not in done:
                visit(target, trail + [target])
        visiting.discard(module)
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            visit(module, [module])
    assert cycles == []


def _unit(module: str) -> str:
    """The package a module belongs to: a top-level module, or a subpackage (`optimum_gradmap.heal.loop` -> `heal`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_graph() -> dict[str, set[str]]:
    """Which packages import which, every import counted (inside functions and for type checkers too)."""
    graph: dict[str, set[str]] = {}
    for path, module in MODULES.items():
        if module == "optimum_gradmap":
            continue
        targets = {_unit(target) for target in _imports(path) if target != "optimum_gradmap"}
        graph.setdefault(_unit(module), set()).update(targets - {_unit(module)})
    return graph


def test_no_loop_among_the_packages_counting_every_import():
    """A package (a top-level module or a subpackage) never imports one that imports it back, however far round."""
    graph = _package_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            unit = todo.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                todo += graph.get(unit, ())
        return False

    assert sorted((unit, target) for unit, targets in graph.items() for target in targets if reaches(target, unit)) == []


# The algorithm code (what scores, fits, trains, quantizes, evaluates) and the orchestration that runs it in order.
ALGORITHMS = ("importance", "compensation", "heal", "quantize", "evaluation", "distillation", "objectives", "vocabulary")
ORCHESTRATION = ("pipeline", "pruner", "result", "planning", "commands", "cli")


def test_the_algorithm_packages_never_import_the_orchestration():
    graph = _package_graph()
    assert {unit: sorted(graph.get(unit, set()) & set(ORCHESTRATION)) for unit in ALGORITHMS} == {unit: [] for unit in ALGORITHMS}


def test_no_module_imports_another_modules_private_name():
    """A helper two modules need is public in one of them."""
    found = []
    for path, module in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("optimum_gradmap")):
                found += [
                    f"{module}: {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and alias.name != "__version__"
                ]
    assert found == []


def _required_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a call must give (no default; `self` and `cls` not counted)."""
    arguments = node.args
    positional = arguments.posonlyargs + arguments.args
    required = len(positional) - len(arguments.defaults) + sum(default is None for default in arguments.kw_defaults)
    return required - (1 if positional and positional[0].arg in ("self", "cls") else 0)


def test_settings_travel_as_one_object_not_as_a_dozen_arguments():
    """At most 10 functions take more than 6 required parameters, none more than 10: a group of settings is passed as
    one frozen object (a step's settings, the config), not spread into arguments."""
    wide = sorted(
        (_required_parameters(node), f"{module}.{node.name}")
        for path, module in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _required_parameters(node) > 6
    )
    assert len(wide) <= 10 and all(count <= 10 for count, _ in wide), wide
    assert not [module for path, module in MODULES.items() if "# fmt: skip" in path.read_text()]


def _path(name: str) -> pathlib.Path:
    return next(path for path, module in MODULES.items() if module == name)


def test_the_adapters_import_nothing_from_the_package_and_the_configuration_only_leaves():
    assert _imports(_path("optimum_gradmap.adapters")) == set()
    assert _imports(_path("optimum_gradmap.errors")) == set()
    leaves = {name for path, name in MODULES.items() if not _imports(path, runtime_only=True)}
    above_leaves = {name for path, name in MODULES.items() if _imports(path, runtime_only=True) <= leaves}
    assert _imports(_path("optimum_gradmap.configuration")) <= above_leaves  # the errors, the metric registry, settings


def test_no_module_imports_the_offline_assets_at_module_level():
    importers = [name for path, name in MODULES.items() if "optimum_gradmap.assets" in _imports(path, module_level_only=True)]
    assert importers == []


def test_no_deprecation_layer_is_left():
    sources = {name: path.read_text() for path, name in MODULES.items()}
    assert [name for name, text in sources.items() if "FutureWarning" in text or "deprecated" in text.lower()] == []
    assert [name for name, text in sources.items() if "\ndef __getattr__(" in text or "\n__getattr__ =" in text] == []


def test_stage_2_imports_nothing_from_the_heal_stage_that_comes_after_it():
    """The teacher's targets both distil from live in `optimum_gradmap.distillation`."""
    stage2 = [path for path, name in MODULES.items() if name.startswith("optimum_gradmap.compensation")]
    assert stage2 and not [path.name for path in stage2 if "optimum_gradmap.heal" in _imports(path)]


# A newcomer reads a module top to bottom and a function on one screen: the configuration, a dataclass of documented
# fields, may be longer than the rest.
MAX_MODULE_LINES = {"optimum_gradmap.configuration": 800}
MODULE_LINES = 600
FUNCTION_LINES = 80


def test_no_module_is_longer_than_600_lines_but_the_configuration():
    lengths = {name: len(path.read_text().splitlines()) for path, name in MODULES.items()}
    too_long = {name: length for name, length in lengths.items() if length > MAX_MODULE_LINES.get(name, MODULE_LINES)}
    assert too_long == {}


def test_no_function_is_longer_than_80_lines_docstring_included():
    too_long = []
    for path, name in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
