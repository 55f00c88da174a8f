"""The shape of the code base: parallel.py is the ground floor, the "why" comments resolve, the core stays small."""

import ast
import os
import re
import subprocess
import sys

from helpers import corpus  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_files():
    """Every .py file of the project, committed or not, but for what git ignores (a fork's scratch files, the
    tokenized data/); outside a git checkout, every one but data/ and hidden or cache directories."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:  # no git on the machine: walk the tree
        listed = None
    if listed is not None and listed.returncode == 0:
        paths = [os.path.join(ROOT, p) for p in listed.stdout.splitlines()]
        # not a file deleted but not yet committed
        yield from (p for p in paths if os.path.exists(p))
        return
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [
            d
            for d in subdirs
            if not d.startswith((".", "__")) and not (directory == ROOT and d == "data")
        ]
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _project_modules():
    """Names a project import could use: the top-level modules and packages/folders (model, train, tools, ...)."""
    names = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py")}
    names |= {
        n
        for n in os.listdir(ROOT)
        if os.path.isdir(os.path.join(ROOT, n)) and not n.startswith(".")
    }
    return names


def _imports(source):
    """Every module name imported anywhere in source: import statements at any depth (inside functions too),
    and importlib.import_module("...") / __import__("...") with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append("." if node.level else node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append(str(node.args[0].value))
    return found


def test_parallel_imports_nothing_from_the_project():
    project = _project_modules()
    assert {"model", "train", "optim", "data", "arguments", "checkpoint", "estimate"} <= project
    bad = [
        m
        for m in _imports(_read(os.path.join(ROOT, "parallel.py")))
        if m == "." or m.split(".")[0] in project
    ]
    assert not bad, (
        f"parallel.py imports project modules {bad}: it is the ground floor (model.py builds on it)"
    )


def test_the_import_check_catches_imports_inside_functions():
    source = (
        "import torch\n\ndef f():\n    from model import GPT\n    import importlib\n"
        "    return importlib.import_module('train')\n"
    )
    assert {"model", "train"} <= set(_imports(source))


LESSON = re.compile(r"\blessons? (\d+(?:(?:\s*,\s*|\s*-\s*|\s+and\s+)\d+)*)", re.I)


def _cited(text):
    """{N} of every "lesson N", "lessons 1, 2", "lessons 1-14", "lessons 7 and 11" in text."""
    numbers = set()
    for m in LESSON.finditer(text):
        for part in re.split(r"\s*,\s*|\s+and\s+", m.group(1)):
            first, _, last = part.partition("-")
            numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def test_every_cited_lesson_exists_and_no_file_cites_the_seeds():
    lessons = _read(os.path.join(ROOT, "docs", "lessons.md"))
    headings = [int(n) for n in re.findall(r"^## (\d+)\. ", lessons, re.M)]
    assert headings == list(range(1, len(headings) + 1)), (
        "lessons are numbered 1, 2, 3, ... without gaps"
    )
    cited, stale = {}, []
    for path in [*_python_files(), os.path.join(ROOT, "README.md")]:
        text, name = _read(path), os.path.relpath(path, ROOT)
        for n in _cited(text):
            cited.setdefault(n, []).append(name)
        if path != os.path.abspath(__file__) and (
            re.search(r"seeds? 00\d", text, re.I) or re.search(r"\bSPEC\b", text)
        ):
            stale.append(name)
    assert len(cited) > 10, "the check found almost no citations: is the pattern right?"
    missing = {n: files for n, files in cited.items() if n not in headings}
    assert not missing, f"cited lessons missing from docs/lessons.md: {missing}"
    assert not stale, f"cite docs/lessons.md ('lesson N'), not the seeds or SPEC, in: {stale}"


def _long_functions(source, limit):
    """[(name, lines)] of every function in source longer than limit lines (its def to its last line)."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno >= limit
    ]


def test_no_function_of_the_core_or_the_stability_layer_is_over_60_lines():
    """A function reads on one screen: a longer one is named steps waiting to be split."""
    long = {
        os.path.relpath(path, ROOT): found
        for path in _product_files()
        for found in [_long_functions(_read(path), 60)]
        if found
    }
    assert not long, f"functions over 60 lines: {long}"
    assert _long_functions("def f():\n" + "    x = 1\n" * 60, 60) == [("f", 61)]
    assert _long_functions("def f():\n" + "    x = 1\n" * 59, 60) == []


# -----------------------------------------------------------------------------
# Shared names are public; tests share helpers.py, not each other


def _project_module_names():
    """Every module a project file can import by name: the top level, tools/, tests/, lab/ and lab/tests/ (sys.path
    puts them there)."""
    names = set()
    for folder in ("", "tools", "tests", "lab", os.path.join("lab", "tests")):
        names |= {n[:-3] for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py")}
    return names


def _private_uses(source, project):
    """[(line, use)] of another module's underscore name in source: `module._name`, `from module import _name`,
    and setattr / getattr / monkeypatch.setattr(module, "_name", ...). Dunders (__file__) are not private."""
    tree = ast.parse(source)
    modules, found = set(), []

    def private(name):
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name for alias in node.names if alias.name in project}
        elif isinstance(node, ast.ImportFrom) and node.module in project:
            found += [
                (node.lineno, f"from {node.module} import {a.name}")
                for a in node.names
                if private(a.name)
            ]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and private(node.attr)
        ):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in modules
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            found.append((node.lineno, f"{node.args[0].id}, {node.args[1].value!r}"))
    return found


def test_no_module_uses_another_modules_private_names():
    project, bad = _project_module_names(), []
    for path in _python_files():
        bad += [
            f"{os.path.relpath(path, ROOT)}:{line}: {use}"
            for line, use in _private_uses(_read(path), project)
        ]
    assert not bad, (
        "a name another module uses is public (no underscore); make it so:\n" + "\n".join(bad)
    )


def test_the_private_name_check_catches_each_form():
    source = (
        "import parallel\nimport train as trainer\nfrom data import _index\nimport torch\n"
        "x = parallel._unwrap(m)\ny = trainer._minutes(0)\nz = torch._foreach_norm(g)\n"
        "monkeypatch.setattr(parallel, '_communicate', f)\nself._own = parallel.__name__\n"
    )
    uses = [use for _, use in _private_uses(source, {"parallel", "train", "data"})]
    assert sorted(uses) == sorted(
        [
            "from data import _index",
            "parallel._unwrap",
            "trainer._minutes",
            "parallel, '_communicate'",
        ]
    )


def _module_state(source):
    """The names a module binds at its top level to values that are neither functions, classes nor
    ALL_CAPS constants: state that can change while a run goes on."""
    names = set()
    for node in ast.parse(source).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name) and not t.id.isupper()}
    return names


def _reads_of(source, module, names):
    return sorted(
        {
            f"{module}.{n.attr}"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == module
            and n.attr in names
        }
    )


def test_the_stability_layer_reads_no_state_of_the_step_module():
    """What a step computed reaches the stability layer in what the step returns (training.Step: every
    DP replica's numbers ride in it), never through a global the core leaves behind for it to read."""
    state = _module_state(_read(os.path.join(ROOT, "training.py")))
    layer = os.path.join(ROOT, "stability")
    reads = {
        name: found
        for name in sorted(os.listdir(layer))
        if name.endswith(".py")
        for found in [_reads_of(_read(os.path.join(layer, name)), "training", state)]
        if found
    }
    assert not reads, f"stability/ reads training's module state: {reads}"
    planted = "replica_values = []\nNO_CALLBACKS = Callbacks()\ndef agree(): pass\n"
    assert _module_state(planted) == {"replica_values"}
    assert _reads_of("rows = list(training.replica_values)\n", "training", {"replica_values"})


def test_no_test_imports_another_test_module():
    tests = os.path.join(ROOT, "tests")
    bad = {
        name: [
            m
            for m in _imports(_read(os.path.join(tests, name)))
            if m.split(".")[0].startswith("test_")
        ]
        for name in os.listdir(tests)
        if name.endswith(".py")
    }
    bad = {name: modules for name, modules in bad.items() if modules}
    assert not bad, (
        f"tests import other test modules {bad}: shared helpers belong in tests/helpers.py"
    )


def test_no_line_is_over_120_characters():
    long = [
        f"{os.path.relpath(path, ROOT)}:{i}"
        for path in _python_files()
        for i, line in enumerate(_read(path).splitlines(), 1)
        if len(line) > 120
    ]
    assert not long, f"lines over 120 characters: {long}"


def _rule_sites(source):
    """Where source implements two run rules: "iteration in these ranges" (a chained `a <= iteration <= b`)
    and the optimizer reset's lr=0 warm-up length (`5 / (1 - beta2)`)."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Compare)
            and len(node.ops) == 2
            and all(isinstance(o, ast.LtE) for o in node.ops)
            and isinstance(node.comparators[0], ast.Name)
            and node.comparators[0].id == "iteration"
        ):
            sites.append("iteration ranges")
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.left, ast.Constant)
            and node.left.value == 5
            and "beta2" in ast.unparse(node.right)
        ):
            sites.append("reset warm-up")
    return sites


def test_each_run_rule_has_one_home():
    homes = {}
    for path in _python_files():
        if os.sep + "tests" + os.sep not in path:
            for rule in _rule_sites(_read(path)):
                homes.setdefault(rule, set()).add(os.path.relpath(path, ROOT))
    assert homes == {"iteration ranges": {"schedule.py"}, "reset warm-up": {"schedule.py"}}, homes
    assert _rule_sites(
        "if a <= iteration <= b:\n    n = math.ceil(5 / (1 - cfg.adam_beta2))\n"
    ) == ["iteration ranges", "reset warm-up"]


# -----------------------------------------------------------------------------
# A one-way house: each floor builds on the floors below it, nothing imports the script

# The product's modules, floor by floor: a module imports its own floor's and the floors' below, never one above,
# and no import circle closes anywhere. The stability layer (the package and its modules) sits above the step it
# acts on and below what composes a run; train.py and bench.py are scripts at the top, imported by nothing.
FLOORS = (
    {
        "files",
        "parallel",
        "schedule",
        "sections",
        "tokenizer",
        "usage",
    },  # the ground: imports nothing of ours
    {"rng", "layers", "cross_entropy", "precision", "report", "data"},
    {"model", "checkpoint", "optim", "launch", "loader"},
    {
        "reshard",
        "deepspeed_engine",
        "safety",
        "training",
    },  # training: the step and the callback interface
    {
        "hf",
        "run_state",
        "eval_harness",
    },  # eval_harness: lm-eval over a gathered model (lm-eval on use)
    {"stability"},  # the stability layer: callbacks on the step
    {"arguments", "builders"},  # every owner's keys; every part built
    {
        "estimate",
        "megatron_ds",
    },  # megatron_ds: builds each stage and its optimizer to write a checkpoint
    {"train", "bench"},  # the scripts
)
SCRIPTS = {"train"}  # run, never imported: by the product, the tools, the lab or the tests


def _product_files():
    """The top-level modules and the stability layer's: what FLOORS orders."""
    names = sorted(n for n in os.listdir(ROOT) if n.endswith(".py") and n != "conftest.py")
    stability = os.path.join(ROOT, "stability")
    return [os.path.join(ROOT, n) for n in names] + sorted(
        os.path.join(stability, n) for n in os.listdir(stability) if n.endswith(".py")
    )


def _module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _import_graph():
    """{module: {project modules it imports}} of the product, at module granularity (stability.spike_guard, ...):
    imports at any depth, inside functions too."""
    modules = {_module_name(p): p for p in _product_files()}
    graph = {}
    for name, path in modules.items():
        found = set()
        for imported in _imported_modules(_read(path)):
            parts = imported.split(".")
            candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            target = next((c for c in candidates if c in modules), None)
            if target is not None and target != name:
                found.add(target)
        graph[name] = found
    return graph


def _imported_modules(source):
    """_imports, with `from a import b` as "a.b": the module a.b where there is one (a sibling in a package, not the
    package's __init__), else a itself (the longest existing prefix wins, in _import_graph)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
        elif not isinstance(node, ast.ImportFrom):
            found += _imports(ast.unparse(node)) if isinstance(node, (ast.Import, ast.Call)) else []
    return found


def _floor(module):
    top = module.split(".")[0]
    return next(i for i, floor in enumerate(FLOORS) if top in floor)


def _circles(graph):
    """Every import circle of graph, each as a list of modules (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle_and_no_upward_import():
    graph = _import_graph()
    assert {"train", "training", "builders", "model", "hf", "stability", "stability.config"} <= set(
        graph
    )
    unplaced = sorted({m.split(".")[0] for m in graph} - set().union(*FLOORS))
    assert not unplaced, (
        f"modules on no floor of FLOORS: {unplaced} (place each where its imports put it)"
    )
    assert not _circles(graph), f"import circles: {_circles(graph)}"
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() for t in targets if _floor(t) > _floor(m)
    )
    assert not upward, f"imports of a floor above: {upward}"


def test_the_graph_checks_catch_a_circle_and_an_upward_import():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    assert (
        _floor("parallel")
        < _floor("model")
        < _floor("training")
        < _floor("stability.hooks")
        < _floor("train")
    )


def test_nothing_imports_the_script():
    """train.py is the script: the product, its tools, the lab and the tests run it (tests/helpers.py's
    train_script runs the file), none imports it."""
    importers = {
        os.path.relpath(path, ROOT): hits
        for path in _python_files()
        for hits in [[m for m in _imports(_read(path)) if m.split(".")[0] in SCRIPTS]]
        if hits
    }
    assert not importers, f"train.py is imported by {importers}"
    assert "sys.modules" not in _read(os.path.join(ROOT, "train.py"))


def test_with_no_stability_switch_nothing_of_the_layer_is_built(corpus):
    """A run with no stability switch: the layer's modules are imported for their sections (the config
    composes them), and nothing of it is built: stability.build_callbacks gives the loop no callback
    and hands no part its section; nor, with no eval_harness_tasks, is anything of lm-eval imported
    (seconds of imports)."""
    code = (
        "import runpy, sys\n"
        "import stability\n"
        "built, handed, build, section = [], [], stability.build_callbacks, stability.section\n"
        "stability.build_callbacks = lambda *a, **k: built.append(build(*a, **k)) or built[-1]\n"
        "stability.section = lambda cls, cfg: handed.append(cls.__name__) or section(cls, cfg)\n"
        "runpy.run_path('train.py', run_name='train_script')['main']("
        f"['--num_layers=1', '--hidden_size=32', '--num_attention_heads=2', '--seq_length=16', "
        f"'--micro_batch_size=2', '--global_batch_size=2', '--train_iters=3', '--eval_iters=0', "
        f"'--sample_tokens=0', '--save=none', '--save_interval=none', '--data_path={corpus}'])\n"
        "print('stability.faults' in sys.modules, built, handed)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lm_eval'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["True [None] []", "[]"], out.stdout[-2000:]


def test_the_step_takes_no_callbacks():
    """The step computes, the callbacks decide (#49): training.train_step, which returns the step's
    numbers, has no parameter for callbacks; the loop asks them between the step's calls (train.py's
    loop, through training.whole_step) and applies with training.apply_step."""
    tree = ast.parse(_read(os.path.join(ROOT, "training.py")))
    step = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "train_step")
    a = step.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p]
    assert not [n for n in names if "callback" in n], f"train_step takes callbacks: {names}"
