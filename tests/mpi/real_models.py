"""Train each case (tests/support/zoo.py's models) with hf.fit and with plain Keras; report diffs.

Arguments: cases as JSON (tests/support/cases.py), the optimizer as zoo.optimizer names it
("adam+globalclip"). The Keras reference is trained once and read by every rank
(tests/support/references.py); each rank compares its own copy of the trained model, which
holds the full weights.
"""

import keras

import hyparflow as hf
from tests.support import references, zoo
from tests.support.cases import Case
from tests.support.compare import history_difference, most_traces, relative_difference
from tests.support.report import args, report


def run(case: Case) -> dict:
    name, optimizer = case.model, case.optimizer
    x, y, batch_size, epochs = zoo.training_data(name, case.one_step)
    reference = references.zoo_fit(name, optimizer, case.policy, case.one_step)
    model = zoo.compiled(name, optimizer, case.policy)
    strategy = hf.Strategy(**case.strategy_options())
    history = hf.fit(
        model, x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
        strategy=strategy,
    )  # fmt: skip
    trainer = model._hyparflow_trainer[1]
    runner = trainer.runner
    shards = trainer.shards
    return {
        "case": case.id,
        # most traces of one compiled step function (Keras's own: 2 for varying lengths)
        "traces": most_traces(runner),
        "split_backward": getattr(runner, "split", None),
        "refusals": getattr(runner, "refusals", None),
        "weights": relative_difference(model.get_weights(), reference["weights"]),
        "history": history_difference(history.history, reference["history"]),
        "grid_nodes": trainer.topology.nodes,  # host of each grid place
        "keys": sorted(history.history),
        "ref_keys": sorted(reference["history"]),
        # tensor parallelism: the layers split on this rank, and their shards' and the optimizer
        # slots' elements (to compare with the whole model's)
        "split": [s.layer.name for s in shards.layout.splits] if shards else [],
        "dropouts": [d.name for d, _ in shards.layout.dropouts] if shards else [],
        **(_shard_sizes(model, shards) if shards else {}),
    }


def _shard_sizes(model, shards) -> dict:
    """Elements of this rank's shards, of the whole variables they split, and of the optimizer
    slots built for the shards (Keras names a slot after its variable's path)."""
    names = [s.shard.path.replace("/", "_") for s in shards.shards]
    slots = [v for v in model.optimizer.variables if any(n in v.path for n in names)]
    return {
        "shard_elements": sum(int(v.numpy().size) for v in shards.variables),
        "whole_elements": sum(int(s.whole.numpy().size) for s in shards.shards),
        "shard_slot_elements": sum(int(v.numpy().size) for v in slots),
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    cases = [Case.from_json(c) for c in args()]
    references.prefetch(
        [references.zoo_request(c.model, c.optimizer, c.policy, c.one_step) for c in cases]
    )
    report({"rank": hf.rank(), "results": [run(c) for c in cases]})
