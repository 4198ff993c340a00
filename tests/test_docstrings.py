"""Docstrings say what the code does: every argument a public function's docstring documents is one of
its parameters, and the metrics module's table names every registered metric."""

import importlib
import inspect
import pkgutil
import re

import optimum_gradmap
from optimum_gradmap.importance import importance_metric_names


def _public_functions():
    for module_info in pkgutil.walk_packages(optimum_gradmap.__path__, "optimum_gradmap."):
        if module_info.name.endswith("vllm_worker"):
            continue  # runs inside vLLM's environment
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                yield f"{module.__name__}.{name}", value
            elif inspect.isclass(value):
                for method_name, method in vars(value).items():
                    function = method.__func__ if isinstance(method, (classmethod, staticmethod)) else method
                    if inspect.isfunction(function) and (not method_name.startswith("_") or method_name == "__init__"):
                        yield f"{module.__name__}.{name}.{method_name}", function


def _documented_arguments(docstring: str) -> list[str]:
    lines = docstring.splitlines()
    if not any(line.strip() == "Args:" for line in lines):
        return []
    start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    indent = len(lines[start]) - len(lines[start].lstrip()) + 4
    names = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break  # the next section
        match = re.match(rf"^ {{{indent}}}(\*{{0,2}}\w[\w, *]*?)(?: \(|:)", line)
        if match:
            names += [name.strip().lstrip("*") for name in match.group(1).split(",")]
    return names


def test_every_documented_argument_is_a_parameter():
    wrong = []
    for name, function in _public_functions():
        parameters = set(inspect.signature(function).parameters)
        for documented in _documented_arguments(inspect.getdoc(function) or ""):
            if documented not in parameters:
                wrong.append(f"{name}: documents `{documented}`, which it does not take")
    assert wrong == []


def test_the_metrics_module_names_every_registered_metric():
    from optimum_gradmap.importance import metrics

    assert [name for name in importance_metric_names() if f'`"{name}"`' not in metrics.__doc__] == []
