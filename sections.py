"""A part of the run reads its own section of the config, never the whole.

arguments.Config is the flat composition of every owner's dataclass (model.GPTConfig, loader.DataConfig,
optim.OptimizerConfig, ...): the flat Megatron names stay the names on the command line, in config files, in
`--help` and in checkpoints. Each key is declared once, by the owner that reads it. The whole config (`cfg`) is
handled only by arguments.py, builders.py and the scripts; they hand each part its section:

    model = GPT(section(GPTConfig, cfg), ...)

A section holds its owner's keys and nothing else, so a part that reads another's key fails at once (an
AttributeError) instead of growing a hidden dependency. A value a part needs from another owner (the seed, the
sequence length) is passed to it as an argument, where the reader sees it.

A parameter holding a section is named after its part: model_cfg (GPTConfig), data_cfg (DataConfig), optim_cfg,
schedule_cfg, layout_cfg, ckpt_cfg, log_cfg, harness_cfg, and the stability layer's sections after their
callbacks (guard_cfg, faults_cfg, ...). A bare `cfg` is the whole config and nothing else.
"""

from dataclasses import fields


def section(cls, config):
    """The dataclass cls filled from config (the whole config, or a larger section): each field the key
    of its name."""
    return cls(**{f.name: getattr(config, f.name) for f in fields(cls) if f.init})


# -----------------------------------------------------------------------------
# Keys a switch turns on
#
# An owner declares beside its keys the ones read only while a switch is on, as a class attribute of its dataclass
# (not a key):
#
#     SWITCHED = {"fp16": ("loss_scale", "initial_loss_scale", ...)}
#
# A switch is a key, on when its value is set (true, non-zero, not None); "key=value", on at that value;
# "key>number", on above it; or alternatives "a|b", on when either is. Such a key given while its switch is off
# would be ignored in silence, and the run would not be the one asked for: arguments.validate refuses it
# (unread()).


def switched(config_class):
    """{key: switch} of every SWITCHED a class or its bases declare (arguments.Config: every owner's)."""
    found = {}
    for cls in reversed(config_class.__mro__):
        for switch, keys in vars(cls).get("SWITCHED", {}).items():
            found.update(dict.fromkeys(keys, switch))
    return found


def switch_on(config, switch):
    """Is `switch` (a SWITCHED switch) on in config?"""
    for alternative in switch.split("|"):
        key, op, value = parse_switch(alternative)
        current = getattr(config, key)
        if op == "=" and str(current) == value:
            return True
        if op == ">" and current is not None and current > float(value):
            return True
        if not op and current:
            return True
    return False


def switch_keys(switch):
    return [parse_switch(alternative)[0] for alternative in switch.split("|")]


def parse_switch(alternative):
    """(key, "=" or ">" or "", value) of one alternative of a switch."""
    for op in "=>":
        key, found, value = alternative.partition(op)
        if found:
            return key, op, value
    return alternative, "", ""


def unread(config):
    """{switch: [key, ...]} of the keys of config (a dataclass: arguments.Config, or an owner's) given, not at their
    default, while the switch that turns them on is off."""
    defaults = {f.name: f.default for f in fields(config)}
    found = {}
    for key, switch in switched(type(config)).items():
        if getattr(config, key) != defaults[key] and not switch_on(config, switch):
            found.setdefault(switch, []).append(key)
    return found


def unread_message(config, found):
    """One line for unread()'s keys, each switch's with its fix."""
    problems = []
    for switch, keys in found.items():
        given = ", ".join(f"{key}={getattr(config, key)!r}" for key in keys)
        verb = "does" if len(keys) == 1 else "do"
        wanted = " or ".join(_show_switch(alternative) for alternative in switch.split("|"))
        now = ", ".join(f"{key}={getattr(config, key)!r}" for key in switch_keys(switch))
        drop = keys[0] if len(keys) == 1 else "them"
        problems.append(
            f"{given} {verb} nothing without {wanted} (here {now}): set {wanted}, or drop {drop}"
        )
    return "; ".join(problems)


def _show_switch(alternative):
    key, op, value = parse_switch(alternative)
    if op != "=" or value in ("True", "False"):
        return alternative
    return f"{key}={value!r}"
