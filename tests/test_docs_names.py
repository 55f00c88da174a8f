"""The docs name the code where it lives: every `module.name` and `Class.member` in backticks in README.md,
docs/ and lab/ resolves in the source (read with ast: nothing is imported, the script included). A function moved
to another module left five stale names in docs/lessons.md that no reader could follow."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("stability", "tools", "lab")
# `config.py`, `runs.jsonl`: file names, not attributes
SUFFIXES = {
    "py",
    "md",
    "json",
    "jsonl",
    "sh",
    "txt",
    "png",
    "bin",
    "idx",
    "pt",
    "yaml",
    "toml",
    "safetensors",
}
REFERENCE = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def _members(cls):
    """The names a class holds: its body's defs and assignments, and what its methods assign to self."""
    names = set()
    for node in ast.walk(cls):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not cls
        ):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets if isinstance(node, (ast.Assign, ast.AnnAssign)) else []:
            if isinstance(t, ast.Name):
                names.add(t.id)
            elif (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                names.add(t.attr)
    return names


def _namespace(tree):
    """{name: members or None} of a module's top level; a module __getattr__'s names (`if name == "X"`) too."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = _members(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
            if node.name == "__getattr__":
                for c in ast.walk(node):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        names.setdefault(c.value, None)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = None
    return names


def _modules():
    """{module name: namespace} of the top-level modules and those of stability/, tools/ and lab/."""
    paths = glob.glob(os.path.join(ROOT, "*.py"))
    for package in PACKAGES:
        paths += glob.glob(os.path.join(ROOT, package, "*.py"))
    modules = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            # stability/precursors.py and tools/precursors.py: one name, either's
            modules.setdefault(os.path.basename(path)[:-3], {}).update(
                _namespace(ast.parse(f.read()))
            )
    return modules


def _unresolved(text, modules):
    """[reference] of text's backticked references into the project that name nothing there."""
    classes = {}
    for namespace in modules.values():
        for name, members in namespace.items():
            if members is not None:
                classes.setdefault(name, set()).update(members)
    wrong = []
    for reference in REFERENCE.findall(text):
        parts = reference.split(".")
        if parts[0] in PACKAGES and parts[1] in modules:
            parts = parts[1:]
        if parts[-1] in SUFFIXES or len(parts) < 2:
            continue
        if parts[0] in modules:
            namespace = modules[parts[0]]
            if parts[1] not in namespace:
                wrong.append(reference)
            elif (
                len(parts) > 2
                and namespace[parts[1]] is not None
                and parts[2] not in namespace[parts[1]]
            ):
                wrong.append(reference)
        elif parts[0] in classes and parts[1] not in classes[parts[0]]:
            wrong.append(reference)
    return wrong


def test_every_name_the_docs_give_the_code_exists():
    modules = _modules()
    paths = [os.path.join(ROOT, "README.md")]
    paths += sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "lab", "*.md"))
    )
    wrong = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                wrong += [
                    f"{os.path.relpath(path, ROOT)}:{number}: `{r}`"
                    for r in _unresolved(line, modules)
                ]
    assert not wrong, "names the code does not have (moved or renamed?):\n" + "\n".join(wrong)


def test_the_name_check_catches_a_moved_function_and_a_lost_member():
    modules = _modules()
    assert (
        _unresolved(
            "`schedule.AnnealingLR` `schedule.AnnealingLR.load_state_dict` `GPTConfig.check`",
            modules,
        )
        == []
    )
    assert (
        _unresolved("`eval_harness.StableGPT` `SpikeGuard.lr_scale` `stability/guard.py`", modules)
        == []
    )
    assert _unresolved("`optim.AnnealingLR`, `train.Plan.skipped`", modules) == [
        "optim.AnnealingLR",
        "train.Plan.skipped",
    ]
    assert _unresolved("`schedule.AnnealingLR.no_such` and `GPTConfig.no_such`", modules) == [
        "schedule.AnnealingLR.no_such",
        "GPTConfig.no_such",
    ]
