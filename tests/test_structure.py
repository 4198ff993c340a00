"""The package's shape, from the imports each module makes when it is imported (module level, and
the imports for type checkers): no circle between its modules, and the offline assets (which run
pip in a subprocess) imported by none of them. Imports inside functions (the deprecated shims of
`adapters` call `surgery` that way) are not part of this shape."""

import ast
import pathlib

import optimum_gradmap

PACKAGE = pathlib.Path(optimum_gradmap.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_statements(body: list[ast.stmt], with_type_checking: bool) -> list[ast.stmt]:
    statements = []
    for node in body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            statements += node.body if with_type_checking else []
        else:
            statements.append(node)
    return statements


def _module_level_imports(path: pathlib.Path, with_type_checking: bool = False) -> set[str]:
    """Modules of the package that `path` imports at module level (not inside functions; the imports
    for type checkers only with `with_type_checking`)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _top_level_statements(ast.parse(path.read_text()).body, with_type_checking):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(0, node.level - 1)):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    return {name for name in found if name in modules and name != module}


def test_no_import_circle_between_the_packages_modules_not_even_for_type_checkers():
    graph = {_module_name(path): _module_level_imports(path, with_type_checking=True) for path in PACKAGE.rglob("*.py")}
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


def test_no_module_imports_the_offline_assets_at_module_level():
    importers = [_module_name(path) for path in PACKAGE.rglob("*.py") if "optimum_gradmap.assets" in _module_level_imports(path)]
    assert importers == []
