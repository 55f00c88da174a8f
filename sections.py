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
