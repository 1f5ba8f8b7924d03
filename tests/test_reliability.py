"""Crashes, stalls, torn checkpoint saves, exact and reshaped resume, under a real mpirun."""

import json
import os
import sys

import pytest

from tests.support.mpirun import launch, run_scenario


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A 2-rank pipeline killed mid-training, its checkpoints, and the resumed launch's results
    (which also save, export and continue a P=2 and a T=2 run: one launch for both tests)."""
    folder = str(tmp_path_factory.mktemp("killed") / "checkpoints")
    # ended by the kill, within the launch's limit (measured 20 s; a hang would run into it)
    crash = launch("reliability", 2, "crash", folder, timeout=120)
    checkpoints = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return crash, checkpoints, run_scenario("reliability", 2, "resume", folder, timeout=240)


@pytest.mark.mpi
def test_killed_rank_ends_the_job_and_resume_matches_an_uninterrupted_run(killed_and_resumed):
    crash, checkpoints, resumed = killed_and_resumed
    assert crash.returncode not in (0, -9), crash.describe()
    assert all(r is None for r in crash.results)
    assert checkpoints == ["ckpt-000000002", "ckpt-000000004", "ckpt-000000006"]
    for r in resumed:
        said = "/ckpt-000000006 after step 6 (epoch 2, its batch 3 next)"
        assert [said in line for line in r["resume_lines"]] == ([True] if r["rank"] == 0 else [])
        # ReduceLROnPlateau halved the rate after epoch 2 as it would have: its counters came back
        assert r["bitwise"], f"rank {r['rank']}: resumed weights differ by {r['weights']:.2e}"
        # History holds every epoch, the one before the checkpoint too (step 6 = epoch 1, batch
        # 2 of 4), and the interrupted epoch's metric sums came back: every key, accuracy too
        assert r["epochs"] == [[0, 1, 2], [0, 1, 2]]
        assert set(r["history"]) == set(r["ref_history"]) == {"loss", "accuracy", "learning_rate"}
        for key, values in r["history"].items():
            assert values == pytest.approx(r["ref_history"][key], rel=1e-6), key
        resumed, uninterrupted = r["stateful"]
        for name, (wait, best) in resumed.items():
            assert (wait, best) == (uninterrupted[name][0], pytest.approx(uninterrupted[name][1]))
        assert resumed["EarlyStopping"][0] == 2  # patience counted over all three epochs
        assert (
            "EarlyStopping(restore_best_weights=True) found its best loss in epoch"
            in (r["refused"])
        )


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["P2", "T2"])
@pytest.mark.parametrize("written_by", ["save", "export"])
def test_a_saved_file_holds_the_whole_optimizer_and_continues_as_keras(
    killed_and_resumed, layout, written_by
):
    """After 8 Adam steps on 2 ranks (pipeline P=2, tensor T=2), rank 0's `model.save` file and
    `hf.export`'s file load in one process without Keras skipping the optimizer, hold Keras's
    own optimizer state, and 4 more steps of plain `model.fit` equal 12 steps of Keras."""
    r = killed_and_resumed[2][0]["saved_files"][layout][written_by]  # rank 0 loads and fits
    assert "error" not in r, r["error"]
    assert r["skipped"] == []  # no "Skipping variable loading for optimizer" warning
    assert r["optimizer"] < 1e-5, f"loaded optimizer state differs by {r['optimizer']:.2e}"
    assert r["continued"] < 1e-5, f"continued training differs by {r['continued']:.2e}"


@pytest.mark.mpi
def test_a_save_torn_by_a_kill_leaves_the_previous_checkpoint_loadable(tmp_path):
    folder = str(tmp_path / "checkpoints")
    torn = launch("reliability", 2, "torn_save", folder, timeout=120)
    assert torn.returncode not in (0, -9), torn.describe()
    manifest = os.path.join(folder, "ckpt-000000004", "manifest.json")
    assert os.path.exists(os.path.join(folder, "ckpt-000000004", "stage-0.npz"))
    assert not os.path.exists(manifest)  # the second save died before completing
    with open(os.path.join(folder, "ckpt-000000002", "manifest.json")) as f:
        assert json.load(f)["step"] == 2
    for r in run_scenario("reliability", 2, "after_torn", folder, timeout=180):
        assert r["complete"] == [2]
        assert r["epochs"] == [0, 1, 2]  # resumed inside epoch 0, from step 2


@pytest.mark.mpi
def test_resume_with_another_partitioning_and_export(tmp_path):
    # trains, saves and resumes in the same processes, as a user's script does: pooled
    results = run_scenario(
        "reliability", 4, "reshape", str(tmp_path / "ckpt"), timeout=300, pooled=True
    )
    for r in results:
        assert r["model4"] < 1e-6, f"4x1 resume differs from 2x2 by {r['model4']:.2e}"
        assert r["data4"] < 1e-6, f"1x4 resume differs from 2x2 by {r['data4']:.2e}"
        assert r["interleaved"] < 1e-6, f"interleaved resume differs by {r['interleaved']:.2e}"
        assert r["export"] == 0.0  # the exported .keras holds the checkpoint's weights
        assert r["export_compiled"] == "Adam"  # compiled as for training: evaluate works


@pytest.mark.mpi
def test_a_tensor_parallel_checkpoint_resumes_with_other_tensor_counts(tmp_path):
    """Each tensor rank saves its pieces; resuming joins and re-cuts them (weights and Adam's
    slots), with 1, 2 or 4 tensor ranks."""
    results = run_scenario(
        "reliability", 4, "tensor_reshape", str(tmp_path / "ckpt"), timeout=300, pooled=True
    )
    for r in results:
        assert r["files"] == [f"stage-{s}-shard-{t}.npz" for s in (0, 1) for t in (0, 1)]
        for name in ("tensor1", "data4", "tensor4"):
            assert r[name] < 1e-6, f"{name} resume differs from T=2 by {r[name]:.2e}"
        assert r["export"] == 0.0  # the exported .keras holds the checkpoint's whole weights


@pytest.mark.mpi
def test_an_expert_parallel_checkpoint_resumes_with_other_expert_counts(tmp_path):
    """Each position of the first expert group saves its experts (weights and Adam's slots)
    once, from its first tensor rank, each tensor rank of the first replica its tensor pieces,
    and every rank its ZeRO-1 slices of the other slots; resuming joins and re-cuts them, with
    experts = 2 and 1 and in a pipeline. Under hf.scope() a rank holds 1/E of the expert
    weights and their slots."""
    results = run_scenario(
        "reliability", 4, "expert_reshape", str(tmp_path / "ckpt"), timeout=400, pooled=True
    )
    for r in results:
        written = [f"stage-0-shard-{t}{r}.npz" for t in (0, 1) for r in ("-replica-1", "")]
        assert r["files"] == written, r["files"]
        # each of the first group's positions its 6 expert kernels (2 blocks x 3), once
        assert r["expert_pieces"] == {"stage-0-shard-0-replica-1.npz": 6, "stage-0-shard-0.npz": 6}
        for name in ("experts1", "pipeline"):
            # float sums in other orders, then Adam's steps on a transformer (docs/models.md)
            assert r[name] < 1e-4, f"{name} resume differs from experts=2 by {r[name]:.2e}"
        assert r["export"] == 0.0  # the exported .keras holds the checkpoint's whole weights
        # built under hf.scope(): expert weights and Adam's two slots per rank fall as 1/E
        # (E = 4 in tests/test_real_models.py's R4 case, counted there as shards and slots)
        assert r["expert_elements_whole"] == 2 * r["expert_elements_held"], r


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_stalled_rank_is_reported_and_the_job_aborted(tmp_path):
    # the 5 s watchdog ends it (measured 13 s), not the 600 s sleep, which would outlast the limit
    run = launch("reliability", 2, "stall", str(tmp_path / "ckpt"), timeout=100)
    assert run.returncode not in (0, -9), run.describe()
    assert "stalled" in run.stderr[0] and "step 2" in run.stderr[0], run.describe()
    assert "HYPARFLOW_WATCHDOG_TIMEOUT" in run.stderr[0]


@pytest.mark.mpi
def test_an_uncaught_exception_on_one_rank_ends_the_job():
    """Rank 1 raises before `hf.fit` while rank 0 waits in it: without the excepthook of
    `hyparflow/comm/uncaught.py`, rank 1's `MPI_Finalize` and rank 0's collective wait for each
    other forever (measured: still running after 90 s). The limit only catches that hang (the
    job ends in seconds); `returncode != -9` says it ended by itself."""
    run = launch("uncaught", 2, "one_rank", timeout=60)
    assert run.returncode not in (0, -9), run.describe()
    assert run.results == [None, None], run.describe()
    assert "FileNotFoundError: data-rank1.npy" in run.stderr[1], run.describe()
    assert "hyparflow rank 1: uncaught FileNotFoundError; ending the job" in run.stderr[1]


@pytest.mark.mpi
@pytest.mark.parametrize("full", [False, True])
def test_an_error_raised_on_every_rank_is_printed_once_and_exits_each_without_an_abort(full):
    """An error `hf.fit` raised on every rank alike (an unknown strategy) is not a reason to
    abort: each rank exits non-zero by itself, and rank 0 alone prints it, with the frames of
    the user's script but none of hyparflow's; `HYPARFLOW_TRACEBACK=full` prints every rank's
    whole traceback."""
    env = {"HYPARFLOW_TRACEBACK": "full"} if full else None
    run = launch("uncaught", 2, "agreed", timeout=60, env=env)
    assert run.returncode not in (0, -9), run.describe()
    for rank, stderr in enumerate(run.stderr):
        assert "ending the job" not in stderr and "MPI_ABORT" not in stderr, run.describe()
        printed = full or rank == 0
        assert stderr.count("Traceback (most recent call last)") == int(printed), run.describe()
        assert ("ValueError" in stderr and "no_such_strategy" in stderr) == printed
        assert ("hyparflow/api.py" in stderr) == full, run.describe()  # hyparflow's frames
        assert ("tests/mpi/uncaught.py" in stderr) == printed  # the user's script's


def test_the_aborting_hook_is_chained_once_and_can_be_refused(monkeypatch):
    """`install` keeps the hook it finds (its traceback prints first), installs once, and
    `HYPARFLOW_ABORT_ON_UNCAUGHT=0` leaves `sys.excepthook` alone."""
    from hyparflow.comm import uncaught

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info[0]))
    monkeypatch.setenv(uncaught.ENV_SWITCH, "0")
    original = sys.excepthook
    assert not uncaught.install() and sys.excepthook is original
    monkeypatch.delenv(uncaught.ENV_SWITCH)
    assert uncaught.install() and uncaught.install()
    hook = sys.excepthook
    assert hook is not original and hook.hyparflow_aborts
    hook(KeyError, KeyError("x"), None)  # one process: the chained hook runs, nothing aborts
    assert seen == [KeyError]
