"""Options of the gallery pipeline: per-stage Ray Data resources and the run settings that
do not change the output (batch sizes, concurrency, threads), kept apart from what does
(source, ids, columns, models: recorded in the manifest)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from raycompat.config import ConfigError

REPRESENTATIONS = ("old", "new", "adapted")
STAGES = ("render", "preprocess", "old", "new", "adapt")
ON_CORRUPT = ("fail", "skip")


@dataclass
class StageOptions:
    """Ray Data resources of one stage. ``concurrency``: parallel tasks (render,
    preprocess) or actors in the pool (old, new, adapt). ``num_gpus`` ``None``: a fraction
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
                    isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                    for k, v in self.resources.items()):
                raise ConfigError(f"--{name}-resources must be a JSON object {{name: amount >= 0}}, "
                                  f"got {self.resources!r}")
            reserved = sorted(set(self.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
            if reserved:
                raise ConfigError(f"--{name}-resources: use --{name}-cpus / --{name}-gpus for {reserved}")


def _default_stages() -> dict[str, StageOptions]:
    # Logical CPUs are fractions so that every pool and the render tasks fit together on a
    # 2-CPU machine; the real parallelism is set by concurrency and torch threads.
    return {"render": StageOptions(256, 2, 0.25), "preprocess": StageOptions(256, 2, 0.25),
            "old": StageOptions(256, 1, 0.25), "new": StageOptions(256, 1, 0.25),
            "adapt": StageOptions(1024, 1, 0.25)}


@dataclass
class PipelineOptions:
    """How a run executes. ``chunk_size``: ids per output shard (the unit of resume; part of
    the manifest). ``threads``: torch threads per model actor. ``on_corrupt``: ``fail`` stops
    at the first undecodable image (naming its id and path), ``skip`` records it in the shard
    metadata and ``_summary.json``. ``overwrite`` deletes an existing output first."""

    chunk_size: int = 4096
    on_corrupt: str = "fail"
    threads: int = 1
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
            raise ConfigError(f"--on-corrupt {self.on_corrupt!r} is not allowed; allowed: {list(ON_CORRUPT)}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if not 0 < self.gpu_fraction <= 1:
            raise ConfigError(f"--gpu-fraction must be in (0, 1], got {self.gpu_fraction}")
        unknown = set(self.stages) - set(STAGES)
        if unknown:
            raise ConfigError(f"unknown stage(s) {sorted(unknown)}; stages: {list(STAGES)}")
        for name in STAGES:
            self.stages.setdefault(name, _default_stages()[name]).check(name)


def parse_columns(value) -> tuple[str, ...]:
    """``'old,new'`` or a sequence -> ordered unique representation names."""
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    out = []
    for n in names:
        if not n:
            continue
        if n not in REPRESENTATIONS:
            raise ConfigError(f"unknown column {n!r} in --columns; allowed: {', '.join(REPRESENTATIONS)}")
        if n not in out:
            out.append(n)
    return tuple(out)


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    d = PipelineOptions()
    g = p.add_argument_group("execution (does not change the output)")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size,
                   help=f"item ids per output shard, the unit of resume (default {d.chunk_size})")
    g.add_argument("--on-corrupt", choices=ON_CORRUPT, default=d.on_corrupt,
                   help="undecodable image: fail (stop, naming id and path) or skip (record and go on)")
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per model actor (default 1)")
    g.add_argument("--gpu-fraction", type=float, default=d.gpu_fraction,
                   help="GPUs per model actor when the cluster has GPUs and no --<stage>-gpus is given")
    g.add_argument("--overwrite", action="store_true", help="delete an existing output folder first")
    g.add_argument("--progress-every", type=float, default=d.progress_every_s,
                   help="seconds between progress lines (default 10)")
    g.add_argument("--ray-progress-bars", choices=("auto", "on", "off"), default="auto",
                   help="Ray Data's own progress bars (auto: when stderr is a terminal)")
    for name, st in d.stages.items():
        g.add_argument(f"--{name}-batch-size", type=int, default=st.batch_size, help=f"default {st.batch_size}")
        g.add_argument(f"--{name}-concurrency", type=int, default=st.concurrency,
                       help=f"{'actors' if name in ('old', 'new', 'adapt') else 'parallel tasks'} "
                            f"(default {st.concurrency})")
        g.add_argument(f"--{name}-cpus", type=float, default=st.num_cpus,
                       help=f"logical CPUs per {'actor' if name in ('old', 'new', 'adapt') else 'task'} "
                            f"(default {st.num_cpus})")
        if name in ("old", "new", "adapt"):
            g.add_argument(f"--{name}-gpus", type=float, default=None,
                           help="GPUs per actor (default: --gpu-fraction when GPUs are present)")
        g.add_argument(f"--{name}-resources", type=_json_resources, default=None, metavar="JSON",
                       help="custom Ray resources per " + ("actor" if name in ("old", "new", "adapt") else "task")
                            + ", e.g. '{\"gpu_node\": 0.01}': runs the stage only on nodes that have them")


def _json_resources(value: str) -> dict:
    import json

    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object {name: amount}")
    return parsed


def pipeline_options_from_args(args) -> PipelineOptions:
    stages = {}
    for name in STAGES:
        key = name.replace("-", "_")
        stages[name] = StageOptions(getattr(args, f"{key}_batch_size"), getattr(args, f"{key}_concurrency"),
                                    getattr(args, f"{key}_cpus"), getattr(args, f"{key}_gpus", None),
                                    getattr(args, f"{key}_resources", None))
    bars = {"auto": None, "on": True, "off": False}[args.ray_progress_bars]
    opts = PipelineOptions(chunk_size=args.chunk_size, on_corrupt=args.on_corrupt, threads=args.threads,
                           gpu_fraction=args.gpu_fraction, overwrite=args.overwrite,
                           progress_every_s=args.progress_every, ray_progress_bars=bars, stages=stages)
    opts.check()
    return opts


def replace_stage(opts: PipelineOptions, name: str, **changes) -> PipelineOptions:
    """A copy of ``opts`` with one stage's options changed (for benchmarks and tests)."""
    stages = dict(opts.stages)
    stages[name] = dataclasses.replace(stages[name], **changes)
    return dataclasses.replace(opts, stages=stages)
