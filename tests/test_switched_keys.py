"""Keys read only while a switch is on (each owner's SWITCHED, sections.py): given with the switch off, a run
would ignore them in silence and not be the one asked for. arguments.validate refuses them by name; a switch the
command line turns off leaves the config file's keys of that switch out, with a line."""

import dataclasses
import os
import typing

import pytest

import arguments
import sections

SWITCHED = sections.switched(arguments.Config)
FIELDS = arguments.FIELDS
# a switch on at its default is turned off with this value
OFF = {"position_embedding_type": "alibi", "embed_init": "xavier_uniform", "swiglu": True}


def _given(key):
    """A value of key's type that is not its default."""
    field = FIELDS[key]
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "x"
    kind = next(a for a in typing.get_args(field.type) if a is not type(None))
    return {int: 5, float: 0.5, str: "x"}.get(kind, ["1-2"])


def _on(switch):
    """{key: value} that turns switch on (its first alternative)."""
    key, op, value = sections.parse_switch(switch.split("|")[0])
    if not op:
        return {key: _given(key)}
    if op == ">":
        return {key: int(value) + 1}
    return {key: value == "True" if value in ("True", "False") else value}


def test_the_owners_declare_keys_read_only_behind_a_switch():
    """What the tests below read: every owner's declarations, each key a field of the config."""
    assert {
        "loss_scale_window",
        "save_interval",
        # a background writer with nothing to write: --save=none --async_save was accepted
        "async_save",
        "zclip_alpha",
        "inject_bitflip_rank",
        "rotary_base",
        # the detector's: a --spike_guard_zscore without the guard ran as if not given
        "spike_guard_zscore",
        "spike_guard_window",
    } <= set(SWITCHED)
    assert set(SWITCHED) <= set(FIELDS)
    for switch in set(SWITCHED.values()):
        assert set(sections.switch_keys(switch)) <= set(FIELDS), switch


@pytest.mark.parametrize("key", sorted(SWITCHED))
def test_a_key_given_with_its_switch_off_is_refused_by_name(key):
    switch = SWITCHED[key]
    off = {k: OFF[k] for k in sections.switch_keys(switch) if k in OFF}
    cfg = arguments.Config(**off, **{key: _given(key)})
    assert not sections.switch_on(cfg, switch)
    with pytest.raises(ValueError, match=f"^{key}=.* does nothing without "):
        arguments.validate(cfg)
    # with its switch on it is read, and not refused as unread
    cfg = dataclasses.replace(cfg, **_on(switch))
    assert sections.switch_on(cfg, switch)
    assert switch not in sections.unread(cfg)


def test_a_saved_model_with_a_key_its_switch_leaves_unread_still_builds():
    """The rule is a new run's (arguments.validate), not the model's: a checkpoint whose config was accepted before
    it (swiglu with activation=gelu_tanh) is still read, sampled, exported and resharded (each builds a GPT)."""
    import model

    cfg = model.GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64
    )
    model.GPT(
        dataclasses.replace(
            cfg,
            swiglu=True,
            activation="gelu_tanh",
            embed_init="xavier_uniform",
            embed_init_std=0.1,
        )
    )
    with pytest.raises(
        ValueError, match="^activation='gelu_tanh' does nothing without swiglu=False"
    ):
        arguments.validate(arguments.Config(swiglu=True, activation="gelu_tanh"))


def test_the_message_names_every_key_of_the_switch_and_the_fix():
    cfg = arguments.Config(loss_scale=1024.0, hysteresis=4, zclip_warmup=10)
    with pytest.raises(ValueError) as e:
        arguments.validate(cfg)
    assert str(e.value) == (
        "loss_scale=1024.0, hysteresis=4 do nothing without fp16 (here fp16=False): set fp16, or drop them; "
        "zclip_warmup=10 does nothing without zclip_z (here zclip_z=0.0): set zclip_z, or drop zclip_warmup"
    )


def _config_file(tmp_path, text):
    path = tmp_path / "run.py"
    path.write_text(text)
    return str(path)


FP16_FILE = "\n".join(
    [
        "use_bundled_corpus = True",
        "train_iters = 10",
        "fp16 = True",
        "initial_loss_scale = 4096",
        "loss_scale_window = 500",
    ]
)


@pytest.mark.parametrize("flags", [["--bf16"], ["--fp16=false"]])
def test_a_switch_the_command_line_turns_off_leaves_the_file_s_keys_of_it_out(
    tmp_path, capsys, flags
):
    """tr8b's file with --bf16 (which replaces its fp16) or --fp16=false: its loss-scaling keys would be refused,
    and the fix is not the user's file: they are left out, with one line."""
    cfg = arguments.load_config([_config_file(tmp_path, FP16_FILE), *flags])
    arguments.validate(cfg)
    assert (cfg.fp16, cfg.initial_loss_scale, cfg.loss_scale_window) == (False, 2.0**32, 1000)
    out = capsys.readouterr().out
    assert (
        "fp16 is off from the command line: the config file's initial_loss_scale = 4096, loss_scale_window = 500 "
        "are left out (read only with fp16)"
    ) in out


def test_a_key_of_a_switch_that_is_off_is_refused_where_it_was_given(tmp_path):
    """Given on the command line beside the switch it turns off, or in a file that never turned it on: refused,
    not left out (the user wrote it)."""
    with pytest.raises(ValueError, match="^loss_scale_window=700 does nothing without fp16"):
        arguments.validate(
            arguments.load_config(
                [_config_file(tmp_path, FP16_FILE), "--fp16=false", "--loss_scale_window=700"]
            )
        )
    off = _config_file(tmp_path, "save_interval = 100\ntrain_iters = 10\n")
    with pytest.raises(
        ValueError, match=r"^save_interval=100 does nothing without save \(here save=None\)"
    ):
        arguments.validate(arguments.load_config([off]))


def test_the_shipped_configs_give_no_key_they_do_not_read():
    import glob

    for path in sorted(glob.glob(f"{arguments.os.path.dirname(arguments.__file__)}/config/*.py")):
        cfg = arguments.load_config([path])
        assert sections.unread(cfg) == {}, path


def test_help_says_which_switch_a_key_needs():
    import usage

    text = usage.format_help(width=400)
    assert "[with fp16]" in next(
        line for line in text.splitlines() if "--loss_scale_window " in line
    )
    assert "[with load or save]" in next(
        line for line in text.splitlines() if "--no_load_optim " in line
    )


def test_a_resume_leaving_out_a_key_the_checkpoint_s_model_never_read_is_the_same_model():
    """The fix the refusal names (drop activation beside swiglu) must not make the resume refuse the checkpoint
    as another model; where the model reads the key, it is still one."""
    import safety

    saved = arguments.to_dict(arguments.Config(swiglu=True, activation="gelu_tanh"))
    safety.compare_configs(saved, arguments.to_dict(arguments.Config(swiglu=True)), "ckpt")
    saved = arguments.to_dict(arguments.Config(activation="gelu_tanh"))
    with pytest.raises(ValueError, match="holds another model: activation 'gelu_tanh'"):
        safety.compare_configs(saved, arguments.to_dict(arguments.Config()), "ckpt")


def test_a_key_left_out_that_is_a_switch_takes_its_own_keys_with_it(capsys):
    """tr11's TP=4 config at --tensor_model_parallel_size=1 (bench.py's timing on one process): its replica check
    is left out, and the check's resync with it, where the resync alone was refused."""
    path = os.path.join(os.path.dirname(arguments.__file__), "config", "tr11_176b.py")
    cfg = arguments.load_config([path, "--tensor_model_parallel_size=1"])
    arguments.validate(cfg, world_size=12, reads_data=False)
    assert (cfg.tp_replica_check_interval, cfg.tp_replica_resync) == (0, False)
    out = capsys.readouterr().out
    assert "the config file's tp_replica_check_interval = 100 is left out" in out
    assert "the config file's tp_replica_resync = True is left out" in out
