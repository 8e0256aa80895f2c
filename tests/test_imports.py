"""The shape of the code: launch/'s four wings import one way only, and no import circle anywhere.

The graph is read from the source with :mod:`ast`, nothing is imported. Its nodes are the modules of
the project's own packages (commweave, ds_plugins, megatron_patches, launch, benchmarks, examples);
an edge A -> B is any ``import`` or ``from ... import`` statement in A that names B, wherever it
stands: at the top, inside a function or method (a lazy import still makes A need B when it runs,
and a circle through one only works by the order of imports), under ``if``/``try``. ``from P import
x`` counts as an edge to the module ``P.x`` when that is a module of the project, else to ``P``
(the package's ``__init__``); ``import P.Q`` counts as an edge to ``P.Q``; relative imports are
resolved against A's package; the compiled extension ``ds_plugins._C`` (named in setup.py) is a
module with no imports. The implicit import of a module's parent packages is not an edge (a
package that re-exports its submodules would otherwise be a circle with each of them), and names
looked up at run time (``importlib.import_module``, ``python -m``) are not statements and not seen.

Rules:
- launch/ is four wings, ``run -> bubbletea -> net -> plan`` (then commweave): a module of a wing
  imports only from its own wing or one below it, and commweave imports nothing of launch/;
- net/ takes from plan/ only the plan's data type, the topology and the socket facts
  (:data:`NET_FROM_PLAN`), never the planner's search, placement or CLI;
- a ``__main__.py`` is a command, not a module: nothing of the project imports one, so it stands
  above every wing (``python -m launch.plan --bubbletea`` draws BubbleTea's prefill);
- no circle (a strongly connected component of two or more modules, or a module importing itself).
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("commweave", "ds_plugins", "megatron_patches", "launch", "benchmarks", "examples")
WINGS = ("launch.plan", "launch.net", "launch.bubbletea", "launch.run")   # lowest first
NET_FROM_PLAN = {"launch.plan.plan", "launch.plan.topology", "launch.plan.socket_limits"}


def modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path | None]:
    """Every module of the packages under ``root``, by dotted name (a package by its own name); the
    compiled extensions that setup.py builds (``ds_plugins._C``) are modules without source (None)."""
    out: dict[str, pathlib.Path | None] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    setup = root / "setup.py"
    if setup.exists():
        for name in re.findall(r"Extension\(\s*[\"']([\w.]+)[\"']", setup.read_text()):
            if name.split(".")[0] in packages:
                out[name] = None
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules that module ``name`` imports (see the module docstring for what counts)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:      # import P.Q.name-that-is-not-a-module -> P.Q
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    return {name: imports(name, path, set(mods)) if path else set() for name, path in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a circle in them (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def wing(name: str) -> int | None:
    return next((i for i, w in enumerate(WINGS) if name == w or name.startswith(w + ".")), None)


def is_command(name: str) -> bool:
    return name.rpartition(".")[2] == "__main__"


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the wing order or the rules of the module docstring."""
    bad = []
    for a, targets in sorted(g.items()):
        for b in sorted(targets):
            if is_command(b):
                bad.append(f"{a} imports {b}: a command (python -m), nothing imports it")
            elif is_command(a):
                continue
            elif (a == "commweave" or a.startswith("commweave.")) and b.startswith("launch"):
                bad.append(f"{a} imports {b}: commweave sits below launch/")
            elif wing(a) is not None and wing(b) is not None and wing(b) > wing(a):
                bad.append(f"{a} imports {b}: {WINGS[wing(b)]} sits above {WINGS[wing(a)]}")
            elif wing(a) == WINGS.index("launch.net") and wing(b) == WINGS.index("launch.plan") \
                    and b not in NET_FROM_PLAN:
                bad.append(f"{a} imports {b}: net/ takes from plan/ only {sorted(NET_FROM_PLAN)}")
    return bad


def test_launch_is_four_wings():
    names = set(modules(ROOT, ("launch",)))
    strays = sorted(n for n in names if wing(n) is None and n not in ("launch", "launch.__main__"))
    assert not strays, f"every module of launch/ belongs to one of {WINGS}: {strays}"


def test_imports_point_down_the_wings():
    g = graph()
    assert g["launch.run.runner"] >= {"launch.plan.placement", "launch.net.sockets"}   # the graph is read
    assert "launch.plan.placement" in g["launch.bubbletea.simulate"]                  # lazy imports too
    bad = upward(g)
    assert not bad, "imports against the wing order:\n  " + "\n  ".join(bad)


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    """A made-up tree with a lazy circle (one import inside a function, one relative) and net/
    importing run/, the planner and a command: each rule reports it."""
    files = {"launch/__init__.py": "",
             "launch/plan/__init__.py": "",
             "launch/plan/a.py": "def f():\n    from launch.plan import b\n",
             "launch/plan/b.py": "from . import a\n",
             "launch/plan/placement.py": "",
             "launch/net/__init__.py": "",
             "launch/net/x.py": "import launch.run.y\nfrom launch.plan.placement import place\n"
                                "from launch.plan.__main__ import main\n",
             "launch/run/__init__.py": "",
             "launch/run/y.py": "",
             "launch/plan/__main__.py": "from launch.run import y\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = graph(tmp_path, ("launch",))
    assert circles(g) == [["launch.plan.a", "launch.plan.b"]]
    assert upward(g) == [        # launch.plan.__main__ -> launch.run.y is allowed: a command
        "launch.net.x imports launch.plan.__main__: a command (python -m), nothing imports it",
        "launch.net.x imports launch.plan.placement: net/ takes from plan/ only "
        f"{sorted(NET_FROM_PLAN)}",
        "launch.net.x imports launch.run.y: launch.run sits above launch.net"]
