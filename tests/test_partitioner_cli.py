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


def test_help_and_light_commands_start_without_tensorflow():
    """`hyparflow --help` and each command's help import neither TensorFlow nor Keras (they cost
    seconds to import); checked by what was imported, not by a time."""
    check = (
        "import sys, json\n"
        "from hyparflow.cli import main\n"
        "for argv in (['--help'], ['plan', '--help'], ['report', '--help'],\n"
        "             ['simulate', '--help'], ['run', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('tensorflow', 'keras', 'mpi4py.MPI') if m in sys.modules]\n"
        "print(json.dumps(heavy))\n"
    )
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "--custom-objects" in run.stdout and "module:function" in run.stdout
    assert json.loads(run.stdout.splitlines()[-1]) == []


CUSTOM_LAYERS = """
import keras


class Scale(keras.layers.Layer):  # not registered: found only by --custom-objects
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


def build():
    x = keras.Input((8,))
    h = Scale(name="scale")(keras.layers.Dense(8, name="first")(x))
    return keras.Model(x, keras.layers.Dense(2, name="head")(h))
"""


def test_plan_loads_custom_layers_by_module_or_builds_the_model(tmp_path, monkeypatch, capsys):
    """A saved model with a custom layer: refused with the flag to pass, then planned with
    `--custom-objects MODULE`; `module:function` plans the model the function builds."""
    (tmp_path / "hf_cli_layers.py").write_text(CUSTOM_LAYERS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command adds the current folder
    monkeypatch.delitem(sys.modules, "hf_cli_layers", raising=False)
    sys.path.insert(0, str(tmp_path))
    __import__("hf_cli_layers").build().save(tmp_path / "custom.keras")
    del sys.modules["hf_cli_layers"]

    assert main(["plan", "custom.keras", "-p", "2", "--json"]) == 1
    assert "pass --custom-objects MODULE" in capsys.readouterr().err
    assert (
        main(["plan", "custom.keras", "-p", "2", "--json", "--custom-objects", "hf_cli_layers"])
        == 0
    )
    loaded = json.loads(capsys.readouterr().out)
    assert main(["plan", "hf_cli_layers:build", "-p", "2", "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    for plan in (loaded, built):
        assert [s["layers"] for s in plan["stages"]] == [["first"], ["scale", "head"]]
    assert main(["plan", "hf_cli_layers:missing", "-p", "2"]) == 1
    assert "has no function 'missing'" in capsys.readouterr().err
