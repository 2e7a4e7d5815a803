"""Lightning, jsonargparse and torch are used through their public APIs: no class of the package overrides a
private method of a base class from them, and no module reads the text of an error they raise with regular
expressions or substring tests (what went wrong is told by the error's type and by what we see ourselves)."""

from __future__ import annotations

import ast
import importlib
import inspect

from tests.conftest import REPO

PACKAGE = REPO / "vision_attn"
LIBRARIES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "jsonargparse", "torch",
             "argparse")  # argparse: the base of jsonargparse's parser, whose ArgumentError it raises


def from_library(name: str) -> bool:
    return any(name == library or name.startswith(f"{library}.") for library in LIBRARIES)


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_in_body(cls: type) -> set[str]:
    """The names a class's own body binds (methods, assignments), not those its metaclass adds (torch's autograd
    ``Function`` gives every subclass a ``_backward_cls``)."""
    body = ast.parse(inspect.getsource(cls).strip()).body[0]
    names = set()
    for node in body.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def test_no_class_overrides_a_private_method_of_a_lightning_jsonargparse_or_torch_base() -> None:
    """Every class of the package, mixins included: a private name (``_x``, not ``__x__``) defined by one of our
    classes in its MRO must not be defined by a library class in that MRO too."""
    overrides, checked = [], 0
    for name in module_names():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name:
                continue
            bases = [base for base in cls.__mro__ if from_library(base.__module__)]
            checked += bool(bases)
            for ours in (base for base in cls.__mro__ if base.__module__.startswith("vision_attn")):
                for attribute, value in vars(ours).items():
                    if (private(attribute) and callable(value) and any(attribute in vars(base) for base in bases)
                            and attribute in defined_in_body(ours)):
                        overrides.append(f"{ours.__module__}.{ours.__qualname__}.{attribute} (in {cls.__qualname__})")
    assert checked > 10  # the tasks, DataModules, CLI, callbacks and networks were looked at
    assert not overrides, sorted(set(overrides))


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Each name a module binds by an import -> what it names (``Image`` -> ``PIL.Image``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({alias.asname or alias.name.partition(".")[0]: alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    return names


def may_come_from_the_libraries(caught: ast.expr | None, names: dict[str, str]) -> bool:
    """Whether an ``except`` clause catching ``caught`` may catch an error Lightning, jsonargparse or torch
    raise: one of their types, or a builtin one (torch raises RuntimeError, ValueError ...). A type that another
    library names (``PIL.Image.DecompressionBombError``), or the package itself (``CheckpointError``), does not."""
    if caught is None:
        return True
    if isinstance(caught, ast.Tuple):
        return any(may_come_from_the_libraries(element, names) for element in caught.elts)
    root = caught
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name):
        return True
    return from_library(names[root.id]) if root.id in names else True  # a builtin (or a class of the module)


def is_text_of(node: ast.AST, errors: set[str], texts: set[str]) -> bool:
    """Whether ``node`` holds the text of one of the ``errors`` (``str(error)``, ``repr(error)``, ``error.args``,
    ``f"{error}"``) or a name ``texts`` holds such a text in."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name) and inner.id in texts:
            return True
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id in ("str", "repr") \
                and any(isinstance(arg, ast.Name) and arg.id in errors for arg in inner.args):
            return True
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id in errors \
                and inner.attr == "args":
            return True
        if isinstance(inner, ast.FormattedValue) and isinstance(inner.value, ast.Name) and inner.value.id in errors:
            return True
    return False


def text_reads(body: list[ast.stmt], errors: set[str], names: dict[str, str]) -> list[int]:
    """The lines of ``body`` that give the text of one of ``errors`` to a ``re`` function or test a substring in
    it (``"..." in str(error)``), following the names the text is assigned to (``text = str(error)``)."""
    nodes = [inner for statement in body for inner in ast.walk(statement)]
    texts: set[str] = set()
    for assign in sorted((node for node in nodes if isinstance(node, ast.Assign)), key=lambda node: node.lineno):
        if is_text_of(assign.value, errors, texts):
            texts |= {target.id for target in assign.targets if isinstance(target, ast.Name)}
    lines = []
    for node in nodes:
        regex = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            isinstance(node.func.value, ast.Name) and names.get(node.func.value.id) == "re" and \
            any(is_text_of(argument, errors, texts) for argument in node.args)
        substring = isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and \
            any(is_text_of(comparator, errors, texts) for comparator in node.comparators)
        if regex or substring:
            lines.append(node.lineno)
    return lines


def error_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters of ``function`` annotated as errors (``error: BaseException``)."""
    arguments = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    return {argument.arg for argument in arguments if argument.annotation is not None and any(
        isinstance(inner, ast.Name | ast.Attribute) and (inner.id if isinstance(inner, ast.Name) else inner.attr)
        .endswith(("Error", "Exception")) for inner in ast.walk(argument.annotation))}


def reads_of_error_text(source: str) -> dict[int, str]:
    """The lines of ``source`` that read the text of an error Lightning, jsonargparse or torch may raise, with
    the function they are in: in an ``except`` clause that may catch such an error (``may_come_from_the_
    libraries``), or in a function given an error (a parameter annotated as one)."""
    tree = ast.parse(source)
    names = imported_names(tree)
    found: dict[int, str] = {}
    for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)):
        scopes = [(function.body, error_parameters(function))]
        scopes += [(handler.body, {handler.name}) for handler in ast.walk(function)
                   if isinstance(handler, ast.ExceptHandler) and handler.name
                   and may_come_from_the_libraries(handler.type, names)]
        for body, errors in scopes:
            found.update({line: function.name for line in text_reads(body, errors, names) if errors})
    return found


# Where the text is all there is: torch's DataLoader hands a worker's error over as one built from its formatted
# traceback (torch.utils.data._utils.ExceptionWrapper), and no public API gives the original error or its message.
TEXT_ONLY = {("vision_attn/errors.py", "user_message")}


def test_no_module_reads_the_text_of_a_library_error() -> None:
    found = {(str(path.relative_to(REPO)), function): line for path in sorted(PACKAGE.rglob("*.py"))
             for line, function in reads_of_error_text(path.read_text(encoding="utf-8")).items()}
    assert TEXT_ONLY <= set(found), "an allowance no longer needed: remove it from TEXT_ONLY"
    assert not set(found) - TEXT_ONLY, {place: line for place, line in found.items() if place not in TEXT_ONLY}


def test_the_error_text_check_finds_what_it_is_for() -> None:
    """The check above flags a regex or a substring test over a caught torch or builtin error's text, and leaves
    another library's error and our own data alone."""
    sample = (
        "import re\n"
        "import torch\n"
        "from PIL import Image\n"
        "def load(path, key):\n"
        "    try:\n"
        "        torch.load(path)\n"
        "    except RuntimeError as error:\n"
        "        found = re.search(r'size mismatch for ([^:]+)', str(error))\n"
        "    except torch.serialization.pickle.UnpicklingError as error:\n"
        "        if 'GLOBAL' in str(error):\n"
        "            raise\n"
        "    except Image.DecompressionBombError as error:\n"
        "        found = re.search(r'(\\d+) pixels', str(error))\n"
        "    except KeyError:\n"
        "        found = re.fullmatch(r'model\\.(.*)', key)\n"
        "def reason(error: BaseException) -> str:\n"
        "    text = str(error)\n"
        "    kind = type(error).__name__\n"
        "    return 'refused' if re.search('global', text) or 'x' in kind else ''\n")
    assert reads_of_error_text(sample) == {8: "load", 10: "load", 19: "reason"}
