"""Mixture of experts: sparse dispatch and expert parallelism against keras_hub's dense experts.

Run: .venv/bin/python benchmarks/moe_dispatch.py [--repeats 5] [--steps 4] (starts mpirun)

keras_hub's Mixtral (2 layers, hidden 128, 8 experts of width 256, top-2, router loss on at
0.02, 4 query and 2 key-value heads, vocabulary 512), 64 tokens, a global batch of 16, Adam.
Step time of hf.fit on 2 ranks with `Strategy("data", experts=2)` (each rank holds 4 of the 8
experts; tokens travel to their expert's rank and back), `Strategy("data")` (each token through
its 2 experts, every rank all 8 experts, hyparflow/moe), `sparse_experts=False` (every expert on
every token, as keras_hub computes), and `model.fit` on rank 0 alone, dense (Keras's) and sparse
(inside `moe.in_keras.sparse_in_keras`, as `hf.fit` runs it in one process); epochs interleaved. The
experts' FLOPs fall 4x; expert parallelism adds two all-to-alls a block and halves the
experts' gradient allreduce. Also expert parallelism with `capacity_factor=1.0` (each expert
computes at most its even share of a rank's picks, the rest dropped: not Keras's model), whose
gain depends on how uneven the routing is (this model's is near even at initialisation).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "moe"
TITLE = "Mixture of experts: expert parallelism and sparse dispatch against dense experts, 2 ranks"
SIZE = dict(hidden=128, width=256, experts=8, vocabulary=512, tokens=64, batch=16)
QUICK = dict(hidden=16, width=16, experts=4, vocabulary=64, tokens=8, batch=8)
SETUPS = (
    "experts split over 2 ranks (sparse)",
    "sparse, data parallel",
    "dense, data parallel",
    "one rank (Keras, dense)",
    "experts split over 2 ranks, capacity factor 1.0",
    "one rank (hf.fit's sparse dispatch)",
)


def _model(size: dict):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=size["vocabulary"],
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=size["hidden"],
        intermediate_dim=size["width"],
        num_experts=size["experts"],
        top_k=2,
    )
    model = keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss)
    return model


def worker(args) -> None:
    import numpy as np

    import hyparflow as hf
    from benchmarks.harness.timing import interleaved_epochs
    from hyparflow.moe.in_keras import sparse_in_keras

    size = QUICK if args.quick else SIZE
    tokens = (
        np.random.default_rng(1)
        .integers(0, size["vocabulary"], size=(size["batch"] * args.steps, size["tokens"] + 1))
        .astype("int32")
    )
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, 1:])}
    strategies = [
        hf.Strategy("data", experts=2, tune_process=True),
        hf.Strategy("data", sparse_experts=True, tune_process=True),
        hf.Strategy("data", sparse_experts=False, tune_process=True),
        None,
        hf.Strategy("data", experts=2, capacity_factor=1.0, tune_process=True),
        None,
    ]
    setups = {name: (_model(size), s) for name, s in zip(SETUPS, strategies, strict=True)}
    setups[SETUPS[-1]] += (sparse_in_keras,)
    seconds = interleaved_epochs(
        setups, x, tokens[:, 1:], size["batch"], args.repeats, steps=args.steps
    )
    if hf.rank() == 0:
        write_result(args.worker_out, 0, {"seconds": seconds})


def run(args) -> list[dict]:
    flags = cli.flags(args, "repeats", "steps") + ["--quick"] * args.quick
    r = run_worker(__file__, flags, np=2)[0]
    ms = {k: [1e3 * s / args.steps for s in v] for k, v in r["seconds"].items()}
    split, sparse, dense, alone, capped, alone_sparse = (ms[k] for k in SETUPS)
    rows = [(f"{k}, ms per step", v, "ms") for k, v in ms.items()]
    rows += [
        (
            "dense / expert-parallel step time (samples/s ratio)",
            paired_ratios(dense, split),
            "ratio",
        ),
        ("dense / sparse step time, data parallel", paired_ratios(dense, sparse), "ratio"),
        ("sparse / expert-parallel step time", paired_ratios(sparse, split), "ratio"),
        ("speed-up over one rank (Keras), sparse", paired_ratios(alone, sparse), "ratio"),
        ("speed-up over one rank (Keras), dense", paired_ratios(alone, dense), "ratio"),
        ("expert-parallel / capacity factor 1.0 step time", paired_ratios(split, capped), "ratio"),
        ("one rank: dense / sparse step time", paired_ratios(alone, alone_sparse), "ratio"),
    ]
    return [measurement(FIGURE, what, v, unit) for what, v, unit in rows]


def arguments(argv=None):
    return cli.parser(__doc__, repeats=5, steps=4).parse_args(argv)


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
