"""The package's shape: layered imports, no cycles, no module too big.

The layers are the ones docs/architecture.md describes; a module may import
modules of its own layer or of lower ones, never of a higher one. Read from the
source with `ast` (every import, including those inside functions and under
TYPE_CHECKING), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import jaxckpt

PACKAGE = Path(jaxckpt.__file__).parent

# Lowest first. Patterns are module names relative to the package. Each package is one
# layer (its README.md says what it owns and may import); a module may import its own
# layer or lower ones.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("_internals", "_resources", "_aio", "_faults")),
    ("on-disk format", ("format", "format.*")),
    ("coordination", ("coord", "coord.*")),
    ("tiers", ("tiers", "tiers.*")),
    ("options and metrics", ("_options", "_metrics")),
    ("peer service", ("peer", "peer.*")),
    ("run", ("run", "run.*")),
    ("save and restore paths", ("save", "save.*", "restore", "restore.*")),
    ("handler and public API", ("_args", "_handler", "_resume", "_manager_options", "__init__")),
    ("operator tools and launcher", ("tools", "tools.*", "launch", "launch.*")),
    ("benchmark", ("bench", "bench.*")),
    ("command line", ("cli",)),
]
# The packages by flow, and the top-level modules (public API, handler, foundations).
PACKAGES = (
    "format",
    "coord",
    "tiers",
    "peer",
    "run",
    "save",
    "restore",
    "tools",
    "launch",
    "bench",
)
TOP_LEVEL_AT_MOST = 12


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's own modules that `path` imports (relative names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from jaxckpt.peer import _wire` imports the module `peer._wire`;
            # `from jaxckpt.peer._wire import PeerAddress` imports `peer._wire` too.
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.append(sub if _relative(sub) in modules else node.module)
        out.update(r for r in map(_relative, names) if r in modules)
    return out


def _relative(name: str) -> str:
    return "__init__" if name == "jaxckpt" else name.removeprefix("jaxckpt.")


def _layer(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return index
    raise AssertionError(
        f"Module jaxckpt.{module} is in no layer: add it to LAYERS here and to "
        "docs/architecture.md."
    )


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules) | {"__init__"}
    graph = {m: _imports(p, names) - {m} for m, p in modules.items()}
    graph["__init__"] = graph.pop("", set())
    return graph


def test_every_module_imports_only_its_layer_or_lower() -> None:
    wrong = [
        f"jaxckpt.{m} ({LAYERS[_layer(m)][0]}) imports jaxckpt.{d} ({LAYERS[_layer(d)][0]})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if _layer(d) > _layer(m)
    ]
    assert not wrong, "Imports pointing up a layer:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "Import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_holds_more_than_8_percent_of_the_package() -> None:
    lines = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    total = sum(lines.values())
    too_big = {m: n for m, n in lines.items() if n > 0.08 * total}
    assert not too_big, f"Modules over 8% of the package's {total} lines: {too_big}"


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    # The checker itself: an import of a higher layer is found, a lower one is not.
    source = tmp_path / "m.py"
    source.write_text(
        "from jaxckpt.format import _format\nfrom jaxckpt.peer import _wire\nimport jaxckpt\n"
    )
    found = _imports(source, {"format._format", "peer._wire", "__init__"})
    assert found == {"format._format", "peer._wire", "__init__"}
    assert _layer("format._format") < _layer("peer._wire") < _layer("__init__")


def test_importing_the_library_imports_none_of_its_extras() -> None:
    # flax, optax and grain are extras (examples, tests, bench): `pip install jaxckpt`
    # lacks them, so `import jaxckpt` must not need them; matplotlib (plot) only draws.
    import subprocess
    import sys

    extras = "{'flax', 'optax', 'grain', 'matplotlib'}"
    code = f"import sys, jaxckpt, jaxckpt.launch; print(sorted({extras} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"import jaxckpt imported the extras {out.stdout.strip()}"


def _package(module: str) -> str:
    return module.split(".")[0]


def test_packages_import_each_other_without_cycles() -> None:
    # The graph between packages (a top-level module counts as its own package): save may
    # use run, run may use peer, ... never the other way round.
    graph: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        graph.setdefault(_package(module), set()).update(
            _package(d) for d in deps if _package(d) != _package(module)
        )
    done: set[str] = set()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph.get(start, ()):
            if dep == goal or (dep not in seen and reaches(dep, goal, seen | {dep})):
                return True
        return False

    cycles = sorted(p for p in graph if reaches(p, p, {p}))
    done.update(graph)
    assert not cycles, f"Packages in an import cycle: {cycles}"


def test_the_top_level_holds_few_modules_and_every_package_says_what_it_owns() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_AT_MOST, f"{len(top)} modules at jaxckpt/ top level: {top}"
    found = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert found == sorted(PACKAGES), found
    for name in PACKAGES:
        readme = PACKAGE / name / "README.md"
        assert readme.is_file(), f"jaxckpt/{name} has no README.md"
        modules = sorted(p.stem for p in (PACKAGE / name).glob("_*.py") if p.stem != "__init__")
        text = readme.read_text()
        missing = [m for m in modules if f"`{m}`" not in text]
        assert not missing, f"jaxckpt/{name}/README.md does not name {missing}"


def test_the_handler_is_an_adapter_over_few_modules() -> None:
    """The Orbax handler hands each call to an operation or the session: it imports at
    most 6 modules of jaxckpt, so the save and restore flows live in their packages."""
    imported = _graph()["_handler"]
    assert len(imported) <= 6, f"jaxckpt._handler imports {len(imported)}: {sorted(imported)}"


FUNCTION_LINES_AT_MOST = 80
# Functions allowed past the limit while they wait to be split (none today); nothing else
# may grow past it, and an entry goes once its function is short (the test below says so).
LONG_FUNCTIONS_TO_SPLIT: set[str] = set()


def _function_lengths(path: Path) -> dict[str, int]:
    """Every function and method in `path` (nested ones too) by qualified name
    (`Class.method`, `outer.inner`), with its length in lines from `def` to its end."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return lengths


def _long_functions() -> dict[str, int]:
    return {
        f"{module}.{name}" if module else name: n
        for module, path in _modules().items()
        for name, n in _function_lengths(path).items()
        if n > FUNCTION_LINES_AT_MOST
    }


def test_no_function_is_longer_than_80_lines() -> None:
    # A longer one is several steps: name each and let the function read as their list.
    too_long = {f: n for f, n in _long_functions().items() if f not in LONG_FUNCTIONS_TO_SPLIT}
    assert not too_long, (
        f"Functions over {FUNCTION_LINES_AT_MOST} lines (split each into named steps): "
        f"{dict(sorted(too_long.items()))}"
    )


def test_the_long_functions_left_to_split_are_still_long() -> None:
    stale = sorted(LONG_FUNCTIONS_TO_SPLIT - set(_long_functions()))
    assert not stale, (
        f"{stale} are no longer over {FUNCTION_LINES_AT_MOST} lines (or gone): take them "
        "out of LONG_FUNCTIONS_TO_SPLIT here, so that they stay short."
    )


def test_the_function_length_check_sees_methods_and_nested_functions(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    source = tmp_path / "m.py"
    source.write_text(
        f"def short():\n    pass\n\n\ndef long():\n{body}\n\n"
        f"class C:\n    async def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
        f"def outer():\n    def inner():\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    )
    lengths = _function_lengths(source)
    assert lengths["short"] == 2 and lengths["long"] == 81
    assert lengths["C.method"] == 81 and lengths["outer.inner"] == 81
    assert lengths["outer"] == 82


# ---- every cross-process step is an exchange of a choreography ----------------------

# The calls that wait for every other process (each must make them, in the same order):
# the coordinator's exchanges and agreements, the restore's reshard (a jax collective),
# jax's multihost utilities, and the choreographies' own exchanges. A value one process
# publishes and another looks up (`coord._published`) and a peer's bytes (`peer/`) wait
# for one process, not for all, so they are not among them. None: every name of it.
CROSS_PROCESS: dict[str, set[str] | None] = {
    "coord._agreement": {"agree", "agree_each", "agree_on_save"},
    "coord._multihost": {"converge", "converge_each", "allgather", "broadcast"},
    "coord._exchange": {"exchange"},
    "coord._read_layout": {"reshard"},
    "run._choreography": {"meeting", "exchange_inventories"},
    "jax.experimental.multihost_utils": None,
}
# Who may reach them: the choreographies, and coord/, which builds them.
CROSS_PROCESS_CALLERS = ("run._choreography", "coord", "coord.*")
# The benchmark drives the coordination code itself (`--scale` runs N simulated processes'
# exchanges) and keeps its own phases in lockstep: it is no operation of the library.
CROSS_PROCESS_EXEMPT = ("bench", "bench.*")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it names, from every import in `tree`: a module (`coord._agreement`,
    `jax.experimental.multihost_utils`) or a module's attribute (`coord._agreement.agree`);
    jaxckpt's own relative to the package."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = _relative(a.name)
                else:
                    root = a.name.split(".")[0]
                    out[root] = _relative(root)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = _relative(f"{node.module}.{a.name}")
    return out


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but names and attributes."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def _cross_process_reaches(path: Path) -> list[tuple[int, str]]:
    """(line, entry point) of every reach of a `CROSS_PROCESS` entry point in `path`: a
    call or any other use (a function passed on reaches it too)."""
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names = _dotted(node)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names = [node.id]
        else:
            continue
        if not names or names[0] not in aliases:
            continue
        full = ".".join([aliases[names[0]], *names[1:]])
        module, _, attr = full.rpartition(".")
        if module in CROSS_PROCESS and (
            CROSS_PROCESS[module] is None or attr in CROSS_PROCESS[module]
        ):
            found.append((node.lineno, full))
    return sorted(set(found))


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def test_every_cross_process_call_is_reached_from_a_choreography() -> None:
    # A reader who opens run/_choreography sees every exchange each operation takes, in
    # order; no other layer (the read engine, the peers, the run) waits for all processes.
    wrong = [
        f"jaxckpt/{path.relative_to(PACKAGE)}:{line} reaches {entry}"
        for module, path in _modules().items()
        if not _matches(module, CROSS_PROCESS_CALLERS + CROSS_PROCESS_EXEMPT)
        for line, entry in _cross_process_reaches(path)
    ]
    assert not wrong, (
        "Cross-process calls outside the choreographies (declare the exchange in "
        "run/_choreography.py and run it there):\n" + "\n".join(wrong)
    )


def test_the_cross_process_check_sees_a_planted_call(tmp_path: Path) -> None:
    # The checker itself: each way of reaching an entry point is found, other names are not.
    source = tmp_path / "m.py"
    source.write_text(
        "import jax\n"
        "from jax.experimental import multihost_utils as mu\n"
        "from jaxckpt.coord import _agreement, _read_layout\n"
        "from jaxckpt.coord._multihost import converge\n"
        "_agreement.agree(None, tag='t', what='w', timeout_s=1.0)\n"
        "_agreement.is_agreed(None)\n"
        "mu.sync_global_devices('x')\n"
        "jax.experimental.multihost_utils.process_allgather(1)\n"
        "later = _read_layout.reshard\n"
        "converge('', dict, tag='t', timeout_s=1.0)\n"
        "_read_layout.read_layout\n"
    )
    assert [entry for _, entry in _cross_process_reaches(source)] == [
        "coord._agreement.agree",
        "jax.experimental.multihost_utils.sync_global_devices",
        "jax.experimental.multihost_utils.process_allgather",
        "coord._read_layout.reshard",
        "coord._multihost.converge",
    ]
    assert _matches("run._choreography", CROSS_PROCESS_CALLERS)
    assert _matches("coord._peers_like", CROSS_PROCESS_CALLERS)
    assert not _matches("restore._restore", CROSS_PROCESS_CALLERS + CROSS_PROCESS_EXEMPT)
    assert not _matches("peer._peers", CROSS_PROCESS_CALLERS + CROSS_PROCESS_EXEMPT)


# ---- no private reaches from the tests, the benchmark and the examples --------------------
#
# What they need of a handler's state goes through its documented surface
# (`TieredCheckpointHandler.inspect()`, `run/_session.Inspection`), and what a test changes
# at a point of a save or a persist through the fault points (`jaxckpt._faults`, with the
# tests' faults in tests/support/faults.py). The rule, read with `ast`: `x._name` (and
# `setattr`/`getattr`/`hasattr`/`delattr`/`monkeypatch.setattr(x, "_name", ...)`) is a
# reach unless `x` is
#   - `self`, `cls` or `super()`: an object's own state;
#   - a module or object of the standard library or a third-party package (by its import);
#   - a jaxckpt module and `_name` one of its modules (importing a private module is fine);
#   - a jaxckpt module, or a name defined in one, that the file unit-tests: `test_<m>.py`
#     tests the modules named `_<m>`, and UNIT_TESTED names the others, each with why;
#   - a third-party object held in a local name, listed in FOREIGN_OBJECTS with what it is.
# Never under test here: the handler, the run's objects and the persister, whose state the
# tests reach through `inspect()` only.
REPO = PACKAGE.parent
REACH_DIRS = ("tests", "jaxckpt/bench", "examples")
UNIT_TESTED: dict[str, set[str]] = {
    "tests/test_cli.py": {"tools._inspect"},  # `inspect`'s collapse of long leaf lists
    "tests/test_handler.py": {"restore._restore"},  # big enough for the background reads
    "tests/test_leaks.py": {"tiers._slab"},  # a slab write that fails half-way
    "tests/test_multihost.py": {"coord._exchange"},  # the exchange's give-ups
    "tests/test_object_stores.py": {"tiers._object_store"},  # uploads held, counted, stalled
    "tests/test_peer_service.py": {"tiers._slab", "peer._client"},  # kept maps; a bad push
    "tests/test_plain_managers.py": {"tiers._kept"},  # a filesystem without hard links
    "tests/test_plots.py": {"launch._timeline_plot"},  # the timeline's lanes and window
    "tests/test_relay.py": {"coord._multihost"},  # which simulated process made each call
    "tests/test_unwritable_memory.py": {"tiers._memory_tier"},  # a RUN.json that cannot be written
}
NEVER_UNDER_TEST = ("_handler", "run.*", "tiers._persister")
FOREIGN_OBJECTS: dict[tuple[str, str], str] = {
    ("tests/test_internals.py", "mngr"): "an Orbax CheckpointManager (what _internals reaches)",
    ("tests/test_internals.py", "composite"): "Orbax's composite handler (what _internals reaches)",
}
_STRING_ATTRIBUTE_CALLS = ("setattr", "getattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _test_modules() -> set[str]:
    """The modules the tests import by name (tests/, tests/support/, tests/workers/)."""
    tests = REPO / "tests"
    return {p.stem for d in (tests, tests / "support", tests / "workers") for p in d.glob("*.py")}


def _bindings(tree: ast.AST, package: set[str], ours: set[str]) -> dict[str, tuple[str, str]]:
    """Each imported name: ("module", jaxckpt module), ("object", the jaxckpt module it comes
    from), ("ours", a test module) or ("foreign", the library)."""
    out: dict[str, tuple[str, str]] = {}

    def kind(module: str) -> str:
        top = module.split(".")[0]
        return "jaxckpt" if top == "jaxckpt" else "ours" if top in ours else "foreign"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                module = alias.name if alias.asname else alias.name.split(".")[0]
                k = kind(module)
                out[name] = ("module", module) if k == "jaxckpt" else (k, module)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub, k = f"{node.module}.{alias.name}", kind(node.module)
                if k == "jaxckpt":
                    found = ("module", sub) if sub in package else ("object", node.module)
                else:
                    found = (k, node.module)
                out[alias.asname or alias.name] = found
    return out


def _receiver(
    node: ast.expr, bindings: dict[str, tuple[str, str]], package: set[str]
) -> tuple[str, str]:
    """What `node` (the `x` of `x._name`) is: ("own", ""), ("module", M), ("object", M),
    ("foreign", library), ("ours", test module) or ("local", its text)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
        return ("own", "")
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ("local", ast.unparse(node))
    if node.id in ("self", "cls") and not chain:
        return ("own", "")
    kind, module = bindings.get(node.id, ("local", node.id))
    if kind != "module":
        return (kind, module if kind != "local" else ".".join([node.id, *chain]))
    for attr in chain:
        if f"{module}.{attr}" not in package:
            return ("object", module)
        module = f"{module}.{attr}"
    return ("module", module)


def _reaches_of(path: Path, rel: str, under_test: set[str]) -> list[str]:
    """The private reaches in `path` (shown as `rel`) that the rule above does not allow."""
    package = {"jaxckpt" if m == "" else f"jaxckpt.{m}" for m in _modules()}
    tree = ast.parse(path.read_text())
    bindings = _bindings(tree, package, _test_modules())
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            receiver, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and (
                (isinstance(node.func, ast.Name) and node.func.id in _STRING_ATTRIBUTE_CALLS)
                or (
                    isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("setattr", "delattr")
                )
            )
        ):
            receiver, name = node.args[0], node.args[1].value
        else:
            continue
        kind, what = _receiver(receiver, bindings, package)
        allowed = (
            kind in ("own", "foreign")
            or (kind == "module" and f"{what}.{name}" in package)
            or (kind in ("module", "object") and what.removeprefix("jaxckpt.") in under_test)
            or (kind == "local" and (rel, what) in FOREIGN_OBJECTS)
        )
        if not allowed:
            found.append((node.lineno, f"{rel}:{node.lineno}: {ast.unparse(receiver)}.{name}"))
    return [text for _, text in sorted(found)]


def _under_test(rel: str) -> set[str]:
    """The jaxckpt modules (relative names) whose private names `rel` may reach."""
    stem = Path(rel).stem
    named = {
        m for m in _modules() if stem.startswith("test_") and m.split(".")[-1] == f"_{stem[5:]}"
    }
    return {
        m
        for m in named | UNIT_TESTED.get(rel, set())
        if not any(fnmatch.fnmatchcase(m, p) for p in NEVER_UNDER_TEST)
    }


def test_no_private_reaches_from_the_tests_the_benchmark_or_the_examples() -> None:
    reaches: list[str] = []
    for folder in REACH_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            reaches += _reaches_of(path, rel, _under_test(rel))
    assert not reaches, (
        "Private attributes reached from outside their module (use handler.inspect(), the "
        "fault points of jaxckpt._faults or a public name; see the rule in this file):\n"
        + "\n".join(reaches)
    )


def test_the_private_reach_check_sees_a_planted_reach(tmp_path: Path) -> None:
    # The checker itself: each planted reach is found, and the allowed forms are not.
    source = tmp_path / "test_planted.py"
    source.write_text(
        "import os\n"
        "import jaxckpt\n"
        "from jaxckpt.tiers import _slab, _persister\n"
        "from jaxckpt.tiers._persister import Persister\n"
        "h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions('/m'))\n"
        "h._session.runs.memory\n"  # 6: a handler's private state
        "h.inspect()._session\n"  # 7: past the surface
        "monkeypatch.setattr(_persister.Persister, '_persist', None)\n"  # 8
        "Persister._persist\n"  # 9
        "_slab._KEPT\n"  # 10: another module's private global
        "setattr(h, '_runs', None)\n"  # 11
        "os._exit\n"  # foreign: allowed
        "jaxckpt.tiers._slab.write\n"  # a private module: allowed
        "h.inspect().memory.steps()\n"  # the surface: allowed
        "class C:\n    def f(self):\n        return self._x, super()._y\n"  # own state
    )
    found = _reaches_of(source, "tests/test_planted.py", _under_test("tests/test_planted.py"))
    assert [f.split(":")[1] for f in found] == ["6", "7", "8", "9", "10", "11"], found
    # A unit test of `_slab` may reach its private names; of the persister, never.
    assert len(_reaches_of(source, "tests/test_slab.py", _under_test("tests/test_slab.py"))) == 5
    assert _under_test("tests/test_persister.py") == set()
