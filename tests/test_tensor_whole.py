"""Tensor layouts keep whole, on every tensor rank, what T does not divide (issue 62).

The automatic rules keep a layer (an Embedding's rows, an attention's heads, a Dense pair's
units) whole when T does not divide it, with the whole group it splits with, and say why in
the layout's table; a `tensor_layout` that asks for such a split is refused. Under a real
`mpirun`, models with such layers train at T=2 as Keras trains them
(tests/mpi/tensor_whole.py).
"""

import keras
import pytest

import hyparflow as hf
from hyparflow.tensor import tensor_layout
from tests.support import whole_models, zoo
from tests.support.cases import Case
from tests.support.equivalence import assert_within, launched

TOLERANCE = 1e-5  # tests/test_tensor_parallel.py's


def _roles(layout) -> list:
    return [(s.layer.name, s.role) for s in layout.splits]


def test_vits_position_table_is_kept_whole_and_listed_in_the_table():
    model = whole_models.compiled("vit", "sgd")
    layout = tensor_layout(model, 2)
    # its attention still splits by heads, twice
    assert [role for _, role in _roles(layout)] == (["column"] * 3 + ["row"]) * 2
    assert [layer.name for layer in layout.kept_whole] == ["position_embedding"]
    assert layout.split_of(layout.kept_whole[0].embeddings) is None
    expected = (
        "position_embedding: kept whole on every tensor rank, as the 17 vocabulary rows of "
        "'position_embedding' are not a multiple of tensor=2 (tensor values that split it: "
        "[1, 17])"
    )
    assert expected in layout.replicated
    # what `hyparflow plan` prints: hf.partition's summary, each stage's layout
    assert expected in hf.partition(model, 1, tensor=2).summary(print_fn=None)


def test_a_pair_that_does_not_divide_stays_whole_together_with_one_line():
    layout = tensor_layout(whole_models.odd_mlp(), 2)
    assert _roles(layout) == [
        ("up", "column"),
        ("down", "row"),
        ("head_up", "column"),
        ("head_down", "row"),
    ]
    assert [layer.name for layer in layout.kept_whole] == ["table", "narrow", "widen"]
    assert layout.dropouts == []  # the whole pair's Dropout draws as Keras's, whole
    assert [line for line in layout.replicated if "widen" in line] == [
        "pair narrow -> widen: kept whole on every tensor rank, as the 5 units of 'narrow' are "
        "not a multiple of tensor=2 (tensor values that split it: [1, 5])"
    ]  # one line, not a second "no partner" one


def test_grouped_query_attention_that_half_divides_stays_whole_together():
    # tensor=4: Llama's 4 query heads divide, its 2 key-value heads do not; its feed-forward's
    # 32 units do. The query projection must not split alone: the whole attention stays whole.
    layout = tensor_layout(zoo.llama(), 4)
    roles = _roles(layout)
    assert not any(
        name.startswith(("query", "key", "value", "attention_output")) for name, _ in roles
    )
    assert [role for _, role in roles] == ["column", "column", "row"] * 2
    assert layout.copies == []  # nothing of the attention's copy of its input is left
    whole = [line for line in layout.replicated if "2 heads of 'key'" in line]
    assert len(whole) == 2 and all("kept whole on every tensor rank" in w for w in whole)


def test_dropout_inside_a_whole_attention_draws_as_keras_beside_split_layers():
    class Block(keras.layers.Layer):
        """One attention that splits at T=2 and one that does not, with score dropout."""

        def __init__(self):
            super().__init__()
            self.split = keras.layers.MultiHeadAttention(2, 4, name="split")
            self.whole = keras.layers.MultiHeadAttention(3, 4, dropout=0.5, name="whole")

        def call(self, x):
            return self.whole(self.split(x, x), x)

    tokens = keras.Input((3, 8))
    layout = tensor_layout(keras.Model(tokens, Block()(tokens)), 2)
    # its dropout acts on the whole attention's scores, on every rank alike: not refused
    assert [layer.name for layer in layout.kept_whole] == ["whole"]
    assert layout.dropouts == [] and len(layout.splits) == 4


def test_a_layout_map_that_splits_what_does_not_divide_is_refused():
    model = whole_models.odd_mlp()
    table = model.get_layer("table").embeddings.path
    with pytest.raises(
        ValueError,
        match=r"tensor_layout splits layer 'table', but its 41 "
        r"vocabulary rows are not a multiple of tensor=2.*\[1, 41\]\. Drop its "
        "entries",
    ):
        tensor_layout(model, 2, {table: ("tensor", None)})


# --- training under mpirun ------------------------------------------------------------------
CASES = [
    Case("odd_mlp", "adam", "data", tensor=2),
    Case("vit", "sgd", "data", tensor=2),
]
two_ranks = launched("tensor_whole", 2, CASES, timeout=600)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_layers_kept_whole_train_as_keras_does(two_ranks, case):
    ranks = two_ranks[case.id]
    worst = ", ".join(f"rank {r['rank']}: {r['worst']}" for r in ranks)
    assert_within(ranks, TOLERANCE, "weights", "history", where=f"worst weight {worst}; ")
    for r in ranks:
        assert r["split"], f"rank {r['rank']}: nothing split"
        assert any("kept whole on every tensor rank" in w for w in r["whole"]), r["whole"]


class _OwnAttention(keras.layers.MultiHeadAttention):
    """A subclass with a call of its own (XLNet's two-stream relative attention is one)."""

    def call(self, query, value, key=None, **kwargs):
        return super().call(query, value, key, **kwargs) * 2.0


def test_an_attention_subclass_with_its_own_call_is_kept_whole():
    inputs = keras.Input((4, 8))
    mixed = _OwnAttention(2, 4, name="own")(inputs, inputs)
    plain = keras.layers.MultiHeadAttention(2, 4, name="plain")(mixed, mixed)
    layout = tensor_layout(keras.Model(inputs, plain), 2)
    assert [layer.name for layer in layout.kept_whole] == ["own"]
    assert any(
        line.startswith("own: kept whole") and "call overridden" in line
        for line in layout.replicated
    )
    assert {s.layer.name for s in layout.splits} == {"query", "key", "value", "attention_output"}
