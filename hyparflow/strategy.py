"""Strategy: which parallelism to use and how to cut the work over ranks."""

from __future__ import annotations

import dataclasses
import math

from hyparflow.spelling import Spelling
from hyparflow.units import byte_size

KINDS = ("data", "model", "hybrid", "auto")
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved")
BALANCES = ("layers", "params", "flops", "time")


def _check_positive_int(name: str, value, hint: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Strategy {name}={value!r} must be a positive integer; {hint}")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How `hf.fit` spreads training over ranks, in HyPar-Flow's terms.

    The fields, grouped by axis. Fields left as None are filled in by `resolve(world_size)`;
    contradictions between fields are refused when the Strategy is made, those with the model,
    optimizer or backend by `hf.fit` on every rank before training starts (`model_checks.py`).
    Measurements behind the defaults: docs/notes/strategy_measurements.md.

    Layout (which ranks do what; `partitions * replicas * tensor` is the MPI world size):

    - `kind` ("auto"): "data" keeps the whole model on every rank (refuses `partitions` > 1);
      "model" is one pipeline (refuses `replicas` > 1); "hybrid" is pipelines of
      `partitions` stages replicated `replicas` times and needs one of the two. "auto" with
      no `partitions`, `replicas` or `tensor` given leaves the layout to the planner, which
      `hf.fit` runs on a multi-rank job (`leaves_layout_open`; docs/auto.md): it times the
      model on rank 0, probes the network and picks the fastest layout that fits
      `memory_per_rank`, searching only the fields left at their defaults. "auto" with
      `partitions` or `replicas` given makes the remaining ranks the other factor; `resolve`
      alone (no planner) makes an open "auto" data parallel over all ranks.
    - `memory_per_rank` (None): with an open "auto", the planner's budget of bytes per rank,
      an int or a string such as "16GiB". None: the cgroup's memory limit shared by the
      ranks of a node, or no budget where there is none.
    - `partitions` (None): pipeline stages the model is cut into (`hf.fit`'s
      `num_partitions`). None: derived from the world size and `kind`.
    - `replicas` (None): copies of each stage that split every global batch between them and
      sum their gradients (`num_replicas`). None: derived from the world size and `kind`.
    - `tensor` (1): T > 1 also splits single layers of every stage over T neighbouring ranks,
      Megatron-LM style (docs/tensor.md); the world size must be a multiple of T. Refused
      with `comm="horovod"`, `overlap_groups` > 1 and an optimizer already built; its stages
      never update by segment. A per-variable `clipnorm` clips each shard by its whole
      variable's norm.
    - `tensor_layout` (None): with `tensor` > 1, overrides the automatic layout (Dense and
      Conv pairs, attention heads, embedding vocabularies) in Keras's `LayoutMap`
      convention: a dict from a regex over variable paths to one entry per dimension,
      "tensor" on the split one, e.g.
      `{"ffn_up.*kernel": (None, "tensor"), "ffn_down.*kernel": ("tensor", None)}`.
    - `balance` ("layers"): how the partitioner weighs layers when it cuts stages: "layers",
      "params", "flops", "time" (runs each layer to time it; refused for a model built under
      `hf.scope()`, which holds no weights), or a list of the layer names where new stages
      begin (docs/partitioner.md).

    Micro-batches and the pipeline (`schedule`, `overlap_p2p` and `recompute` act only where
    `partitions` > 1):

    - `microbatches` (1): micro-batches each replica's shard of a global batch is cut into
      (`num_microbatches`); a full batch must split evenly over `replicas * microbatches`.
      Refused above 1 with globally synchronised BatchNormalization and with a model that
      overrides its own train step.
    - `schedule` ("gpipe"): "gpipe" (all forwards, then all backwards), "1f1b" (one
      forward, one backward in the steady state) or "zero_bubble" (ZB-H1: 1F1B with each
      backward split into its input and weight halves, the weight halves run in 1F1B's
      bubbles) or "interleaved" (Megatron's interleaved 1F1B: the model is cut into
      `partitions * virtual_stages` chunks and each stage holds `virtual_stages` of them,
      which divides the bubble by `virtual_stages` for as many times the messages), as
      `schedule/` lays them out (docs/schedules.md).
    - `virtual_stages` (1): model chunks per pipeline stage, for the interleaved schedule
      only, which takes 1 as 2. Interleaved stages are refused with `tensor` > 1,
      `overlap_groups` > 1 and `update_by_segment=True`.
    - `overlap_p2p` (True): posts a step's activation receives up front, and each gradient
      receive as soon as its activation is sent, so that they arrive while the stage
      computes; False posts each receive when its action needs it.
    - `recompute` (False): a stage keeps only each micro-batch's inputs between forward and
      backward, and its backward runs the forward again (trades compute for memory). An
      unpartitioned model keeps nothing between forward and backward, so it changes nothing
      there.

    Gradients and the update:

    - `flat_gradients` (True): each rank keeps its dense float32 gradients in one flat tensor
      (one add per micro-batch, one reduction across replicas); False keeps them per
      variable, which lowers a pipeline stage's peak by about two copies of its parameter
      bytes and runs slower on stages with many variables (docs/engine.md). Where gradients
      cannot be flat (layers shared by stages, non-float32 variables, Horovod with replicas)
      they stay per variable either way (`engine/gradients/form.py`).
    - `overlap_groups` (1): G > 1 cuts each stage's backward into G segments and reduces a
      segment's gradients across replicas while the earlier ones are still in backward (over
      MPI, with no layer shared across stages and no embedding table; otherwise the stage
      reduces after its backward). A pipeline stage without replicas instead updates by
      segment, in G segments. Refused with `tensor` > 1 and with `shard_optimizer` on more
      than one replica.
    - `update_by_segment` (None): True cuts each stage's backward into segments of about
      16 MiB of gradients (at least 2) and runs a segment's update, its gradients first summed
      over the replicas, as soon as the step's last backward has finished it, so no rank holds
      all of its gradients at once, as Keras's own train step never does. It costs speed: the
      data-parallel step is no longer one fused call and the updates sit on the pipeline's
      critical path. None: on for models built under `hf.scope()`, off otherwise
      (docs/memory.md). The stage updates after its backward instead with loss scaling, EMA,
      gradient accumulation, `global_clipnorm` or `check_numerics`, and is not cut with
      tensor shards, layers shared by stages, embedding tables, or, with replicas, Horovod
      or non-float32 variables.
    - `shard_optimizer` (False): ZeRO-1 (docs/zero.md): each of a stage's replicas keeps and
      updates 1/replicas of the stage's optimizer state; gradients are reduce-scattered and
      the updated parameters all-gathered, the same bytes as an allreduce, and training is
      exactly the unsharded one. With replicas it needs MPI, `overlap_groups=1`, a fresh
      optimizer and an elementwise one (SGD, Adam, AdamW, RMSprop, ...) without `clipnorm`,
      EMA, gradient accumulation or `exclude_from_weight_decay`. With one replica there is
      nothing to shard: it is accepted and training is the usual one.
    - `shard_gradients` (False): ZeRO-2 (docs/zero.md), implying `shard_optimizer`: besides
      the optimizer state, each replica keeps only its 1/replicas slice of the stage's
      gradients. The stage's backward is cut into segments (as `update_by_segment`), and
      every micro-batch's backward reduce-scatters each segment's gradients as soon as it
      has made them, so a rank holds one segment's gradients besides its slices; loss
      scaling and global clipping then step the slices after the backward, other steps
      segment by segment; embedding tables stay whole (their row slices gathered after the
      backward). Where the stage cannot be cut (subclassed models, tensor or expert shards,
      layers shared by stages) or with `check_numerics`, it trains as `shard_optimizer` does
      (rank 0 says so once). Under a custom `train_step` (or `compute_loss`) each optimizer
      it applies (the compiled one, those held as attributes: a GAN's two) steps this
      replica's slice of the variables it is applied to, from the whole gradients the step's
      tape makes (docs/zero.md, "A model's own step").
      Refused with `update_by_segment=False`. With one replica it changes nothing.
    - `shard_weights` (False): ZeRO-3, what other frameworks call FSDP (docs/zero.md),
      implying `shard_gradients`: each replica also keeps only its 1/replicas slice of the
      stage's weights, which are the truth between steps. Each segment's weights are
      all-gathered before its forward and again before its backward (which recomputes the
      forward), and let go after; gradients are reduce-scattered into the owners' slices as
      under `shard_gradients`; embedding tables stay whole. A subclassed model (no layer
      graph to cut) gathers each of its layers' weights around that layer's call, inside the
      step, and recomputes the call in its backward; a stage with tensor shards is one
      segment, gathered whole for each call. While
      hf.fit trains, the model's sharded variables hold no value (reading one raises
      `NotHeldError`); each epoch's end (and a checkpoint's save) gives them back, so
      callbacks, checkpoints and the model after the fit see the whole weights. A model
      built under `hf.scope()` allocates only its slices, and keeps them after the fit (read
      its weights through a checkpoint and `hf.export`). A custom `train_step` gets the
      whole weights gathered into the variables for each step, and let go after it; each
      optimizer it applies steps its own slices, as under `shard_gradients`. Refused: weight
      regularizers, expert parallelism, the zero-bubble and interleaved schedules with a
      pipeline. With one replica it changes nothing.
    - `sync_batchnorm` (False): True makes every BatchNormalization layer normalise by the
      statistics of the whole global batch, summed across replicas, as Keras's own
      `BatchNormalization(synchronized=True)` layers always are (then exactly Keras's
      training); by default each replica (and micro-batch) normalises its share alone
      (docs/models.md). Refused with `microbatches` > 1.
    - `sparse_experts` (True): keras_hub's mixture-of-experts blocks (Mixtral, Qwen3-MoE, gpt-oss)
      compute each token through its top-k experts only, instead of every expert on every
      token multiplied by zero (docs/moe.md): the same sums to float rounding, for a k/E
      share of the experts' compute; and their router's load-balancing loss is that of the
      whole global batch across replicas (refused with `microbatches` > 1). False keeps
      keras_hub's dense calls, each piece's loss its own.
    - `strict_added_losses` (False): True turns the warning about losses layers add with
      `add_loss` while the batch runs in pieces (replicas x micro-batches; each piece's value is
      weighted by its share, exact for batch means only) into an error, agreed on every rank
      after the first step, when the layers that add them are known. keras_hub mixture blocks'
      router losses (exact, `sparse_experts`) and activity regularizers are not among them.
    - `experts` (1): E > 1 splits each keras_hub mixture block's experts over E of a stage's
      replicas (expert parallelism, GShard / DeepSpeed-MoE style; docs/moe.md): a rank holds
      and updates 1/E of the experts, and tokens travel to their experts' rank and back by
      all-to-all, no token dropped, so training stays exact. E must divide `replicas` and each
      block's number of experts; with `tensor` > 1 each tensor rank's replicas form their own
      groups (the mixture blocks stay whole on tensor ranks). It needs `sparse_experts`, and is
      refused with Horovod, `overlap_groups` > 1, and regularizers or constraints on expert
      weights that are not elementwise (`clipnorm` clips each shard by its whole kernel's
      norm). With `shard_optimizer`, ZeRO-1 slices the other
      variables' optimizer state over the replicas; expert shards keep theirs whole.
    - `capacity_factor` (None): each mixture expert computes at most `ceil(factor * T * k / E)`
      of a piece's T tokens' k picks (first choices first, earlier tokens first; GShard's
      capacity), the others dropped: faster where routing is uneven, but **not** Keras's model
      (rank 0 says so when training starts). None: no limit, every pick computed (exact).

    Process (opt-ins that change process-wide state):

    - `tune_process` (False): on a multi-rank job, tunes each rank's process for ranks sharing
      a node: glibc keeps large temporaries in its heap, MPI's large buffers get huge pages,
      and, when a node has more ranks than cores and the launcher bound none, each rank's
      threads are pinned to one core (`hyparflow.process_tuning`). Off: hf.fit changes no
      process-wide state, and binding is the launcher's job (`mpirun --bind-to core`).
    - `bind_gpus` (False): where ranks see GPUs, each keeps one GPU of its node, chosen by its
      node-local rank, with memory growth on (docs/gpu.md). It changes TensorFlow's visible
      devices for the whole process, nothing on machines without GPUs, and takes effect only
      before TensorFlow has initialised its GPUs, so the opt-in that works is calling
      `hf.bind_gpus()` before building the model.

    Example:
        >>> strategy = Strategy("hybrid", partitions=2, microbatches=4, schedule="1f1b")
        >>> strategy.resolve(8).replicas  # on 8 ranks: 2 stages, each on 4 replicas
        4
    """

    kind: str = "auto"
    partitions: int | None = None
    replicas: int | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    virtual_stages: int = 1
    balance: str | list = "layers"
    recompute: bool = False
    overlap_p2p: bool = True
    overlap_groups: int = 1
    flat_gradients: bool = True
    sync_batchnorm: bool = False
    tune_process: bool = False
    tensor: int = 1
    tensor_layout: dict | None = None
    shard_optimizer: bool = False
    shard_gradients: bool = False
    shard_weights: bool = False
    bind_gpus: bool = False
    update_by_segment: bool | None = None
    memory_per_rank: int | str | None = None
    sparse_experts: bool = True
    experts: int = 1
    strict_added_losses: bool = False
    capacity_factor: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"Unknown strategy kind {self.kind!r}; use one of {', '.join(map(repr, KINDS))}."
            )
        hint = "pass e.g. 1, 2 or 4."
        _check_positive_int("partitions", self.partitions, hint)
        _check_positive_int("replicas", self.replicas, hint)
        _check_positive_int("microbatches", self.microbatches, hint)
        _check_positive_int("overlap_groups", self.overlap_groups, hint)
        _check_positive_int("tensor", self.tensor, hint)
        _check_positive_int("experts", self.experts, hint)
        if self.tensor is None:
            raise ValueError("Strategy tensor=None: pass the number of ranks that split a layer.")
        if self.tensor_layout is not None and not isinstance(self.tensor_layout, dict):
            raise ValueError(
                f"Strategy tensor_layout must be a dict from a regex over variable paths to a "
                f"tuple of axes, got {type(self.tensor_layout).__name__}."
            )
        for name in (
            "shard_optimizer",
            "shard_gradients",
            "shard_weights",
            "bind_gpus",
            "sparse_experts",
            "strict_added_losses",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Strategy {name}={getattr(self, name)!r} must be True or False.")
        if self.update_by_segment not in (None, True, False):
            raise ValueError(
                f"Strategy update_by_segment={self.update_by_segment!r} must be True, False or "
                "None (on for models built under hf.scope())."
            )
        self._check_sharding()
        if isinstance(self.memory_per_rank, str):  # frozen: set once, as bytes
            object.__setattr__(self, "memory_per_rank", byte_size(self.memory_per_rank))
        _check_positive_int("memory_per_rank", self.memory_per_rank, 'pass bytes or "16GiB".')
        self._check_schedule()
        self._check_experts()
        self._check_capacity_factor()
        if isinstance(self.balance, str) and self.balance not in BALANCES:
            raise ValueError(
                f"Unknown balance {self.balance!r}; use one of {', '.join(map(repr, BALANCES))} "
                "or a list of layer names where new stages begin."
            )
        if self.kind == "data" and self.partitions not in (None, 1):
            raise ValueError(
                f"strategy 'data' keeps the whole model on every rank, but partitions="
                f"{self.partitions}; use strategy 'model' or 'hybrid' to split the model."
            )
        if self.kind == "model" and self.replicas not in (None, 1):
            raise ValueError(
                f"strategy 'model' is one pipeline, but replicas={self.replicas}; "
                "use strategy 'hybrid' to replicate the pipeline."
            )

    @property
    def sharding(self) -> str:
        """The sharding asked for, as the user wrote it ("" for none), for messages.

        Example:
            >>> Strategy("data", shard_gradients=True).sharding
            'shard_gradients=True'
        """
        if self.shard_weights:
            return "shard_weights=True"
        if self.shard_gradients:
            return "shard_gradients=True"
        return "shard_optimizer=True" if self.shard_optimizer else ""

    @property
    def unsharded(self) -> str:
        """The fields that turn the sharding off, for messages."""
        if self.shard_weights:
            return "shard_weights=False, shard_gradients=False and shard_optimizer=False"
        if self.shard_gradients:
            return "shard_gradients=False and shard_optimizer=False"
        return "shard_optimizer=False"

    def _check_sharding(self) -> None:
        """Each sharding implies the ones before it (frozen: set once, here)."""
        if self.shard_weights:
            object.__setattr__(self, "shard_gradients", True)
        if not self.shard_gradients:
            return
        if self.update_by_segment is False:
            raise ValueError(
                f"Strategy {self.sharding} reduce-scatters each segment of the backward as "
                "it is made, but update_by_segment=False asks for a stage that is not cut into "
                "segments; drop update_by_segment=False, or use shard_optimizer=True alone."
            )
        object.__setattr__(self, "shard_optimizer", True)

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown schedule {self.schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}."
            )
        _check_positive_int("virtual_stages", self.virtual_stages, "pass e.g. 2.")
        if self.schedule == "interleaved":
            self._check_interleaved()
        elif self.virtual_stages != 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (other "
                "schedules hold one model chunk per stage)."
            )
        if self.schedule == "zero_bubble" and self.tensor > 1:
            raise ValueError(
                "schedule='zero_bubble' does not split the backward of tensor-parallel layers "
                "yet (their weight half would repeat their collectives): use tensor=1 or "
                "schedule='1f1b'."
            )
        if self.schedule == "zero_bubble" and (self.overlap_groups > 1 or self.update_by_segment):
            raise ValueError(
                "schedule='zero_bubble' computes a stage's weight gradients after its backward, "
                "so they cannot be reduced or applied segment by segment during it: use "
                "overlap_groups=1 and update_by_segment=False (or None) with it."
            )

    def _check_capacity_factor(self) -> None:
        factor = self.capacity_factor
        if factor is None:
            return
        number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not number or not math.isfinite(factor) or factor <= 0:
            raise ValueError(
                f"Strategy capacity_factor={factor!r} must be a positive number (e.g. 1.25), "
                "or None for no capacity limit (exact)."
            )
        if not self.sparse_experts:
            raise ValueError(
                "Strategy capacity_factor needs sparse_experts=True: the dense mixture blocks "
                "compute every expert on every token."
            )

    def _check_experts(self) -> None:
        if self.experts is None:
            raise ValueError("Strategy experts=None: pass how many replicas split the experts.")
        if self.experts == 1:
            return
        refused = {
            "sparse_experts=False": not self.sparse_experts,
        }
        found = [name for name, present in refused.items() if present]
        if found:
            raise ValueError(
                f"Strategy experts={self.experts} splits the mixture blocks' experts over "
                f"replicas, which is not built with {', '.join(found)}; use experts=1 or drop "
                "that setting (docs/moe.md)."
            )
        if self.replicas is not None and self.replicas % self.experts:
            raise ValueError(
                f"Strategy experts={self.experts} must divide replicas={self.replicas}: each "
                f"group of {self.experts} replicas splits the experts; pass experts= one of "
                f"{divisors(self.replicas)}."
            )

    def _check_interleaved(self) -> None:
        if self.virtual_stages == 1:  # interleaving one chunk is 1F1B: two is the least
            object.__setattr__(self, "virtual_stages", 2)
        refused = {
            "tensor > 1": self.tensor > 1,
            "overlap_groups > 1": self.overlap_groups > 1,
            "update_by_segment=True": self.update_by_segment is True,
        }
        named = [name for name, present in refused.items() if present]
        if named:
            raise ValueError(
                f"schedule='interleaved' is not available with {', '.join(named)}: each stage "
                "runs several model chunks, which the engine neither splits over tensor ranks "
                "nor cuts into segments. Use schedule='1f1b' for those."
            )

    def leaves_layout_open(self) -> bool:
        """True for an "auto" strategy with no partitions, replicas, tensor or expert ranks given:
        the layout is the planner's to pick (`hf.fit` on more than one rank)."""
        return (
            self.kind == "auto"
            and self.partitions is None
            and self.replicas is None
            and self.tensor == 1
            and self.experts == 1
        )

    def set_fields(self) -> dict:
        """The fields given a value other than their default, by name."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != field.default
        }

    def resolve(self, world_size: int, spelling: Spelling | None = None) -> Strategy:
        """Return a copy with partitions and replicas fixed for `world_size` ranks.

        Rule for "auto": data parallel over all ranks, unless
        `partitions` is given, in which case the rest of the ranks become replicas. The
        `tensor` ranks of each stage are set aside first. Errors name the keywords and the
        launch command as the user wrote them (`spelling`; None: `hf.Strategy`'s fields and
        `mpirun -np N`).
        """
        spelling = spelling or Spelling()
        if world_size % self.tensor:
            raise ValueError(
                f"tensor={self.tensor} does not divide the world size {world_size}; launch a "
                f"multiple of {self.tensor} ranks or pass tensor= one of "
                f"{divisors(world_size)}." + auto_hint(world_size)
            )
        total, world_size = world_size, world_size // self.tensor
        partitions, replicas = self.partitions, self.replicas
        if self.kind == "data":
            partitions = 1
            replicas = world_size if replicas is None else replicas
        elif self.kind == "model":
            replicas = 1
            partitions = world_size if partitions is None else partitions
        else:  # hybrid or auto: derive the missing factor
            if partitions is None and replicas is None:
                if self.kind == "hybrid":
                    raise ValueError(
                        f"strategy 'hybrid' needs {spelling.partitions} or {spelling.replicas} "
                        f"(their product must be the world size, {world_size})."
                    )
                partitions = 1
            if partitions is None:
                partitions = _exact_quotient(
                    world_size, replicas, spelling.replicas, spelling.partitions, total
                )
            if replicas is None:
                replicas = _exact_quotient(
                    world_size, partitions, spelling.partitions, spelling.replicas, total
                )
        if partitions * replicas != world_size:
            product = partitions * replicas * self.tensor
            tensor = f" x tensor ({self.tensor})" if self.tensor > 1 else ""
            launch = spelling.launch.format(ranks=product)
            raise ValueError(
                f"partitions ({partitions}) x replicas ({replicas}){tensor} = {product} "
                f"but the job has {total} MPI ranks; launch with `{launch}` or change "
                f"{spelling.partitions}/{spelling.replicas}." + auto_hint(total)
            )
        if replicas % self.experts:
            raise ValueError(
                f"experts={self.experts} does not divide the {replicas} replicas of this "
                f"{total}-rank job; pass experts= one of {divisors(replicas)}." + auto_hint(total)
            )
        kind = self.kind
        if kind == "auto":
            kind = "data" if partitions == 1 else ("model" if replicas == 1 else "hybrid")
        return dataclasses.replace(self, kind=kind, partitions=partitions, replicas=replicas)


def auto_hint(ranks: int) -> str:
    """The fix for a fixed layout that a job's ranks no longer fit (after a restart on fewer
    nodes, say): let the planner pick one."""
    return (
        f' Or pass strategy="auto": hyparflow then picks a layout for the {ranks} ranks it has '
        "(a fixed layout may not fit the ranks a restart finds)."
    )


def divisors(n: int) -> list[int]:
    """Every count that splits `n` evenly (what a misfit tensor= or split should be)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _exact_quotient(world_size: int, divisor: int, name: str, other: str, total: int) -> int:
    if world_size % divisor:
        raise ValueError(
            f"{name}={divisor} does not divide the world size {world_size}; launch a multiple "
            f"of {divisor} ranks or pass {other} explicitly." + auto_hint(total)
        )
    return world_size // divisor


def make_strategy(strategy, num_partitions=None, num_replicas=None, num_microbatches=None):
    """Build a Strategy from `hf.fit`'s `strategy=` argument and HyPar-Flow's keyword names."""
    if isinstance(strategy, Strategy):
        overrides = {
            k: v
            for k, v in (
                ("partitions", num_partitions),
                ("replicas", num_replicas),
                ("microbatches", num_microbatches),
            )
            if v is not None
        }
        return dataclasses.replace(strategy, **overrides) if overrides else strategy
    if not isinstance(strategy, str):
        raise ValueError(
            f"strategy must be a string or hf.Strategy, got {type(strategy).__name__}; "
            "use 'data', 'model', 'hybrid' or 'auto'."
        )
    return Strategy(
        strategy,
        partitions=num_partitions,
        replicas=num_replicas,
        microbatches=1 if num_microbatches is None else num_microbatches,
    )
