"""One config, owned once (sections.py): each key declared by one part, and the whole config handled only by the
boundary -- arguments.py, builders.py and the scripts -- which hands every other part its section."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where the whole config may be handled: its composition, the builders, the scripts
BOUNDARY = {"arguments.py", "builders.py", "train.py", "bench.py", "conftest.py"}
# functions elsewhere that still take the whole config, each a part that reads many owners' keys by design
WHOLE_CONFIG_ALLOWED = 15


def _product_files():
    """The product's modules (top level and stability/), but the boundary's."""
    names = [n for n in sorted(os.listdir(ROOT)) if n.endswith(".py") and n not in BOUNDARY]
    stability = [
        os.path.join("stability", n)
        for n in sorted(os.listdir(os.path.join(ROOT, "stability")))
        if n.endswith(".py")
    ]
    return names + stability


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def takes_whole_config(source):
    """The functions of source with a parameter named `cfg` (the whole config, by the naming rule)."""
    return [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and "cfg" in [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    ]


def defaulted_keys(source, keys):
    """[(class, key)] for each config key a dataclass of source gives a default: a key's declaration
    is where it gets its default and meaning. A carrier of values handed in from the boundary
    (training.StepRules, loader.DataContext: made by sections.section) has no defaults of its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            found += [
                (node.name, s.target.id)
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and s.target.id in keys
                and s.value is not None
            ]
    return found


def held_keys(source, keys):
    """[(class, key)] for each config key a dataclass of source holds, with a default or without."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            found += [
                (node.name, s.target.id)
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and s.target.id in keys
            ]
    return found


# a record of the run, not of its config, whose field shares a key's name: the iteration's own lr
NOT_CONFIG = {"training.py:Iteration"}


def test_no_part_holds_a_copy_of_its_own_keys():
    """A dataclass beside an owner holding that owner's own keys is the owner declared a second time
    (a section re-declared for one reader: the stability layer's 58, loader.MegatronKeys' 11): the
    reader takes the owner's section itself. A carrier holds other owners' values only."""
    import inspect

    from arguments import Config

    owned = {}  # file -> the keys its owners declare
    for cls in Config.__mro__[1:-1]:  # but object
        rel = os.path.relpath(inspect.getfile(cls), ROOT)
        owned.setdefault(rel, set()).update(cls.__dict__.get("__annotations__", {}))
    composition = {cls.__name__ for cls in Config.__mro__}
    copies = [
        f"{rel}:{cls}.{key}"
        for rel, keys in sorted(owned.items())
        for cls, key in held_keys(_read(rel), keys)
        if cls not in composition
    ]
    assert not copies, f"keys held again beside their owner (take the owner's section): {copies}"


def test_no_config_key_is_declared_twice():
    """Within arguments.Config's composition each key has one owner (a dataclass would merge a
    second declaration silently), and nothing outside it declares a key again with a default."""
    from arguments import FIELDS, Config

    owners = {}
    for cls in Config.__mro__[1:]:
        for key in cls.__dict__.get("__annotations__", {}):
            owners.setdefault(key, []).append(cls.__name__)
    twice = {key: classes for key, classes in owners.items() if len(classes) > 1}
    assert not twice, f"keys declared by two owners of arguments.Config: {twice}"
    composition = {cls.__name__ for cls in Config.__mro__}
    again = [
        f"{rel}:{cls}.{key}"
        for rel in sorted({*_product_files(), "builders.py"})
        for cls, key in defaulted_keys(_read(rel), set(FIELDS))
        if cls not in composition and f"{rel}:{cls}" not in NOT_CONFIG
    ]
    assert not again, (
        f"config keys declared again outside their owner (a default of their own): {again}; hand "
        "the owner's value in (sections.section of a carrier with no defaults, or an argument)"
    )


def test_the_whole_config_is_handled_by_the_boundary_only():
    found = {
        rel: names
        for rel in _product_files()
        for names in [takes_whole_config(_read(rel))]
        if names
    }
    count = sum(len(names) for names in found.values())
    assert count <= WHOLE_CONFIG_ALLOWED, (
        f"{count} functions outside {sorted(BOUNDARY)} take the whole config (`cfg`), at most "
        f"{WHOLE_CONFIG_ALLOWED}: give each its section (sections.py): {found}"
    )


def test_the_checks_see_what_they_guard_against():
    two = (
        "from dataclasses import dataclass\n@dataclass\nclass A:\n    lr: float = 1\n"
        "@dataclass\nclass B:\n    lr: float\n"
    )
    assert defaulted_keys(two, {"lr"}) == [("A", "lr")]  # B carries a value: no declaration
    assert defaulted_keys("class A:\n    lr: float = 1\n", {"lr"}) == []  # not a dataclass
    assert held_keys(two, {"lr"}) == [("A", "lr"), ("B", "lr")]
    whole = "def f(model_cfg, x):\n    pass\ndef g(a, *, cfg):\n    pass\n"
    assert takes_whole_config(whole) == ["g"]
