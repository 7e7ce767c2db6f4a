"""The package's layering, read from its source: imports form no cycle, the core imports no command,
and (once the runtime configuration is read at the edge) only specdec/config.py touches os.environ."""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specdec"
COMMANDS = ("specdec.cli", "specdec.bench")  # may import the core; the core never imports them


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__.py)."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imported(name: str, f: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (inside functions too: a lazy
    import still ties the two modules together). ``from specdec.bench import batch`` -> specdec.bench.batch."""
    found = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 packages
                parts = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # specdec.x.Name -> specdec.x
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, f in modules.items():
        g.add_node(name)
        g.add_edges_from((name, t) for t in _imported(name, f, modules))
    return g


def test_import_graph_has_no_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_commands_and_benches_import_each_other_without_cycles():
    g = import_graph()
    commands = g.subgraph(n for n in g if n.startswith(COMMANDS))
    assert nx.is_directed_acyclic_graph(commands), list(nx.simple_cycles(commands))


def test_the_core_imports_no_command():
    g = import_graph()
    wrong = [(a, b) for a, b in g.edges if not a.startswith(COMMANDS) and b.startswith(COMMANDS)]
    assert not wrong, f"core modules importing commands: {wrong}"


def test_only_the_config_module_touches_the_environment():
    readers = [str(f.relative_to(ROOT)) for name, f in _modules().items()
               if name != "specdec.config" and ("os.environ" in (text := f.read_text(encoding="utf-8"))
                                                      or "getenv" in text)]
    assert not readers, f"os.environ outside specdec/config.py: {readers}"


def test_a_command_that_offers_numerics_loads_its_target_in_them():
    """A command's option is honoured or refused, never ignored: every module that adds ``--numerics``
    (``add_weights_argument`` / ``add_numerics_argument``) passes a ``numerics`` to each ``load_model`` call
    (bench-structured once took the option and loaded in exact numerics whatever it said)."""
    missing = []
    for f in PACKAGE.rglob("*.py"):
        if f.name == "arguments.py":
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        if not any(c.func.id in ("add_weights_argument", "add_numerics_argument") for c in calls):
            continue
        missing += [f"{f.relative_to(ROOT)}:{c.lineno}" for c in calls
                    if c.func.id == "load_model" and not any(k.arg == "numerics" for k in c.keywords)]
    assert not missing, f"load_model without numerics in a command that offers --numerics: {missing}"
