"""The shared Keras references (tests/support/references.py): each trained once, by whoever
claims it first, and read back by every caller."""

from tests.support import references
from tests.support.mpirun import REFERENCES_ENV


def test_a_reference_is_trained_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))
    trained = []

    def train(name):
        def run():
            trained.append(name)
            return {"weights": [name]}

        return run

    requests = [({"model": m}, train(m)) for m in ("a", "b", "a")]
    references.prefetch(requests)
    assert trained == ["a", "b"]  # a repeated key is claimed once
    assert references.shared({"model": "b"}, train("again")) == {"weights": ["b"]}
    assert trained == ["a", "b"]


def test_a_claim_is_won_once_per_launch(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))
    path = references._path({"model": "c"})
    assert references._claim(path) is True
    assert references._claim(path) is False  # another rank of this launch trains it


def test_a_claim_names_the_launch_not_the_parent(tmp_path, monkeypatch):
    """Ranks on another (emulated) node have another daemon for a parent; PMIx's namespace is
    the launch's on every node, so one claim holds across them and a later launch claims anew."""
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))
    path = references._path({"model": "d"})
    monkeypatch.setenv("PMIX_NAMESPACE", "1234")
    assert references._claim(path) is True
    assert references._claim(path) is False
    monkeypatch.setenv("PMIX_NAMESPACE", "5678")  # a later mpirun
    assert references._claim(path) is True
