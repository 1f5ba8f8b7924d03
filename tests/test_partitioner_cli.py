"""`hyparflow plan MODEL.keras --partitions N` prints the plan table."""

import json
import subprocess
import sys

import keras
import pytest
from keras import layers

from hyparflow.cli import main


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    x = keras.Input((8,))
    h = layers.Dense(16, activation="relu", name="first")(x)
    h = layers.Dense(16, activation="relu", name="second")(h)
    h = layers.Dense(8, name="third")(h)
    model = keras.Model(x, layers.Dense(2, name="head")(layers.Add(name="add")([h, x])))
    path = tmp_path_factory.mktemp("cli") / "tiny.keras"
    model.save(path)
    return path


def test_plan_command_prints_the_table(saved_model):
    result = subprocess.run(
        [sys.executable, "-m", "hyparflow.cli", "plan", str(saved_model), "--partitions", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Plan for") and "2 stages" in lines[0]
    assert lines[1].split()[:3] == ["stage", "layers", "params"]
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"]
    assert "imbalance (slowest/mean)" in result.stdout


def test_plan_command_json_and_explicit_split(saved_model, capsys):
    assert main(["plan", str(saved_model), "-p", "3", "--balance", "second,head", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in plan["stages"]] == [
        ["first"],
        ["second", "third", "add"],
        ["head"],
    ]


def test_plan_command_time_balance(saved_model, capsys):
    assert (
        main(["plan", str(saved_model), "-p", "2", "--balance", "time", "--batch-size", "4"]) == 0
    )
    assert "measured (ms)" in capsys.readouterr().out


def test_plan_command_reports_bad_requests(saved_model, capsys):
    assert main(["plan", str(saved_model), "-p", "99"]) == 1
    assert "only" in capsys.readouterr().err
    assert main([]) == 2
