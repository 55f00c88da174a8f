"""The ninth campaign's design runs (lab/design_ninth.py): the docs' table is the records' own, the records hold
every run the script defines, and each run's arguments pass train.py's parser and checks."""

import os

import campaign_draw as cd
import design_ninth as dn

DOCS = os.path.join(os.path.dirname(dn.HERE), "docs", "spike_guard.md")


def test_the_docs_table_is_the_records_own():
    records = dn.records()
    assert dn.table(records) in open(DOCS).read()
    # a record off by a hundredth of a percent changes its cell, and the table is no longer the docs'
    r = records[dn.key("random-200x64", None)]
    records[dn.key("random-200x64", None)] = {**r, "valid": r["valid"] + 0.001}
    assert dn.table(records) not in open(DOCS).read()


def test_the_records_hold_every_run_as_the_script_defines_it():
    records = dn.records()
    for lr in dn.LRS:
        for name, launch, fault in dn.runs(lr):
            r = records[dn.key(name, lr)]
            assert (r["flags"], r["launch"], r["exit"]) == (fault, launch, 0), (name, lr)
    assert len(records) == sum(len(dn.runs(lr)) for lr in dn.LRS)


def test_each_run_passes_the_runs_own_parser_and_checks():
    import arguments

    for lr in dn.LRS:
        for name, launch, fault in dn.runs(lr):
            parts = dn.argv(name, launch, fault, lr, "/tmp/ck")
            assert len(parts) == (2 if isinstance(launch, int) else 1)
            for args in parts:
                cfg = arguments.load_config([*args, "--data_path=unused"])
                arguments.validate(cfg, world_size=dn.trial(launch)["nproc"], reads_data=False)
                assert cfg.seed == dn.SEED and cfg.train_iters == dn.ITERS
                assert cfg.lr == (lr or 2e-3)


def test_its_harm_threshold_is_the_campaigns():
    records = dn.records()
    bold = [n for n in dn.CASES if dn.harm(records, n, None).startswith("**")]
    assert bold == ["random-200x64", "fp16-200x100", "fp16-300x60"] and dn.cd.HARM == cd.HARM
