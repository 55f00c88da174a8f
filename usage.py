"""`python train.py --help`: every config key with its type, default and meaning, grouped.

The keys are defined in one place, the fields of arguments.Config (which extends model.GPTConfig). This module
reads them from that source instead of importing it: the comment after a field is its meaning and a comment
`# -- group: ... --` starts a group. Reading the files needs neither torch nor the project's modules, so help
prints at once; tests/test_safety.py checks that it lists exactly the fields of the real dataclass.
"""
import ast
import io
import os
import re
import textwrap
import tokenize

ROOT = os.path.dirname(os.path.abspath(__file__))
# Base class first: dataclass fields come in that order.
SOURCES = (("model.py", "GPTConfig"), ("arguments.py", "Config"))
SECTION = re.compile(r"#\s*--\s*(\w+):?\s*(.*?)\s*-*$")  # "# -- group: what it holds --"
ORDER = ("model", "data", "optimizer", "schedule", "parallel", "checkpoint", "logging", "stability")

USAGE = """\
usage: python train.py [CONFIG.py] [--key=value | --key value | --flag] ...
       torchrun --nproc_per_node N train.py [CONFIG.py] [--key=value ...]

A config file (default config/tiny.py) sets keys as Python globals; command-line overrides follow, with
hyphens or underscores (--lr-warmup-samples 216_320 == --lr_warmup_samples=216_320). A bare --flag sets a
boolean key; list keys take several values (--data_path 0.7 data/a 0.3 data/b). README.md explains each part.
"""


def config_fields():
    """[(group, group description, name, type, default, meaning)] in definition order."""
    out = []
    for filename, class_name in SOURCES:
        out += _class_fields(os.path.join(ROOT, filename), class_name)
    return out


def _class_fields(path, class_name):
    with open(path) as f:
        source = f.read()
    comments = {tok.start[0]: (tok.start[1], tok.string)
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    fields = {stmt.lineno: stmt for stmt in node.body
              if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
    out, group, about = [], "model", ""
    for line in range(node.lineno, node.end_lineno + 1):
        if line in fields:
            stmt = fields[line]
            meaning = comments[stmt.end_lineno][1].lstrip("# ") if stmt.end_lineno in comments else ""
            default = ast.unparse(stmt.value) if stmt.value is not None else "(required)"
            out.append((group, about, stmt.target.id, ast.unparse(stmt.annotation), default, meaning))
        elif line in comments and (m := SECTION.match(comments[line][1])):
            group, about = m.group(1), m.group(2) or ""
    return out


def format_help(width=120):
    groups = {}  # a group may be continued later in the source (model.py's and arguments.py's "stability")
    for group, about, name, kind, default, meaning in config_fields():
        entry = groups.setdefault(group, {"about": [], "keys": []})
        if about and about not in entry["about"]:
            entry["about"].append(about)
        entry["keys"].append((name, kind, default, meaning))
    lines = [USAGE]
    for group in sorted(groups, key=lambda g: ORDER.index(g) if g in ORDER else len(ORDER)):
        entry = groups[group]
        title = group + (": " + "; ".join(entry["about"]) if entry["about"] else "")
        lines.append(title)
        for name, kind, default, meaning in entry["keys"]:
            head = f"  --{name:<30} {kind} = {default}"
            indent = max(len(head) + 2, 58)
            lines += textwrap.wrap(meaning, width, initial_indent=head.ljust(indent), subsequent_indent=" " * indent)
        lines.append("")
    return "\n".join(lines)


def print_help():
    print(format_help())
