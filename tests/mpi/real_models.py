"""Train each case (tests/support/zoo.py's models) with hf.fit and with plain Keras; report diffs.

Arguments: cases as JSON (tests/support/cases.py), the optimizer as zoo.optimizer names it
("adam+globalclip"). The Keras reference is trained once and read by every rank
(tests/support/references.py); each rank compares its own copy of the trained model, which
holds the full weights.
"""

import keras
import tensorflow as tf

import hyparflow as hf
from hyparflow.auto.tensor_traffic import tensor_shares
from hyparflow.partitioner import profile
from hyparflow.partitioner.graph import build_graph
from hyparflow.tensor import tensor_layout
from tests.support import references, zoo
from tests.support.cases import Case
from tests.support.compare import history_difference, most_traces, relative_difference
from tests.support.fits import fit_in_order
from tests.support.report import args, report

# one model per way a layer splits: Dense pairs, convolutions, attention, a table, a tied
# vocabulary (GPT-2), a gated feed-forward (Llama), keras_hub's BERT blocks
TRAFFIC_CHECKED = {"wide_mlp", "conv_pairs", "encoder", "embedding_mlp", "gpt2", "llama", "bert"}


def run(case: Case) -> dict:
    name, optimizer = case.model, case.optimizer
    x, y, batch_size, epochs = zoo.training_data(name, case.one_step)
    reference = references.zoo_fit(name, optimizer, case.policy, case.one_step)
    model = zoo.compiled(name, optimizer, case.policy)
    strategy = hf.Strategy(**case.strategy_options())
    history = fit_in_order(model, x, y, batch_size, epochs, strategy)
    trainer = model._hyparflow_trainer[1]  # a new model's: its traffic is this fit's alone
    moved, exchanged = trainer.traffic.of("tensor"), trainer.traffic.of("experts")
    runner = trainer.parts.runner
    shards = trainer.sharded_layers.tensor
    return {
        "case": case.id,
        # most traces of one compiled step function (Keras's own: 2 for varying lengths)
        "traces": most_traces(runner),
        "split_backward": getattr(runner, "split", None),
        "refusals": getattr(runner, "refusals", None),
        "sparse_blocks": len(
            trainer.sharded_layers.dispatch.blocks
        ),  # mixtures dispatched sparsely
        "weights": relative_difference(model.get_weights(), reference["weights"]),
        "history": history_difference(history.history, reference["history"]),
        "grid_nodes": trainer.topology.nodes,  # host of each grid place
        "keys": sorted(history.history),
        "ref_keys": sorted(reference["history"]),
        # tensor parallelism: the layers split on this rank, and their shards' and the optimizer
        # slots' elements (to compare with the whole model's)
        "split": [s.layer.name for s in shards.layout.splits] if shards else [],
        "dropouts": [d.name for d, _ in shards.layout.dropouts] if shards else [],
        **(_slice_sizes(model, shards) if shards else {}),
        # expert parallelism: this rank's expert shards and their optimizer slots, and the
        # bytes its routing sums and token exchanges moved
        **(
            _slice_sizes(model, trainer.sharded_layers.experts, "expert_")
            if trainer.sharded_layers.experts
            else {}
        ),
        "expert_bytes": exchanged.bytes,
        # bytes the tensor ranks' collectives moved, and what the planner's shares predict
        "tensor_bytes": moved.bytes,
        "predicted_tensor_bytes": _predicted_bytes(model, case, x, batch_size, epochs),
    }


def _predicted_bytes(model, case: Case, x, batch_size, epochs) -> float | None:
    """Bytes one rank's tensor collectives move in `epochs` by `auto.tensor_traffic`'s shares
    (per sample, at each batch's shape); None for a pipeline (its stages split) and for the
    models `TRAFFIC_CHECKED` leaves out (the walk costs seconds of eager keras_hub calls)."""
    if case.tensor == 1 or case.partitions > 1 or case.model not in TRAFFIC_CHECKED:
        return None
    graph = build_graph(model)
    layout = tensor_layout(model, case.tensor)
    if isinstance(x, tf.data.Dataset):
        batches = [inputs for inputs, _ in x]
    else:
        batches = [x[i : i + batch_size] for i in range(0, len(x), batch_size)]
    total = 0.0
    for inputs in batches:
        sample = profile.make_sample(graph, sample=inputs)
        rows = int(sample[0].shape[0])
        shares = tensor_shares(graph, layout, sample)
        total += rows * sum(s.forward_bytes + s.backward_bytes for s in shares)
    return total * epochs / case.replicas


def _slice_sizes(model, shards, prefix: str = "") -> dict:
    """Elements of this rank's shards, of the whole variables they split, and of the optimizer
    slots built for the shards (Keras names a slot after its variable's path)."""
    names = [s.shard.path.replace("/", "_") for s in shards.shards]
    slots = [v for v in model.optimizer.variables if any(n in v.path for n in names)]
    return {
        f"{prefix}shard_elements": sum(int(v.numpy().size) for v in shards.variables),
        f"{prefix}whole_elements": sum(int(s.whole.numpy().size) for s in shards.shards),
        f"{prefix}shard_slot_elements": sum(int(v.numpy().size) for v in slots),
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    cases = [Case.from_json(c) for c in args()]
    references.prefetch(
        [references.zoo_request(c.model, c.optimizer, c.policy, c.one_step) for c in cases]
    )
    report({"rank": hf.rank(), "results": [run(c) for c in cases]})
