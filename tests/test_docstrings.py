"""Docstrings say what the code does: every argument a public function's docstring documents is one of
its parameters, every default a docstring states (`name (`type`, defaults to X)`) is the signature's, and the
metrics module's table names every registered metric."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import sys

import optimum_gradmap

# Defaults stated wrongly in files another change is editing at the same time (issue 55, 4.10): that change
# corrects each docstring and removes its entry here; the list must end empty. (function, argument): (the
# docstring's default, the signature's).
KNOWN_WRONG_DEFAULTS: dict[tuple[str, str], tuple[str, str]] = {}


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


def _public_classes():
    for module_info in pkgutil.walk_packages(optimum_gradmap.__path__, "optimum_gradmap."):
        if module_info.name.endswith("vllm_worker"):
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if not name.startswith("_") and inspect.isclass(value) and value.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", value


_NAMES = re.compile(r"(\*{0,2}\w[\w, *]*?)(?: \(|:)")


def _documented_entries(docstring: str) -> list[tuple[list[str], str]]:
    """Each entry of the Args section: its argument names and its parenthesised header (`(`int`, defaults to 8)`,
    or "" for an entry without one). A line may hold several entries: `check_every (`int`, defaults to 10),
    patience (`int`, defaults to 5): ...`."""
    lines = docstring.splitlines()
    if not any(line.strip() == "Args:" for line in lines):
        return []
    start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    indent = len(lines[start]) - len(lines[start].lstrip()) + 4
    entries = []
    for number, line in enumerate(lines[start + 1 :], start + 1):
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break  # the next section
        if not re.match(rf"^ {{{indent}}}\S", line):
            continue  # a description's next line
        text, position = " ".join([line[indent:], *(later.strip() for later in lines[number + 1 :])]), 0
        while (match := _NAMES.match(text, position)) is not None:
            names = [name.strip().lstrip("*") for name in match.group(1).split(",")]
            if match.group(0).endswith(":"):
                entries.append((names, ""))
                break
            depth, opening = 0, match.end() - 1
            for closing in range(opening, len(text)):
                depth += {"(": 1, ")": -1}.get(text[closing], 0)
                if depth == 0:
                    break
            entries.append((names, text[opening : closing + 1]))
            if not text.startswith(", ", closing + 1):
                break
            position = closing + 3
    return entries


def _documented_arguments(docstring: str) -> list[str]:
    return [name for names, _ in _documented_entries(docstring) for name in names]


def _documented() -> list[tuple[str, object, str]]:
    """Every public function and class with its docstring (a class's Args are its constructor's)."""
    found = [(name, function, inspect.getdoc(function) or "") for name, function in _public_functions()]
    return found + [(name, cls, inspect.cleandoc(cls.__doc__ or "")) for name, cls in _public_classes()]


def _parameters(documented) -> dict | None:
    try:
        return dict(inspect.signature(documented).parameters)
    except (TypeError, ValueError):  # a class without an inspectable constructor
        return None


def test_every_documented_argument_is_a_parameter():
    wrong = []
    for name, documented, docstring in _documented():
        parameters = _parameters(documented)
        for argument in _documented_arguments(docstring) if parameters is not None else ():
            if argument not in parameters:
                wrong.append(f"{name}: documents `{argument}`, which it does not take")
    assert wrong == []


def _stated_default(header: str) -> str | None:
    """X in a header `(`type`, defaults to X)`, without its backticks; `None` where the header states no default."""
    match = re.search(r"\bdefaults to (.*)\)$", header)
    if match is None:
        return None
    stated = match.group(1).strip()
    return stated[1:-1] if stated.startswith("`") and stated.endswith("`") else stated


def _value(stated: str, namespace: dict):
    """The value a stated default names: a Python literal, or a name of the function's module."""
    try:
        return ast.literal_eval(stated)
    except (ValueError, SyntaxError):
        pass
    if re.fullmatch(r"[A-Za-z_][\w.]*", stated):
        value = namespace.get(stated.split(".")[0], KeyError)
        for attribute in stated.split(".")[1:]:
            value = getattr(value, attribute, KeyError)
        if value is not KeyError:
            return value
    raise LookupError(stated)


def _same(stated, actual) -> bool:
    if isinstance(stated, bool) or isinstance(actual, bool):  # True == 1 and False == 0, but they are no numbers here
        return type(stated) is type(actual) and stated == actual
    numbers = (int, float)
    if isinstance(stated, numbers) and isinstance(actual, numbers):
        return stated == actual
    return type(stated) is type(actual) and stated == actual


def _signature_defaults(documented) -> dict:
    """Parameter -> default of a function, or of a class's constructor (a dataclass field's `default_factory` called)."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(documented).parameters.items()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    if inspect.isclass(documented) and dataclasses.is_dataclass(documented):
        for field in dataclasses.fields(documented):
            if field.default_factory is not dataclasses.MISSING and field.name in defaults:
                defaults[field.name] = field.default_factory()
    return defaults


def _default_mismatches(documented, docstring: str) -> dict[str, tuple[str, str]]:
    """Argument -> (the default `docstring` states for it, the signature's) wherever they differ."""
    if _parameters(documented) is None:
        return {}
    defaults = _signature_defaults(documented)
    namespace = sys.modules[documented.__module__].__dict__
    wrong = {}
    for names, header in _documented_entries(docstring):
        stated = _stated_default(header)
        for argument in names if stated is not None else ():
            actual = defaults.get(argument, inspect.Parameter.empty)
            if actual is inspect.Parameter.empty:
                wrong[argument] = (stated, "no default" if argument in defaults else "no such parameter")
                continue
            try:
                same = _same(_value(stated, namespace), actual)
            except LookupError:  # prose, or a name the module does not have: not a default one can check
                same = False
            if not same:
                wrong[argument] = (stated, repr(actual))
    return wrong


def _wrong_defaults() -> dict[tuple[str, str], tuple[str, str]]:
    """(function or class, argument) -> (the docstring's default, the signature's) wherever they differ."""
    return {
        (name, argument): found
        for name, documented, docstring in _documented()
        for argument, found in _default_mismatches(documented, docstring).items()
    }


def test_the_default_check_finds_wrong_values_prose_and_missing_defaults():
    def example(a, b=4, c="x", d=True, e=None, f=(1, 2), g=1e-3, h=0):
        """Example.

        Args:
            a (`int`, defaults to 1): Required, in fact.
            b (`int`, defaults to 8), c (`str`, defaults to `"x"`): A wrong one, then a right one on the same line.
            d (`bool`, defaults to `True`): Right.
            e (`str`, *optional*): Says nothing.
            f (`tuple`, defaults to `(1, 2)`), g (`float`, defaults to 0.001): Right.
            h (`bool`, defaults to `False`): 0 is not False here.
            z (`int`, defaults to the usual): Prose, and no such parameter.
        """

    found = _default_mismatches(example, inspect.getdoc(example))
    assert found == {
        "a": ("1", "no default"),
        "b": ("8", "4"),
        "h": ("False", "0"),
        "z": ("the usual", "no such parameter"),
    }


def test_every_default_a_docstring_states_is_the_signatures():
    wrong = _wrong_defaults()
    assert {key: value for key, value in wrong.items() if key not in KNOWN_WRONG_DEFAULTS} == {}
    # an entry fixed meanwhile leaves the list of known exceptions
    assert {key: value for key, value in KNOWN_WRONG_DEFAULTS.items() if wrong.get(key) != value} == {}


def test_the_metrics_module_names_every_builtin_metric():
    from optimum_gradmap.importance import metrics
    from optimum_gradmap.metric_registry import BUILTIN_METRIC_NAMES

    assert [name for name in BUILTIN_METRIC_NAMES if f'`"{name}"`' not in metrics.__doc__] == []


def test_reg_lambdas_help_says_how_each_selection_holds_calibration_sequences_out():
    import dataclasses

    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.compensation import AUTO_NUM_FOLDS

    (field,) = [field for field in dataclasses.fields(GradMAPConfig) if field.name == "reg_lambda"]
    help_text = field.metadata["help"]
    # next_token_loss (the default where it runs): one held-out fold, the other three fitted, then a refit on all
    assert f"j % {AUTO_NUM_FOLDS} == {AUTO_NUM_FOLDS - 1}" in help_text and "next_token_loss" in help_text
    # hidden_state: every fold held out in turn
    assert f"{AUTO_NUM_FOLDS}-fold cross-validation" in help_text and "hidden_state" in help_text
    assert "on all of them" in help_text
