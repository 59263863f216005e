"""The package's imports run one way: each unit imports only units below it, and no
modules import each other in a circle. The layers, top to bottom, are in docs/design.md."""

from __future__ import annotations

import ast
from pathlib import Path

import lever_actors

PACKAGE = Path(lever_actors.__file__).parent

# top to bottom; a unit is a subpackage or a top-level module of lever_actors. The line in
# docs/design.md: cli -> serve/bench/testing -> engine -> actors/plan -> policy ->
# target/draft/plain_target -> checkpoints -> device -> text/options -> model/channels/config ->
# plumbing -> errors/logs
LAYERS = (
    ("launch",),
    ("cli",),
    ("serve", "bench", "testing"),
    ("engine",),
    ("actors", "plan"),
    ("policy",),
    ("target", "draft", "plain_target"),
    ("checkpoints",),
    ("device",),
    ("text", "options"),
    ("model", "channels", "config"),
    ("progress", "sizes", "paths", "threads", "machine"),
    ("errors", "logs"),
)
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
# optional heavy dependencies: the only imports allowed inside a function, each with a reason
OPTIONAL = ("matplotlib", "transformers", "accelerate", "hypothesis")


class Import:
    def __init__(self, module: str, target: str, line: int, in_function: bool) -> None:
        self.module, self.target, self.line, self.in_function = module, target, line, in_function

    def __repr__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[Import]:
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    # the lazy public face names its modules for type checkers only: those imports never run
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports the module
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found += [Import(module, t, node.lineno, id(node) in in_function) for t in targets]
    return found


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "lever_actors" and len(parts) > 1 else None


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
IMPORTS = [i for path in MODULES.values() for i in imports_of(path)]
INTERNAL = [i for i in IMPORTS if i.target.split(".")[0] == "lever_actors"]


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in MODULES} - {None}
    assert units <= set(LAYER_OF), f"units missing from LAYERS: {units - set(LAYER_OF)}"


def test_imports_only_run_down_the_layers():
    upward = []
    for i in INTERNAL:
        source, target = unit_of(i.module), unit_of(i.target)
        if source is None or target is None or source == target:
            continue
        if target not in LAYER_OF:  # a name from the package root (__version__): every
            continue  # unit has a layer (the test above), so this is not a module
        if LAYER_OF[target] <= LAYER_OF[source]:
            upward.append(i)
    assert not upward, "imports against the layering:\n" + "\n".join(map(repr, upward))


def test_no_module_imports_itself_through_others():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in INTERNAL:
        if i.target in MODULES and i.target != i.module:
            graph[i.module].add(i.target)
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_inside_functions_are_optional_heavy_dependencies_with_a_reason():
    bad = []
    for i in IMPORTS:
        if not i.in_function:
            continue
        lines = MODULES[i.module].read_text().splitlines()
        reason = "#" in lines[i.line - 1] or lines[i.line - 2].strip().startswith("#")
        if i.target.split(".")[0] not in OPTIONAL or not reason:
            bad.append(i)
    assert not bad, "imports inside functions:\n" + "\n".join(map(repr, bad))


def test_command_line_parsing_lives_in_the_cli():
    parsing = sorted(
        {i.module for i in IMPORTS if i.target == "argparse" and unit_of(i.module) != "cli"}
    )
    assert not parsing, "argparse outside cli/: " + ", ".join(parsing)
