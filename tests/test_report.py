"""report.py knows no callback by name: a list a callback records (its decisions) accumulates
over the iteration in metrics.jsonl, whatever its key; any other value is the iteration's last."""

import json

import report


def test_a_callbacks_list_accumulates_whatever_its_key(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = report.MetricsFile(str(path))
    metrics.add(3, {"spike guard": [{"rung": 1}], "lm loss": 2.0})
    metrics.add(3, {"remedy shrink": [{"iteration": 3}], "spike guard": [{"rung": 2}]})
    metrics.add(3, {"remedy shrink": [{"iteration": 3, "again": True}], "lm loss": 1.5})
    metrics.add(4, {"replica check": [{"reason": "a"}]})
    metrics.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {
            "iteration": 3,
            "spike guard": [{"rung": 1}, {"rung": 2}],
            "lm loss": 1.5,
            "remedy shrink": [{"iteration": 3}, {"iteration": 3, "again": True}],
        },
        {"iteration": 4, "replica check": [{"reason": "a"}]},
    ]
