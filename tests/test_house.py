"""The package's shape holds: layer folders whose imports run one way, no import circles, small modules and
functions, and the whole config stopping above the numerics."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "deit_ablate"
# The layers, bottom first: a module imports only from its own layer and the ones below it.
LAYERS = ("core", "config", "data", "record", "train", "run", "analysis", "bench")
ENTRY_SHIMS = {"sharpness.py", "disagreement.py", "status.py"}  # `python -m deit_ablate.<name>` kept at its old path
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_MODULES = 400, 60, 5
# The whole config is a parameter named `cfg` or annotated `DictConfig` (a schema group such as `data: DataConfig`
# is a typed piece). No function of core/, data/, train/ or bench/ takes it: data/'s builders take the groups they
# read (a TransformSpec, DataConfig, RuntimeConfig), bench/ composes its config at its entry and hands pieces down.
# Above them it is taken where a whole config is the point: building a stage's config (config/), hashing and logging
# it (record/: the identity, folder names, wandb), Hydra's own hooks and resolvers, and run/'s entry, plan and checks
# (issue 37: at most 40 in all; 111 before). The count may only fall.
NO_WHOLE_CONFIG = ("core", "data", "train", "bench", "analysis")
MAX_WHOLE_CONFIG = 39


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every deit_ablate module a file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("deit_ablate"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("deit_ablate"))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def test_the_top_level_holds_at_most_five_modules_and_every_other_module_is_in_a_layer():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES and set(top) <= {"__init__.py", *ENTRY_SHIMS}, top
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(LAYERS), folders


def test_imports_between_layers_run_one_way():
    upward = [f"{m} imports {i}" for m, imports in _graph().items() for i in imports
              if _layer(m) and (_layer(i) is None or LAYERS.index(_layer(i)) > LAYERS.index(_layer(m)))]
    assert upward == []


def test_no_import_circles():
    graph, state, circles = _graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                circles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, [*path, other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_no_module_over_400_lines_and_no_function_over_60():
    long_modules, long_functions = [], []
    for module, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((module, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append((module, node.name, lines))
    assert (long_modules, long_functions) == ([], [])


def _takes_whole_config(param: ast.arg) -> bool:
    """A parameter named `cfg`, or annotated `DictConfig` in any spelling (`DictConfig | None`,
    `omegaconf.DictConfig`, a string annotation), so a rename cannot hide it."""
    if param.arg == "cfg":
        return True
    annotation = param.annotation
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return annotation is not None and any(
        (isinstance(node, ast.Name) and node.id == "DictConfig")
        or (isinstance(node, ast.Attribute) and node.attr == "DictConfig") for node in ast.walk(annotation))


def whole_config_functions() -> list[tuple[str, str]]:
    """(module, function) of every function that takes the whole config: a parameter named `cfg` or annotated
    `DictConfig` (one annotated with a schema group, `data: DataConfig`, is a typed piece and not counted)."""
    found = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                          node.args.kwarg]
                if any(_takes_whole_config(a) for a in params if a is not None):
                    found.append((module, node.name))
    return found


def test_the_whole_config_stops_above_train_and_takes_no_new_functions():
    found = whole_config_functions()
    assert [f for f in found if _layer(f[0]) in NO_WHOLE_CONFIG] == []
    assert len(found) <= MAX_WHOLE_CONFIG, len(found)
