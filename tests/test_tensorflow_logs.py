"""`hyparflow run` shows each of TensorFlow's C++ log lines once, not once per rank: the pure
filter (a table), the relay over a real pipe, and a real 2-rank launch under mpirun."""

import collections
import io
import os
import subprocess
import sys
import threading

import pytest

from hyparflow.launch.tensorflow_logs import RepeatFilter, could_become_log_line, repeat_key
from hyparflow.run import relay_errors
from tests.support.mpirun import REPO

# What TensorFlow 2.21 wrote at start-up on this CPU-only machine (two processes' lines)
RANK_0 = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796233674.993664    2915 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "I0000 00:00:1796233675.094484    2915 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
]
RANK_1 = [line.replace("2915", "2916").replace("1796233674", "1796233677") for line in RANK_0]


@pytest.mark.parametrize(
    "line, key",
    [
        (
            RANK_0[1],
            "I cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
            "not be used.",
        ),
        (RANK_0[0], RANK_0[0]),
        (RANK_0[3] + "\n", RANK_0[3]),
        (
            "E1202 17:44:19.123456 77 cuda_platform.cc:52] failed call to cuInit",
            "E cuda_platform.cc:52] failed call to cuInit",
        ),
        ("Epoch 1/5", None),
        ("I love this model", None),
        ("Traceback (most recent call last):", None),
        ("W0000 00:00:1.0 7 keras.py:12] a Python warning's file is not C++", None),
    ],
)
def test_a_log_lines_key_drops_what_differs_between_ranks(line, key):
    assert repeat_key(line) == key


def test_the_same_line_from_another_rank_is_left_out_and_a_different_one_kept():
    keep = RepeatFilter().keep
    first = [keep(line) for line in RANK_0]
    gpu_1 = RANK_1[1].replace("Could not find cuda drivers", "Found GPU 1")
    again = [keep(line) for line in [*RANK_1, gpu_1, "Epoch 1/5", "Epoch 1/5"]]
    assert first == [True] * 4
    assert again == [False] * 4 + [True, True, True]


# starts of lines that may still become a TensorFlow or absl log line, and of lines that cannot
MAY_BE_LOG = ["I", "I00", "W0000 00:00:1.2 ", "WARNING: All log", "To enable", ""]
NOT_LOG = ["\r 40%|####", "Epoch 1/5", "Ix"]


@pytest.mark.parametrize(
    "start, held", [(s, True) for s in MAY_BE_LOG] + [(s, False) for s in NOT_LOG]
)
def test_an_unfinished_line_is_held_only_while_it_may_become_a_log_line(start, held):
    assert could_become_log_line(start) == held


def test_the_relay_passes_progress_on_at_once_and_each_log_line_once():
    read, write = os.pipe()
    out = io.StringIO()
    with os.fdopen(read, "rb") as source:
        relay = threading.Thread(target=relay_errors, args=(source, out))
        relay.start()
        for line in RANK_0:
            os.write(write, line.encode() + b"\n")
        os.write(write, b"\r 50%|#####")
        _wait_for(lambda: out.getvalue().endswith("\r 50%|#####"))  # not held for its newline
        os.write(write, ("\n" + "\n".join(RANK_1)).encode() + b"\n\xff done")  # bad UTF-8
        os.close(write)
        relay.join(10)
    assert not relay.is_alive()
    assert out.getvalue() == "\n".join(RANK_0) + "\n\r 50%|#####\n\ufffd done"


def _wait_for(condition, seconds=10.0):
    done = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("the relay held the unfinished line back")


IMPORTS_TENSORFLOW = "import tensorflow as tf; tf.constant(1.0) + 1.0\n"


def _launch(tmp_path, **env):
    script = tmp_path / "starts.py"
    script.write_text(IMPORTS_TENSORFLOW)
    drop = ("OMPI_", "TF_NUM_", "OMP_NUM_", "SLURM_", "PMIX_", "TF_CPP_")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    done = subprocess.run(
        [sys.executable, "-m", "hyparflow.run", "-n", "2", str(script)],
        cwd=REPO,
        env={**environ, "PYTHONPATH": REPO, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return collections.Counter(
        key for key in map(repeat_key, done.stderr.splitlines()) if key is not None
    )


@pytest.mark.mpi
def test_two_ranks_start_with_tensorflows_lines_shown_once(tmp_path):
    """With TF_CPP_MIN_LOG_LEVEL=0 every rank's lines come through (each at least twice: the
    test would pass for nothing if they did not); by default, and at level 2, each once."""
    every = _launch(tmp_path, TF_CPP_MIN_LOG_LEVEL="0")
    assert every and min(every.values()) >= 2, every
    for env in ({}, {"TF_CPP_MIN_LOG_LEVEL": "2"}):
        shown = _launch(tmp_path, **env)
        assert set(shown) <= set(every) and set(shown) & set(every), (shown, every)
        assert set(shown.values()) == {1}, shown
