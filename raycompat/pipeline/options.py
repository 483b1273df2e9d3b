"""Options of the gallery pipeline: per-stage Ray Data resources and the run settings that
do not change the output (batch sizes, concurrency, threads), kept apart from what does
(source, ids, columns, models: recorded in the manifest). Bit for bit, the model stages' batch
sizes (their fixed sub-batches of ids) and ``threads`` set the float rounding; with them equal
the output is bit-identical however Ray Data batches (``raycompat.pipeline.stages``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    nonnegative,
    option,
    options_from_args,
    positive,
)

REPRESENTATIONS = ("old", "new", "adapted")
STAGES = ("render", "preprocess", "old", "new", "adapt")
ON_CORRUPT = ("fail", "skip")
#: how the model stages (old, new, adapt) run: docs/simulator.md, "Actors or tasks"
MODEL_STAGES = ("actors", "tasks")


@dataclass
class StageOptions:
    """Ray Data resources of one stage. ``concurrency``: parallel tasks (render,
    preprocess) or actors in the pool (old, new, adapt; parallel tasks with
    ``PipelineOptions.model_stages`` ``tasks``). ``num_gpus`` ``None``: a fraction
    (``PipelineOptions.gpu_fraction``) when the cluster has GPUs, else none. ``resources``:
    custom Ray resources per task / actor (``{"gpu_node": 0.1}``) to pin a stage to the nodes
    that have them."""

    batch_size: int = 256
    concurrency: int = 1
    num_cpus: float = 0.25
    num_gpus: float | None = None
    resources: dict[str, float] | None = None

    def check(self, name: str) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--{name}-batch-size must be >= 1, got {self.batch_size}")
        if self.concurrency < 1:
            raise ConfigError(f"--{name}-concurrency must be >= 1, got {self.concurrency}")
        if self.num_cpus < 0:
            raise ConfigError(f"--{name}-cpus must be >= 0, got {self.num_cpus}")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ConfigError(f"--{name}-gpus must be >= 0, got {self.num_gpus}")
        if self.resources is not None:
            if not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and k and _is_amount(v) for k, v in self.resources.items()
            ):
                raise ConfigError(
                    f"--{name}-resources must be a JSON object {{name: amount >= 0}}, "
                    f"got {self.resources!r}"
                )
            reserved = sorted(set(self.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
            if reserved:
                raise ConfigError(
                    f"--{name}-resources: use --{name}-cpus / --{name}-gpus for {reserved}"
                )


def _is_amount(value) -> bool:
    """A number >= 0 (not a bool): one custom Ray resource's amount."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _default_stages() -> dict[str, StageOptions]:
    # Logical CPUs are fractions so that every pool and the render tasks fit together on a
    # 2-CPU machine; the real parallelism is set by concurrency and torch threads.
    return {
        "render": StageOptions(256, 2, 0.25),
        "preprocess": StageOptions(256, 2, 0.25),
        "old": StageOptions(256, 1, 0.25),
        "new": StageOptions(256, 1, 0.25),
        "adapt": StageOptions(1024, 1, 0.25),
    }


@dataclass
class PipelineOptions:
    """How a run executes. ``chunk_size``: ids per output shard (the unit of resume; part of
    the manifest). ``threads``: torch threads per model actor. ``on_corrupt``: ``fail`` stops
    at the first undecodable image (naming its id and path), ``skip`` records it in the shard
    metadata and ``_summary.json``. ``overwrite`` deletes an existing output first.
    ``model_stages``: ``actors`` (a pool per model stage, each actor loads its model once) or
    ``tasks`` (Ray tasks; each worker process keeps its recent models): docs/simulator.md,
    "Actors or tasks"."""

    chunk_size: int = 4096
    on_corrupt: str = "fail"
    threads: int = 1
    model_stages: str = "actors"
    gpu_fraction: float = 0.5
    overwrite: bool = False
    progress_every_s: float = 10.0
    ray_progress_bars: bool | None = None
    memory_interval_s: float = 1.0
    stages: dict[str, StageOptions] = field(default_factory=_default_stages)

    def check(self) -> None:
        if self.chunk_size < 1:
            raise ConfigError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.on_corrupt not in ON_CORRUPT:
            raise ConfigError(
                f"--on-corrupt {self.on_corrupt!r} is not allowed; allowed: {list(ON_CORRUPT)}"
            )
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.model_stages not in MODEL_STAGES:
            raise ConfigError(
                f"--model-stages {self.model_stages!r} is not allowed; "
                f"allowed: {list(MODEL_STAGES)}"
            )
        if not 0 < self.gpu_fraction <= 1:
            raise ConfigError(f"--gpu-fraction must be in (0, 1], got {self.gpu_fraction}")
        unknown = set(self.stages) - set(STAGES)
        if unknown:
            raise ConfigError(f"unknown stage(s) {sorted(unknown)}; stages: {list(STAGES)}")
        for name in STAGES:
            self.stages.setdefault(name, _default_stages()[name]).check(name)


_DEFAULTS = PipelineOptions()


def parse_columns(value) -> tuple[str, ...]:
    """``'old,new'`` or a sequence -> ordered unique representation names."""
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    out = []
    for n in names:
        if not n:
            continue
        if n not in REPRESENTATIONS:
            raise ConfigError(
                f"unknown column {n!r} in --columns; allowed: {', '.join(REPRESENTATIONS)}"
            )
        if n not in out:
            out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class ExecutionOptions:
    """The command line's run settings (``--chunk-size`` ...): :func:`pipeline_options` turns
    them and the :data:`StageFlags` into :class:`PipelineOptions`."""

    chunk_size: int = positive(
        _DEFAULTS.chunk_size, help="item ids per output shard, the unit of resume"
    )
    on_corrupt: str = choices(
        *ON_CORRUPT,
        default=_DEFAULTS.on_corrupt,
        help="undecodable image: fail (stop, naming id and path) or skip (record, go on)",
    )
    threads: int = positive(_DEFAULTS.threads, help="torch threads per model actor or task")
    model_stages: str = choices(
        *MODEL_STAGES,
        default=_DEFAULTS.model_stages,
        help="old, new, adapt as actor pools (a model per actor: GPUs, big galleries) or Ray "
        "tasks (models cached per worker: small CPU runs); same output",
    )
    gpu_fraction: float = positive(
        _DEFAULTS.gpu_fraction,
        help="GPUs per model actor (at most 1) when the cluster has GPUs and no "
        "--<stage>-gpus is given",
    )
    overwrite: bool = option(_DEFAULTS.overwrite, help="delete an existing output folder first")
    progress_every_s: float = option(
        _DEFAULTS.progress_every_s, flag="--progress-every", help="seconds between progress lines"
    )
    ray_progress_bars: str = choices(
        "auto",
        "on",
        "off",
        default="auto",
        help="Ray Data's own progress bars (auto: when stderr is a terminal)",
    )


def _stage_fields(name: str, default: StageOptions) -> list[tuple]:
    """``<name>_batch_size``, ``_concurrency``, ``_cpus``, [``_gpus``], ``_resources``."""
    pool = name in ("old", "new", "adapt")
    unit = "actor or task" if pool else "task"
    fields = [
        (
            f"{name}_batch_size",
            int,
            positive(
                default.batch_size,
                help=f"ids per {name} forward pass, cut from each chunk's start"
                if pool
                else f"rows per {name} batch",
            ),
        ),
        (
            f"{name}_concurrency",
            int,
            positive(
                default.concurrency,
                help="actors (parallel tasks with --model-stages tasks)"
                if pool
                else "parallel tasks",
            ),
        ),
        (f"{name}_cpus", float, nonnegative(default.num_cpus, help=f"logical CPUs per {unit}")),
    ]
    if pool:
        fields.append(
            (
                f"{name}_gpus",
                float | None,
                option(
                    None,
                    min=0,
                    help="GPUs per actor or task (none: --gpu-fraction when GPUs are present)",
                ),
            )
        )
    fields.append(
        (
            f"{name}_resources",
            str | None,
            option(
                None,
                help=f"custom Ray resources per {unit} as JSON, "
                "e.g. '{\"gpu_node\": 0.01}': runs the stage "
                "only on nodes that have them",
            ),
        )
    )
    return fields


#: Per-stage Ray Data resources as flat flags (``--render-batch-size``, ``--new-gpus``,
#: ``--old-resources JSON`` ...), one group of fields per stage of :data:`STAGES`.
StageFlags = dataclasses.make_dataclass(
    "StageFlags",
    [f for name, st in _default_stages().items() for f in _stage_fields(name, st)],
    frozen=True,
    namespace={
        "__doc__": "Per-stage Ray Data resources, one flag per stage and setting.",
        "__module__": __name__,
    },
)


def _resources(name: str, text: str | None) -> dict | None:
    """``--<name>-resources`` JSON text -> dict (``StageOptions.check`` checks its values)."""
    import json

    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--{name}-resources is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"--{name}-resources must be a JSON object {{name: amount}}, got {text!r}"
        )
    return parsed


def pipeline_options(execution: ExecutionOptions, stages=None) -> PipelineOptions:
    """The checked :class:`PipelineOptions` of the command line's settings (``stages``: a
    :data:`StageFlags`, default every stage's default)."""
    stages = stages if stages is not None else StageFlags()
    per_stage = {
        name: StageOptions(
            getattr(stages, f"{name}_batch_size"),
            getattr(stages, f"{name}_concurrency"),
            getattr(stages, f"{name}_cpus"),
            getattr(stages, f"{name}_gpus", None),
            _resources(name, getattr(stages, f"{name}_resources")),
        )
        for name in STAGES
    }
    bars = {"auto": None, "on": True, "off": False}[execution.ray_progress_bars]
    opts = PipelineOptions(
        chunk_size=execution.chunk_size,
        on_corrupt=execution.on_corrupt,
        threads=execution.threads,
        model_stages=execution.model_stages,
        gpu_fraction=execution.gpu_fraction,
        overwrite=execution.overwrite,
        progress_every_s=execution.progress_every_s,
        ray_progress_bars=bars,
        stages=per_stage,
    )
    opts.check()
    return opts


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`ExecutionOptions` and :data:`StageFlags` (for scripts that embed
    galleries without the job's other options, e.g. ``bench/embed_throughput.py``)."""
    add_options(parser, ExecutionOptions, title="execution (does not change the output)")
    add_options(parser, StageFlags, title="per-stage Ray Data resources")


def pipeline_options_from_args(args: argparse.Namespace) -> PipelineOptions:
    """:class:`PipelineOptions` from the flags :func:`add_pipeline_arguments` added."""
    return pipeline_options(
        options_from_args(ExecutionOptions, args), options_from_args(StageFlags, args)
    )


def replace_stage(opts: PipelineOptions, name: str, **changes) -> PipelineOptions:
    """A copy of ``opts`` with one stage's options changed (for benchmarks and tests)."""
    stages = dict(opts.stages)
    stages[name] = dataclasses.replace(stages[name], **changes)
    return dataclasses.replace(opts, stages=stages)
