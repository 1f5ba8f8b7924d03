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
