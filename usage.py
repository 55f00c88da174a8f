"""`python train.py --help`: every config key with its type, default and meaning, grouped by owner.

Each key is declared once, in its owner's dataclass (model.GPTConfig, schedule.ScheduleConfig, ...), and
arguments.Config is made of those dataclasses. This module reads them from the source instead of importing them:
Config's bases and the `from MODULE import NAME` lines that bring them, then each owner's class, where the
comment after a field (or the comment lines right above it) is its meaning and a comment `# -- group: ... --`
starts a group. Reading the files needs neither torch nor the project's modules, so help prints at once;
tests/test_safety.py checks that it lists exactly the fields of the real dataclass.
"""

import ast
import io
import os
import re
import textwrap
import tokenize

ROOT = os.path.dirname(os.path.abspath(__file__))
CONFIG = ("arguments.py", "Config")  # the composition of the owners' dataclasses
SECTION = re.compile(r"#\s*--\s*(\w+):?\s*(.*?)\s*-*$")  # "# -- group: what it holds --"
# The groups an owner may declare; a group comment naming another is a typo, refused when help is built
ORDER = (
    "model",
    "levers",  # the model's stability switches (docs/levers.md); "stability" is the layer (stability/)
    "data",
    "optimizer",
    "precision",
    "schedule",
    "parallel",
    "checkpoint",
    "logging",
    "stability",
)

USAGE = """\
usage: python train.py [CONFIG.py] [--key=value | --key value | --flag] ...
       torchrun --nproc_per_node N train.py [CONFIG.py] [--key=value ...]

A config file (default config/tiny.py) sets keys as Python globals; command-line overrides follow, with
hyphens or underscores (--lr-warmup-samples 216_320 == --lr_warmup_samples=216_320). A bare --flag sets a
boolean key; list keys take several values (--data_path 0.7 data/a 0.3 data/b). README.md explains each part.
"""


def config_fields():
    """[(group, group description, name, type, default, meaning)] in definition order."""
    return [field[1:] for field in _owned_fields()]


def owners():
    """[(file, class name)] of Config's parts, in the order of its fields: a dataclass collects its bases' fields
    last base first."""
    return _parts(*CONFIG)


def _parts(filename, class_name):
    """[(file, class name)] of the classes whose own fields make class_name's, in its fields' order.
    A class with no field of its own is their composition (Config): its bases, each found where
    the file defines it or imports it (`from MODULE import NAME`); stability.config.StabilityConfig
    composes the sections of the layer's parts (_layer_sections)."""
    tree = ast.parse(_read(os.path.join(ROOT, filename)))
    modules = _imported_names(tree)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    if any(isinstance(stmt, ast.AnnAssign) for stmt in node.body) or not node.bases:
        return [(filename, class_name)]
    if isinstance(node.bases[0], ast.Starred):  # StabilityConfig(*reversed(sections()))
        return _layer_sections()
    return [
        part
        for base in reversed(node.bases)
        for part in _parts(_defined_in(modules, base.id, filename), base.id)
    ]


def _imported_names(tree):
    """{name: the module it comes from} of a file's `from MODULE import NAME` lines."""
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def _defined_in(modules, name, filename):
    """The file that defines name, as seen from filename: its `from MODULE import name`'s, or its own."""
    return modules[name].replace(".", "/") + ".py" if name in modules else filename


def _layer_sections():
    """[(file, class name)] of the stability layer's sections, as stability.config.sections() makes
    them: each part's Config, once, the parts of stability.FRAME first, then REGISTRY's."""
    tree = ast.parse(_read(os.path.join(ROOT, "stability", "__init__.py")))
    lists = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    wheres = [e.value for e in lists["FRAME"].elts]
    # REGISTRY's entries: (switches, "module.Class")
    wheres += [entry.elts[-1].value for entry in lists["REGISTRY"].elts]
    return list(dict.fromkeys(_section_of(*where.rsplit(".", 1)) for where in wheres))


def _section_of(module, class_name):
    """(file, class name) of the section a part of the layer names as its Config, in its class or
    the nearest base class that does (remedies.OptRestart: CheckpointRestart's)."""
    filename = f"stability/{module}.py"
    tree = ast.parse(_read(os.path.join(ROOT, filename)))
    modules = _imported_names(tree)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "Config":
            value = ast.unparse(stmt.value)  # GuardConfig, or spike_guard.GuardConfig
            if "." in value:
                return f"stability/{value.split('.')[0]}.py", value.split(".")[1]
            return _defined_in(modules, value, filename), value
    base = ast.unparse(node.bases[0])
    if "." in base:
        raise ValueError(f"{filename}: {class_name} names no Config (its section)")
    return _section_of(module, base)


def _owned_fields():
    out = []
    for filename, class_name in owners():
        out += [
            (filename, *field) for field in _class_fields(os.path.join(ROOT, filename), class_name)
        ]
    return out


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _class_fields(path, class_name):
    source = _read(path)
    comments = {
        tok.start[0]: (tok.start[1], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    node = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == class_name
    )
    fields = {
        stmt.lineno: stmt
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    switched = _switched(node)
    out, group, about = [], "model", ""
    for line in range(node.lineno, node.end_lineno + 1):
        if line in fields:
            stmt = fields[line]
            meaning = _meaning(comments, stmt)
            if stmt.target.id in switched:
                meaning += f" [with {switched[stmt.target.id].replace('|', ' or ')}]"
            default = ast.unparse(stmt.value) if stmt.value is not None else "(required)"
            out.append(
                (group, about, stmt.target.id, ast.unparse(stmt.annotation), default, meaning)
            )
        elif line in comments and (m := SECTION.match(comments[line][1])):
            group, about = m.group(1), m.group(2) or ""
            if group not in ORDER:
                raise ValueError(
                    f"{path}: group {group!r} of {class_name} is not one of usage.ORDER {ORDER}"
                )
    return out


def _switched(node):
    """{key: switch} of the class's SWITCHED (sections.py): the keys read only while a switch is on."""
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "SWITCHED":
            return {
                key: switch for switch, keys in ast.literal_eval(stmt.value).items() for key in keys
            }
    return {}


def _meaning(comments, stmt):
    """A field's meaning: the comment after it, or else the comment lines right above it (a group's
    heading, `# -- group: ... --`, is not one)."""
    after = [c for line, (col, c) in comments.items() if stmt.lineno <= line <= stmt.end_lineno]
    if after:
        return " ".join(c.lstrip("# ") for c in after)
    above, line = [], stmt.lineno - 1
    while (
        line in comments
        and comments[line][0] == stmt.col_offset
        and not SECTION.match(comments[line][1])
    ):
        above.insert(0, comments[line][1].lstrip("# "))
        line -= 1
    return " ".join(above)


def format_help(width=120):
    sections = {}  # (owner, group): an owner's group may be continued further down its class
    for owner, group, about, name, kind, default, meaning in _owned_fields():
        entry = sections.setdefault((owner, group), {"about": [], "keys": []})
        if about and about not in entry["about"]:
            entry["about"].append(about)
        entry["keys"].append((name, kind, default, meaning))
    lines = [USAGE]
    for (owner, group), entry in sections.items():
        lines.append(
            f"{group} ({owner})" + (": " + "; ".join(entry["about"]) if entry["about"] else "")
        )
        for name, kind, default, meaning in entry["keys"]:
            head = f"  --{name:<30} {kind} = {default}"
            indent = max(len(head) + 2, 58)
            lines += textwrap.wrap(
                meaning, width, initial_indent=head.ljust(indent), subsequent_indent=" " * indent
            )
        lines.append("")
    return "\n".join(lines)


def print_help():
    print(format_help())
