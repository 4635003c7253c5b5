"""The house's shape, measured (issue 26): rooms small enough that each holds one job you can name.

In ``volunteer/`` and ``tracker/`` no class holds more than 25 attributes or spans more than 400 lines; nowhere
in the product is a function longer than 60 lines; ``volunteer/engine.py`` (the wiring) and ``volunteer/loop.py``
(the training loop) fit in 300 lines each. A class's attributes are its declared fields (dataclass and Struct annotations,
``__slots__``) and every ``self.NAME`` its methods assign. A span runs from the ``def`` or ``class`` line to
the last line, decorators left out. Each failure names every offender as ``file:line`` with its size.

No import loop in ``volunteer/`` or ``tracker/`` (type-only imports count), and no issue number in the product.
No part writes another's fields; only the training loop moves the peer's position; the delay and the mode are
branched on in at most three places each (their implications live on the run spec and the volunteer's cadence).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("protocol", "datasets", "tracker", "volunteer", "crowdtrain")
ROOMS = ("volunteer", "tracker")  # where the class limits hold
MAX_ATTRIBUTES = 25
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
LOOP_FILES = ("volunteer/engine.py", "volunteer/loop.py")
MAX_LOOP_LINES = 300

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True, slots=True)
class Offender:
    where: str  # file:line
    name: str
    size: int


def parsed(folders: tuple[str, ...]) -> list[tuple[str, ast.Module]]:
    """Every module under ``folders`` as (path from the repository root, tree)."""
    paths = sorted(
        p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts
    )
    assert paths, f"no Python files under {folders} in {ROOT}"
    return [(p.relative_to(ROOT).as_posix(), ast.parse(p.read_text(encoding="utf-8"), str(p))) for p in paths]


def span(node: ast.stmt) -> int:
    """Lines from the ``def``/``class`` line (decorators are above it) to the last line."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def _is_classvar(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "ClassVar" or (
        isinstance(annotation, ast.Constant) and "ClassVar" in str(annotation.value)
    )


def _stored(target: ast.expr, owner: str) -> set[str]:
    """Names of ``owner.NAME`` stored by an assignment target (through tuple, list and starred unpacking)."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == owner:
        return {target.attr}
    if isinstance(target, ast.Tuple | ast.List):
        return {name for element in target.elts for name in _stored(element, owner)}
    if isinstance(target, ast.Starred):
        return _stored(target.value, owner)
    return set()


def assigned(node: ast.AST) -> list[ast.expr]:
    """The targets ``node`` assigns to (none when it is no assignment)."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _self_name(method: Function) -> str | None:
    """The name a method calls its instance (``self``); None for static and class methods."""
    decorators = {d.id for d in method.decorator_list if isinstance(d, ast.Name)}
    args = method.args.posonlyargs + method.args.args
    return None if decorators & {"staticmethod", "classmethod"} or not args else args[0].arg


def attributes(cls: ast.ClassDef) -> set[str]:
    """The class's declared fields and the instance attributes its methods (and closures in them) assign."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if not _is_classvar(stmt.annotation):
                names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets
        ):
            names |= {
                c.value
                for c in ast.walk(stmt.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
        elif isinstance(stmt, Function) and (owner := _self_name(stmt)) is not None:
            for node in ast.walk(stmt):
                names |= {name for target in assigned(node) for name in _stored(target, owner)}
    return names


def classes(folders: tuple[str, ...]) -> list[tuple[str, ast.ClassDef]]:
    return [
        (f"{path}:{node.lineno}", node)
        for path, tree in parsed(folders)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def refuse(offenders: list[Offender], what: str, limit: int, unit: str) -> None:
    """Fail naming every offender, largest first, when there is one."""
    if offenders:
        ordered = sorted(offenders, key=lambda o: (-o.size, o.where))
        pytest.fail(
            f"{what} more than {limit} {unit} ({len(ordered)}):\n"
            + "\n".join(f"  {o.where} {o.name}: {o.size} {unit}" for o in ordered),
            pytrace=False,
        )


def test_the_measures_count_fields_closures_and_unpacking_and_leave_decorators_out():
    tree = ast.parse(
        "@dataclass\n"
        "class Fields:\n"
        "    a: int\n"
        "    b: ClassVar[int] = 0\n"
        "    __slots__ = ('c',)\n"
        "    def __init__(self, other):\n"
        "        self.d, (self.e, *self.f) = 1, (2, 3)\n"
        "        self.g: int = 0\n"
        "        self.d += 1\n"
        "        other.h = 1\n"
        "        def later():\n"
        "            self.i = 2\n"
        "    @staticmethod\n"
        "    def make(x):\n"
        "        x.j = 1\n"
    )
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    assert attributes(cls) == {"a", "c", "d", "e", "f", "g", "i"}
    assert span(cls) == 14  # from `class`, not from `@dataclass`
    make = cls.body[-1]
    assert isinstance(make, ast.FunctionDef) and span(make) == 2


def test_no_class_in_volunteer_or_tracker_holds_more_than_25_attributes():
    offenders = [
        Offender(where, node.name, len(attributes(node)))
        for where, node in classes(ROOMS)
        if len(attributes(node)) > MAX_ATTRIBUTES
    ]
    refuse(offenders, "These classes in volunteer/ and tracker/ hold", MAX_ATTRIBUTES, "attributes")


def test_no_class_in_volunteer_or_tracker_spans_more_than_400_lines():
    offenders = [
        Offender(where, node.name, span(node))
        for where, node in classes(ROOMS)
        if span(node) > MAX_CLASS_LINES
    ]
    refuse(offenders, "These classes in volunteer/ and tracker/ span", MAX_CLASS_LINES, "lines")


def test_no_function_in_the_product_is_longer_than_60_lines():
    offenders = [
        Offender(f"{path}:{node.lineno}", node.name, span(node))
        for path, tree in parsed(PRODUCT)
        for node in ast.walk(tree)
        if isinstance(node, Function) and span(node) > MAX_FUNCTION_LINES
    ]
    refuse(offenders, "These functions in the product span", MAX_FUNCTION_LINES, "lines")


def test_the_engine_and_the_training_loop_stay_well_inside_300_lines():
    """``volunteer/engine.py`` holds the wiring and the lifecycle, ``volunteer/loop.py`` the training loop's
    state machine; each part the loop drives lives in a module of its own."""
    long = [
        f"{path}:1 is {n} lines"
        for path in LOOP_FILES
        if (n := len((ROOT / path).read_text(encoding="utf-8").splitlines())) > MAX_LOOP_LINES
    ]
    assert not long, f"more than {MAX_LOOP_LINES} lines: {long}; move any job but the loop's into a part"


# ------------------------------------------------------------------ who writes what

# written through two attribute levels on purpose, each for its reason
FOREIGN_WRITES_ALLOWED = {
    (
        "volunteer/averaging/wire.py",
        "self._local.compressor",
    ),  # a thread-local: this object's own slot per thread
    ("volunteer/trainer.py", "torch.backends.cuda.matmul.allow_tf32"),  # torch's process-wide switches
    ("volunteer/trainer.py", "torch.backends.cudnn.allow_tf32"),
}
# the volunteer's shared records and parts, as the loop and the parts name them
PART_NAMES = {"run", "pos", "summary", "me", "link", "rounds", "catchup", "snaps", "data", "meter", "trainer"}


def foreign_writes(tree: ast.Module) -> list[tuple[int, str]]:
    """Assignments to another object's field: through two attribute levels (``self.rounds.early = …``,
    ``run.pos.step = …``) or to a field of a part or shared record by its name (``run.x = …``, ``pos.step =
    …``). An object writes its own fields (``self.x``) and those of records it made or was handed to fill."""
    found = []
    for node in ast.walk(tree):
        targets = assigned(node)
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple | ast.List) else [t])]
        for t in flat:
            if not isinstance(t, ast.Attribute):
                continue
            base = t.value
            if isinstance(base, ast.Attribute) or (isinstance(base, ast.Name) and base.id in PART_NAMES):
                found.append((t.lineno, ast.unparse(t)))
    return found


def test_the_write_finder_finds_writes_through_parts_and_leaves_own_fields_alone():
    tree = ast.parse(
        "self.rounds.early = None\nrun.pos.step, x = 3, 4\nrun.pos.step += 1\npos.applied = 2\n"
        "self.early = None\nrnd.mean = m\nshare.samples += 1\n"
    )
    assert [where for where, _ in foreign_writes(tree)] == [1, 2, 3, 4]


@pytest.mark.parametrize("folder", ROOMS)
def test_no_part_writes_another_parts_fields(folder):
    """Parts return decisions and change their own fields; the loop alone moves the peer (the next test). A
    field written from elsewhere is a coupling no reader of the owner can see."""
    writes = [
        f"{path}:{line} {target}"
        for path, tree in parsed((folder,))
        for line, target in foreign_writes(tree)
        if (path, target) not in FOREIGN_WRITES_ALLOWED
    ]
    assert not writes, f"fields written from outside their object in {folder}/: {writes}"


def test_only_the_loop_moves_a_peer():
    """The step counter (``Position.move``) is moved by the training loop alone: a catch-up says where it
    landed (``Landed``), and the loop moves there."""
    movers = {
        path
        for path, tree in parsed(("volunteer",))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "move"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "pos"
    }
    assert movers == {"volunteer/loop.py"}, f"the position is moved from {sorted(movers)}"


# ------------------------------------------------------------------ the delay and the mode, in one place

MODE_READS = {"delay": {"delay"}, "mode": {"local", "inner_steps"}}
MAX_BRANCHES = 3
# the view folds events into what a user reads: it words a local-steps round apart from a step (its wall time and
# its averaging, inner and outer learning rates), which is presenting the mode, not deciding by it
VIEW = "volunteer/view/"


def branches_on(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines of the conditions (``if``, ``while``, a conditional expression, a comprehension's filter, a
    boolean operation, ``bool(…)``) that read an attribute or a name in ``names``."""

    def reads(expr: ast.AST) -> bool:
        return any(
            (isinstance(n, ast.Attribute) and n.attr in names) or (isinstance(n, ast.Name) and n.id in names)
            for n in ast.walk(expr)
        )

    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests: list[ast.expr] = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        elif isinstance(node, ast.BoolOp):
            tests = [node]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "bool":
            tests = list(node.args)
        else:
            continue
        lines |= {t.lineno for t in tests if reads(t)}
    return sorted(lines)


def test_the_branch_finder_finds_each_kind_of_condition():
    tree = ast.parse(
        "if run.delay:\n    pass\nx = 1 if avg.delay else 2\ny = [a for a in b if a.delay]\nz = p and q.delay\n"
        "w = bool(spec.delay)\nv = run.delay + 1\n"
    )
    assert branches_on(tree, {"delay"}) == [1, 3, 4, 5, 6]


@pytest.mark.parametrize("what", MODE_READS)
def test_the_delay_and_the_mode_are_branched_on_in_at_most_three_places(what):
    """What the delay and the mode imply is said once: on the run spec (``AveragingSpec.computes_ahead``,
    ``spares``, ``checkable``, ``averages_params``, in protocol/) and in the volunteer's cadence
    (``volunteer/cadence.py``, chosen once by the delay); the parts ask those, and never branch on the values."""
    sites = [
        f"{path}:{line}"
        for path, tree in parsed(ROOMS)
        if path != "volunteer/cadence.py" and not path.startswith(VIEW)
        for line in branches_on(tree, MODE_READS[what])
    ]
    assert len(sites) <= MAX_BRANCHES, f"the {what} is branched on in {len(sites)} places: {sites}"


# ------------------------------------------------------------------ import loops


def module_name(path: str) -> str:
    """``tracker/verdicts.py`` → ``crowdtrain.tracker.verdicts`` (a package's ``__init__`` is the package)."""
    name = "crowdtrain." + path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def import_graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Which of the modules under ``folders`` each imports, type-only imports (``if TYPE_CHECKING:``) and
    imports inside functions included: a loop through any of them is a loop in what a reader must hold."""
    trees = {module_name(path): tree for path, tree in parsed(folders)}
    graph: dict[str, set[str]] = {name: set() for name in trees}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {m for m in named if m in trees and m != name}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_loop_finder_finds_a_loop_of_three_and_none_in_a_chain():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("folder", ROOMS)
def test_no_import_loop_in_the_volunteer_or_the_tracker(folder):
    """Modules of one folder import one way: the records at the bottom, the server (or the engine) on top. A
    loop, even through a type-only import, means neither module can be read without the other."""
    found = loops(import_graph((folder,)))
    assert not found, f"import loops in {folder}/: " + "; ".join(" ↔ ".join(c) for c in found)


def test_no_issue_number_in_the_product():
    """An issue number means nothing to a reader of the repository: the product says what it means instead."""
    cited = [
        f"{path}:{n}"
        for path, _ in parsed(PRODUCT)
        for n, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bissues? \d+", line, re.IGNORECASE)
    ]
    assert not cited, "issue numbers in the product: " + ", ".join(cited)


@pytest.mark.parametrize("folder", ROOMS)
def test_no_two_modules_of_one_name_in_the_volunteer_or_the_tracker(folder):
    """Two modules named alike (``snapshots.py`` beside ``state/snapshot.py``) send a reader to the wrong one;
    a package's ``__init__`` and ``config`` are the only names a folder and its sub-folders share."""
    named: dict[str, list[str]] = {}
    for path, _ in parsed((folder,)):
        stem = Path(path).stem.removesuffix("s")
        named.setdefault(stem, []).append(path)
    alike = [paths for stem, paths in named.items() if len(paths) > 1 and stem not in ("__init__", "config")]
    assert not alike, f"modules named alike in {folder}/: {alike}"


# ------------------------------------------------------------------ one peer client

# the only modules that open HTTP client sessions: the tracker's client and the peers' (every request one peer
# makes of another, and the tracker's reachability checks, goes through protocol/peerclient.py)
SESSION_OWNERS = {"protocol/client.py", "protocol/peerclient.py"}


def test_every_request_to_a_peer_goes_through_the_one_peer_client():
    opened = []
    for path, tree in parsed(PRODUCT):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            via = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name == "ClientSession" or (via == "aiohttp" and name == "request"):
                opened.append(f"{path}:{node.lineno}")
    assert opened, "found no session at all: the walk is broken"
    strays = [where for where in opened if where.split(":")[0] not in SESSION_OWNERS]
    assert not strays, f"HTTP sessions opened outside the tracker's and the peers' clients: {strays}"


# ------------------------------------------------------------------ docs as references

DOC_LINES = {"README.md": 200, "docs/benchmarks.md": 400}


@pytest.mark.parametrize(("doc", "most"), DOC_LINES.items())
def test_the_front_door_and_the_benchmarks_stay_references(doc, most):
    """The README says what crowdtrain is, the two commands and where to read on; docs/benchmarks.md holds each
    bench's current table (its history is in git): past these lengths they turn into logs again."""
    lines = len((ROOT / doc).read_text(encoding="utf-8").splitlines())
    assert lines <= most, f"{doc} is {lines} lines; at most {most}"
