"""train.py is a script: the tests run its main and reach into its namespace for nothing else.

A test that replaced a name inside train.py (script["train_step"] = spy) or fetched a library
function from it (train_script()["exit_reason"]) tied the tests to the script's imports and kept
library code in the script. Tests drive the library (`training`, `builders`, `safety`, ...; a spy
goes on the module train.py looks the name up on: training.train_step, training.evaluate) or the
command line.
"""

import ast
import os

from helpers import ROOT


def _runs_the_script(node):
    """Does node call for train.py's namespace (train_script(), runpy.run_path('train.py'))?"""
    if not isinstance(node, ast.Call):
        return False
    name = ast.unparse(node.func)
    if name.split(".")[-1] == "train_script":
        return True
    return name.endswith("run_path") and bool(node.args) and "train.py" in ast.unparse(node.args[0])


def script_uses(source):
    """[(line, code)] of each use of train.py's namespace in source other than calling its main: the
    namespace indexed with another name, assigned into, or handed on (to a function, a dict, another
    name). The namespace is a call of _runs_the_script or a name (or attribute) assigned one."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bound, binding = set(), set()  # the names assigned the namespace; the calls so assigned
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts))
                for t, v in pairs:
                    if _runs_the_script(v) and isinstance(t, (ast.Name, ast.Attribute)):
                        bound.add(ast.unparse(t))
                        binding.add(v)
    found = []
    for node in ast.walk(tree):
        named = (
            isinstance(node, (ast.Name, ast.Attribute))
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node) in bound
        )
        if not (named or _runs_the_script(node)) or node in binding:  # a binding: its name's uses
            continue
        parent = parents.get(node)
        main = (
            isinstance(parent, ast.Subscript)
            and parent.value is node
            and isinstance(parent.ctx, ast.Load)
            and isinstance(parent.slice, ast.Constant)
            and parent.slice.value == "main"
        )
        if not main:
            found.append((node.lineno, ast.unparse(parent if parent is not None else node)))
    return found


def _test_files():
    for folder in ("tests", os.path.join("lab", "tests")):
        directory = os.path.join(ROOT, folder)
        if os.path.isdir(directory):
            names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
            yield from (os.path.join(folder, n) for n in names)


def test_no_test_reaches_into_the_script_but_for_its_main():
    found = {}
    for rel in _test_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            uses = script_uses(f.read())
        if uses:
            found[rel] = uses
    assert not found, (
        f"tests using train.py's namespace for more than its main: {found}; spy "
        "on the module train.py calls (training.train_step, training.evaluate) or "
        "drive the library directly"
    )


def test_the_check_catches_each_way_in():
    ok = (
        'main = train_script()["main"]\n'
        'train_script()["main"](["--train_iters=1"])\n'
        'runpy.run_path("train.py", run_name="train_script")["main"](sys.argv[1:])\n'
        'script = train_script()\nscript["main"]([])\n'
        'self.main, other = train_script()["main"], 1\n'
    )
    assert script_uses(ok) == []
    bad = {
        'f = train_script()["exit_reason"]': 1,
        'script = train_script()\nscript["train_step"] = spy\nscript["main"]([])': 1,
        'self.script, x = helpers.train_script(), 1\nowners = {"train_step": self.script}': 1,
        'ns = runpy.run_path("train.py")\nns.get("run")': 1,
        "run_with(train_script(), [])": 1,
        'script = train_script()\nvars(script)\nscript["evaluate"] = e': 2,
    }
    for source, count in bad.items():
        assert len(script_uses(source)) == count, (source, script_uses(source))
