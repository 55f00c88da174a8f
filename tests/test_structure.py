"""The shape of the code base: parallel.py is the ground floor, the "why" comments resolve, the core stays small."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("model.py", "train.py", "parallel.py", "optim.py", "data.py")


def _python_files():
    """Every .py file of the project (not the tokenized data/, not hidden or cache directories)."""
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if not d.startswith((".", "__")) and
                      not (directory == ROOT and d == "data")]
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _project_modules():
    """Names a project import could use: the top-level modules and packages/folders (model, train, tools, ...)."""
    names = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py")}
    names |= {n for n in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, n)) and not n.startswith(".")}
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
    bad = [m for m in _imports(_read(os.path.join(ROOT, "parallel.py"))) if m == "." or m.split(".")[0] in project]
    assert not bad, f"parallel.py imports project modules {bad}: it is the ground floor (model.py builds on it)"


def test_the_import_check_catches_imports_inside_functions():
    source = "import torch\n\ndef f():\n    from model import GPT\n    import importlib\n" \
             "    return importlib.import_module('train')\n"
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
    assert headings == list(range(1, len(headings) + 1)), "lessons are numbered 1, 2, 3, ... without gaps"
    cited, stale = {}, []
    for path in [*_python_files(), os.path.join(ROOT, "README.md")]:
        text, name = _read(path), os.path.relpath(path, ROOT)
        for n in _cited(text):
            cited.setdefault(n, []).append(name)
        if path != os.path.abspath(__file__) and (re.search(r"seeds? 00\d", text, re.I) or
                                                  re.search(r"\bSPEC\b", text)):
            stale.append(name)
    assert len(cited) > 10, "the check found almost no citations: is the pattern right?"
    missing = {n: files for n, files in cited.items() if n not in headings}
    assert not missing, f"cited lessons missing from docs/lessons.md: {missing}"
    assert not stale, f"cite docs/lessons.md ('lesson N'), not the seeds or SPEC, in: {stale}"


def test_core_modules_stay_small():
    lines = {name: len(_read(os.path.join(ROOT, name)).splitlines()) for name in CORE}
    assert all(n < 900 for n in lines.values()), lines
    assert sum(lines.values()) < 3500, lines
