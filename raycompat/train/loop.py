"""The one training loop every method runs in (Ray Train ``train_loop_per_worker``).

Per worker: build the data shard, the new model and the method; wrap them in DDP
(gloo on CPU, NCCL on GPU, chosen by Ray Train; BatchNorm synchronized over the workers);
resume from the latest checkpoint if Ray Train restarted us; then per epoch: the method's
distributed pass, the steps, and a checkpoint with metrics. The loop knows nothing about
any particular method. With ``num_workers=0`` (Ray Train's local mode) it runs once in the
driver's process and writes its checkpoints to the run folder itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from raycompat import console, torch_distributed
from raycompat.config import ConfigError
from raycompat.methods import MethodContext, TrainBatch, TrainingModule, build_method, method_class
from raycompat.methods.base import old_split_name
from raycompat.models import ClassifierHead, Embedder, ModelBundle
from raycompat.models.heads import continued_vertices
from raycompat.storage import local_copy, open_storage
from raycompat.train.batches import ClassBalancedBatches, OldNewBatches
from raycompat.train.config import TrainConfig
from raycompat.train.data import EpochPassLoader, build_training_set
from raycompat.train.sync_batchnorm import synchronize_batchnorm

TRAIN_STATE = "train_state.pt"
HISTORY = "history.json"
BUNDLE_DIR = "model"
#: the bundle's training time (:func:`training_record`), beside its manifest: not part of its
#: fingerprint (manifest and weights), so that two identical trainings stay one model
TRAINING = "training.json"


def learning_rate(cfg: TrainConfig, epoch: int, step: int, steps_per_epoch: int) -> float:
    """Linear warm-up for ``warmup_epochs``, then cosine decay to 0 (a function of position only,
    so a resumed run follows the same schedule)."""
    position = epoch + step / max(1, steps_per_epoch)
    if position < cfg.warmup_epochs:
        return cfg.lr * (position + 1.0 / steps_per_epoch) / cfg.warmup_epochs
    span = max(1e-9, cfg.epochs - cfg.warmup_epochs)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * (position - cfg.warmup_epochs) / span))


def build_optimizer(cfg: TrainConfig, module: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(f"method {cfg.method!r} has no trainable parameter")
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.momentum > 0,
        )
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def parameter_digest(module: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in name order: equal across DDP workers iff in sync.

    Buffers (BatchNorm running stats) are left out: they are synchronized with more than one
    worker (``raycompat.train.sync_batchnorm``), but DDP also broadcasts them from rank 0 at the
    start of each forward; the parameters are what must agree."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_bundle(
    cfg: TrainConfig,
    module: TrainingModule,
    old: ModelBundle | None,
    new_classes: list[int],
    compatible_dim: int,
    epoch: int,
) -> ModelBundle:
    """The bundle of the model after ``epoch``. Its manifest records the predecessor's
    fingerprint (``predecessor.fingerprint``: sha256 of the old bundle's manifest and weights,
    checked when the two models are used together) and the scenario's (``data.fingerprint``),
    and the training config less the scenario."""
    from raycompat.models.fingerprint import bundle_fingerprint
    from raycompat.train.export import scenario_fingerprint

    embedder = module.method.deployed_embedder(module.embedder)
    modules = {"embedder": embedder, "head": module.head, **module.method.exports()}
    manifest = {
        "method": cfg.method,
        "method_options": cfg.method_options,
        "backbone": cfg.backbone,
        "embed_dim": int(getattr(embedder, "embed_dim", cfg.embed_dim)),
        "in_chans": cfg.in_chans,
        "resolution": cfg.resolution,
        "classes": [int(c) for c in new_classes],
        **_class_names(cfg.scenario, new_classes),
        "compatible_dim": int(compatible_dim),
        "predecessor": None
        if old is None
        else {
            "path": cfg.old_model,
            "fingerprint": bundle_fingerprint(cfg.old_model),
            "backbone": old.manifest.get("backbone"),
            "embed_dim": old.embed_dim,
            "method": old.manifest.get("method"),
            "generation": old.manifest.get("generation", 0),
        },
        "generation": 0 if old is None else int(old.manifest.get("generation", 0)) + 1,
        "data": {
            "scenario": cfg.scenario.get("name"),
            "seed": cfg.scenario.get("seed"),
            "split": cfg.split,
            "num_items": len(cfg.scenario["splits"][cfg.split]["labels"]),
            "fingerprint": scenario_fingerprint(cfg.scenario),
        },
        "epochs_trained": epoch + 1,
        "train_config": {k: v for k, v in cfg.to_dict().items() if k != "scenario"},
    }
    return ModelBundle(modules, manifest)


def _class_names(scenario: dict, classes: list[int]) -> dict:
    """``{"class_names": [...]}``, the class name of every head row, for a scenario of your
    images (glyph classes are named by the catalog); ``{}`` otherwise."""
    names = scenario.get("class_names")
    return {"class_names": [names[int(c)] for c in classes]} if names else {}


@dataclass
class WorkerState:
    """Everything one worker trains with, built by :func:`setup_worker`."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    worker_nodes: list[str]  # Ray node id of every rank, in rank order
    trains_embedder: bool
    old: ModelBundle | None
    new_classes: list[int]
    compatible_dim: int
    new_target: torch.Tensor  # class id -> row of the new head (-1: none)
    old_target: torch.Tensor  # class id -> row of the old head (-1: none)
    module: TrainingModule
    ddp_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: DistributedSampler | ClassBalancedBatches | OldNewBatches
    loader: DataLoader

    @property
    def steps_per_epoch(self) -> int:
        return len(self.loader)


@dataclass(frozen=True)
class EpochTotals:
    """One epoch of one worker: summed loss terms, seconds inside the steps, wall seconds,
    and the learning rate of the last step."""

    sums: dict[str, float]
    step_time: float
    wall: float
    lr: float


def class_targets(
    new_classes: list[int], old_classes: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lookup tables class id -> row of the new head and of the old head (-1 where absent)."""
    new_target = torch.full((max(new_classes) + 1,), -1, dtype=torch.long)
    new_target[torch.tensor(new_classes)] = torch.arange(len(new_classes))
    old_target = torch.full_like(new_target, -1)
    known = [c for c in old_classes if c < len(old_target)]
    if known:
        rows = {c: i for i, c in enumerate(old_classes)}
        old_target[torch.tensor(known)] = torch.tensor([rows[c] for c in known])
    return new_target, old_target


def _seed_and_threads(cfg: TrainConfig, local_world_size: int) -> None:
    """Intra-op threads (this node's cores shared by its workers), then the seeds."""
    threads = cfg.threads_per_worker or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)


def _write_pid(cfg: TrainConfig, rank: int) -> None:
    """Diagnostics (tests): this worker's pid in ``diagnostics_dir/pid_rank<r>.txt``."""
    if cfg.diagnostics_dir:
        os.makedirs(cfg.diagnostics_dir, exist_ok=True)
        with open(os.path.join(cfg.diagnostics_dir, f"pid_rank{rank}.txt"), "w") as f:
            f.write(str(os.getpid()))


def _build_networks(
    cfg: TrainConfig, new_classes: list[int], old: ModelBundle | None
) -> tuple[Embedder, ClassifierHead]:
    """The new embedder and head, started from ``init_model`` when one is given. A ``dsimplex``
    head keeps the simplex labels of the classes an old ``dsimplex`` head knows."""
    embedder = Embedder(
        cfg.backbone, cfg.embed_dim, in_chans=cfg.in_chans, pretrained_path=cfg.pretrained_path
    )
    vertices = None
    if cfg.head == "dsimplex":
        old_head = old.modules.get("head") if old is not None else None
        known = getattr(old_head, "vertices", None)
        vertices = continued_vertices(new_classes, old.classes if known else [], known)
    head = ClassifierHead(
        cfg.embed_dim,
        len(new_classes),
        kind=cfg.head,
        scale=cfg.head_scale,
        margin=cfg.head_margin,
        vertices=vertices,
    )
    if cfg.init_model:
        init = ModelBundle.load(cfg.init_model)
        embedder.load_state_dict(init.embedder.state_dict())
        if init.classes == new_classes:
            head.load_state_dict(init.head.state_dict())
    return embedder, head


def _build_loader(
    cfg: TrainConfig, train_set, rank: int, world: int, old_classes=()
) -> tuple[DistributedSampler | ClassBalancedBatches | OldNewBatches, DataLoader]:
    """This worker's shard of the training set, ``batch_size / world`` items per step: uniformly
    random batches, P x K class-balanced ones (``TrainConfig.class_batch_size``) or batches
    balanced between ``old_classes`` and the others (``TrainConfig.old_batch_fraction``)."""
    common = dict(num_workers=cfg.loader_workers, persistent_workers=cfg.loader_workers > 0)
    k, share = cfg.class_batch_size(), cfg.old_batch_fraction()
    if k or share:
        where = dict(rank=rank, world=world, seed=cfg.seed)
        batches = (
            ClassBalancedBatches(train_set.labels, cfg.batch_size, k, **where)
            if k
            else OldNewBatches(train_set.labels, cfg.batch_size, old_classes, share, **where)
        )
        return batches, DataLoader(train_set, batch_sampler=batches, **common)
    sampler = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    loader = DataLoader(
        train_set, batch_size=cfg.batch_size // world, sampler=sampler, drop_last=True, **common
    )
    return sampler, loader


def _old_split_pass_loader(cfg: TrainConfig, old, new_target, old_target, world, device):
    """An :class:`EpochPassLoader` over the old model's training split (two views; classes the
    new head lacks get target -1), or None (:func:`old_split_name`)."""
    import dataclasses

    split = old_split_name(cfg.scenario, old.manifest if old is not None else None)
    if split is None:
        return None
    data = build_training_set(dataclasses.replace(cfg, split=split), views=2)
    size = max(len(new_target), max(data.classes) + 1)
    padded = [torch.full((size,), -1, dtype=torch.long) for _ in range(2)]
    for table, known in zip(padded, (new_target, old_target), strict=True):
        table[: len(known)] = known
    return EpochPassLoader(data, cfg.batch_size // world, padded[0], padded[1], device)


def setup_worker(cfg: TrainConfig) -> WorkerState:
    """Threads and seeds, the frozen old model, the data shard, the new networks and the
    method (in DDP), and the optimizer: everything but the checkpoint to resume from."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    _seed_and_threads(cfg, context.get_local_world_size())
    device = ray.train.torch.get_device()
    # where every rank runs (Ray node ids, in rank order): recorded in each epoch's metrics
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    worker_nodes = torch_distributed.all_gather_strings(node)
    _write_pid(cfg, rank)
    method_cls = method_class(cfg.method)
    old = ModelBundle.load(cfg.old_model, device).freeze() if cfg.old_model else None
    train_set = build_training_set(cfg, views=2 if old is not None else 1)
    new_classes = train_set.classes
    if old is not None and old.embed_dim > cfg.embed_dim:
        raise ConfigError(
            f"embed_dim {cfg.embed_dim} is smaller than the old model's "
            f"{old.embed_dim}: the compatible subspace needs D_new >= D_old"
        )
    compatible_dim = old.embed_dim if old is not None else cfg.embed_dim
    embedder, head = _build_networks(cfg, new_classes, old)
    new_target, old_target = class_targets(new_classes, old.classes if old is not None else [])
    sampler, loader = _build_loader(
        cfg, train_set, rank, world, old.classes if old is not None else ()
    )
    if len(loader) == 0:
        raise ConfigError(
            f"split {cfg.split!r} has {len(train_set)} items: fewer than one batch "
            f"of {cfg.batch_size}"
        )
    method_context = MethodContext(
        old_split_pass_loader=_old_split_pass_loader(
            cfg, old, new_target, old_target, world, device
        ),
        old=old,
        new_classes=new_classes,
        old_classes=old.classes if old is not None else [],
        compatible_dim=compatible_dim,
        device=device,
        epoch_pass_loader=EpochPassLoader(
            train_set, cfg.batch_size // world, new_target, old_target, device
        ),
        epochs=cfg.epochs,
        steps_per_epoch=len(loader),
    )
    method = build_method(cfg.method, cfg.method_options, method_context)
    module = TrainingModule(embedder, head, method).to(device)
    if world > 1:
        # Every BatchNorm of the module, trainable or frozen: one in train mode needs the
        # global batch statistics whatever its requires_grad (its running statistics still
        # update), and one in eval mode behaves as plain BatchNorm anyway. The old model is
        # no submodule (kept out of DDP) and stays plain. Names are unchanged, so checkpoints
        # and exported bundles load into plain modules (docs/architecture.md, training).
        module = synchronize_batchnorm(module, device)
    ddp_model = ray.train.torch.prepare_model(
        module,
        parallel_strategy_kwargs={"find_unused_parameters": False, "broadcast_buffers": True}
        if world > 1
        else None,
    )
    optimizer = build_optimizer(cfg, module)
    return WorkerState(
        cfg,
        rank,
        world,
        device,
        worker_nodes,
        method_cls.trains_embedder,
        old,
        new_classes,
        compatible_dim,
        new_target,
        old_target,
        module,
        ddp_model,
        optimizer,
        sampler,
        loader,
    )


def resume(state: WorkerState) -> tuple[int, list[dict]]:
    """``(first epoch to run, metrics history)``: from Ray Train's latest checkpoint when Ray
    restarted this run, or in local mode from the newest checkpoint the loop wrote under the
    run folder (module and optimizer state restored); else ``(0, [])``."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            start_epoch, history = _load_checkpoint(state, ckpt_dir)
    else:
        latest = latest_local_checkpoint(state.cfg) if is_local_mode(state.cfg) else None
        if latest is None:
            return 0, []
        start_epoch, history = _load_checkpoint(state, local_copy(latest))
    if state.rank == 0:
        print(
            f"[raycompat] resumed {state.cfg.run_name} "
            f"from the checkpoint of epoch {start_epoch - 1}",
            flush=True,
        )
    return start_epoch, history


def _load_checkpoint(state: WorkerState, ckpt_dir: str) -> tuple[int, list[dict]]:
    saved = torch.load(
        os.path.join(ckpt_dir, TRAIN_STATE), map_location=state.device, weights_only=True
    )
    state.module.load_state_dict(saved["module"])
    state.optimizer.load_state_dict(saved["optimizer"])
    with open(os.path.join(ckpt_dir, HISTORY)) as f:
        history = json.load(f)
    return int(saved["epoch"]) + 1, history


# ----------------------------------------------------------------------------- local mode
def is_local_mode(cfg: TrainConfig) -> bool:
    """``num_workers=0``: Ray Train's local mode, the loop in the driver's process
    (docs/training.md, "Local mode")."""
    return cfg.num_workers == 0


def checkpoint_name(epoch: int) -> str:
    """The folder of the checkpoint after ``epoch`` (0-based) finished: ``epoch_0001``..."""
    return f"epoch_{epoch + 1:04d}"


def _run_location(cfg: TrainConfig):
    return open_storage(cfg.storage_path, check=False).child(cfg.run_name)


def _local_checkpoints(run) -> list[str]:
    return [n for n in run.listdir() if re.fullmatch(r"epoch_\d{4}", n)]


def latest_local_checkpoint(cfg: TrainConfig) -> str | None:
    """The newest ``epoch_NNNN`` folder of the run that holds a train state, or ``None``."""
    run = _run_location(cfg)
    for name in reversed(_local_checkpoints(run)):
        if run.is_file(name, TRAIN_STATE) and run.is_file(name, HISTORY):
            return run.join(name)
    return None


def save_local_checkpoint(cfg: TrainConfig, ckpt_dir: str, epoch: int) -> None:
    """Local mode: Ray Train keeps no checkpoint there, so the loop copies each one to
    ``<storage>/<run_name>/epoch_NNNN`` itself (where Ray Train would put it) and keeps the
    newest ``checkpoints_to_keep``."""
    run = _run_location(cfg)
    run.make_dirs("--storage")
    run.upload_dir(ckpt_dir, checkpoint_name(epoch))
    for name in _local_checkpoints(run)[: -cfg.checkpoints_to_keep]:
        run.filesystem.delete_dir(run.fs_path(name))


def run_epoch(state: WorkerState, epoch: int) -> EpochTotals:
    """The method's epoch start (its distributed pass), then one optimizer step per batch of
    this worker's shard, the learning rate set per step (:func:`learning_rate`)."""
    cfg, module, optimizer, device = state.cfg, state.module, state.optimizer, state.device
    state.sampler.set_epoch(epoch)
    module.method.on_epoch_start(epoch, module)
    module.train()
    if not state.trains_embedder:
        module.embedder.eval()
        module.head.eval()
    sums: dict[str, float] = {}
    step_time, started = 0.0, time.perf_counter()
    for step, (x_new, x_old, labels) in enumerate(state.loader):
        t0 = time.perf_counter()
        lr = learning_rate(cfg, epoch, step, state.steps_per_epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        labels = labels.to(device)
        batch = TrainBatch(
            x_new=x_new.to(device),
            labels=labels,
            new_targets=state.new_target.to(device)[labels],
            x_old=None if state.old is None else x_old.to(device),
            old_targets=state.old_target.to(device)[labels],
        )
        terms = state.ddp_model(batch)
        optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        optimizer.step()
        step_time += time.perf_counter() - t0
        for key, value in terms.items():
            sums[key] = sums.get(key, 0.0) + float(value.detach())
        if state.rank == 0 and (step + 1) % cfg.log_every == 0 and console.is_verbose():
            print(
                f"[raycompat] {cfg.run_name} epoch {epoch + 1}/{cfg.epochs} "
                f"step {step + 1}/{state.steps_per_epoch} "
                f"loss {float(terms['loss'].detach()):.4f} lr {lr:.4g}",
                flush=True,
            )
    return EpochTotals(sums, step_time, time.perf_counter() - started, lr)


def epoch_metrics(state: WorkerState, epoch: int, start_epoch: int, totals: EpochTotals) -> dict:
    """The epoch's metrics, averaged over the workers (one all-reduce): mean loss terms,
    images/s of the wall time and of the steps alone, and where the workers ran."""
    cfg, world, steps = state.cfg, state.world, state.steps_per_epoch
    keys = sorted(totals.sums)
    summed = torch.tensor(
        [totals.sums[k] for k in keys] + [totals.step_time, totals.wall], dtype=torch.float64
    )
    torch_distributed.all_reduce_sum(summed)
    metrics = {f"loss/{k}": float(summed[i]) / (steps * world) for i, k in enumerate(keys)}
    metrics.update(
        {
            "epoch": epoch + 1,
            "lr": totals.lr,
            "images_per_s": steps * cfg.batch_size / (float(summed[-1]) / world),
            "step_images_per_s": steps * cfg.batch_size / (float(summed[-2]) / world),
            "epoch_time_s": float(summed[-1]) / world,
            "num_workers": world,
            "worker_nodes": state.worker_nodes,
            "start_epoch": start_epoch,
        }
    )
    return metrics


def training_record(history: list[dict], device: str) -> dict:
    """What training the bundle took, from its epochs' metrics: wall hours (the epochs' times,
    resumed epochs included), workers, the device kind and device-hours (wall x workers); what
    ``plan-upgrade`` counts as the training cost (docs/planning.md, "Fixed costs")."""
    wall_h = sum(float(m.get("epoch_time_s") or 0.0) for m in history) / 3600.0
    workers = max([int(m.get("num_workers") or 1) for m in history] or [1])
    kind = "gpu" if device == "cuda" else "cpu"
    return {
        "epochs": len(history),
        "wall_hours": wall_h,
        "workers": workers,
        "device": kind,
        "device_hours": wall_h * workers,
    }


def report_epoch(state: WorkerState, epoch: int, metrics: dict, history: list[dict]) -> None:
    """Parameter digest (diagnostics), then ``ray.train.report``: rank 0 with a checkpoint
    (train state, history, model bundle), the other ranks with the metrics only."""
    import ray.train

    cfg, rank = state.cfg, state.rank
    digest = parameter_digest(state.module)
    if cfg.diagnostics_dir:
        with open(
            os.path.join(cfg.diagnostics_dir, f"digest_rank{rank}_epoch{epoch + 1}.txt"), "w"
        ) as f:
            f.write(digest)
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 0:
            torch.save(
                {
                    "module": state.module.state_dict(),
                    "optimizer": state.optimizer.state_dict(),
                    "epoch": epoch,
                },
                os.path.join(tmp, TRAIN_STATE),
            )
            with open(os.path.join(tmp, HISTORY), "w") as f:
                json.dump(history, f, indent=1)
            bundle = os.path.join(tmp, BUNDLE_DIR)
            make_bundle(
                cfg, state.module, state.old, state.new_classes, state.compatible_dim, epoch
            ).save(bundle)
            with open(os.path.join(bundle, TRAINING), "w") as f:
                json.dump(training_record(history, state.device.type), f, indent=1)
            if is_local_mode(cfg):
                save_local_checkpoint(cfg, tmp, epoch)
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=checkpoint_name(epoch),
            )
        else:
            ray.train.report(metrics, checkpoint=None)


def _quiet_worker_logs() -> None:
    """Unless verbose, this worker's root logger at WARNING: Ray Train logs each
    ``ray.train.report`` ("Reporting training result ...") at INFO through the root logger,
    which its ``LoggingConfig`` leaves alone (the ``ray.train`` loggers follow the run's
    ``LoggingConfig``, set by :func:`raycompat.train.fit`)."""
    if not console.is_verbose():
        logging.getLogger().setLevel(logging.WARNING)


def train_loop_per_worker(config: dict) -> list[dict]:
    """Ray Train's per-worker function: set up, resume, then per epoch run, report and
    print one progress line (rank 0) with the loss, images/s and an ETA."""
    _quiet_worker_logs()
    cfg = TrainConfig.from_dict(config)
    state = setup_worker(cfg)
    start_epoch, history = resume(state)
    progress = console.Progress(cfg.run_name, cfg.epochs, done=start_epoch)
    for epoch in range(start_epoch, cfg.epochs):
        totals = run_epoch(state, epoch)
        metrics = epoch_metrics(state, epoch, start_epoch, totals)
        history.append(metrics)
        if state.rank == 0:
            progress.step(
                epoch + 1, loss=metrics["loss/loss"], **{"img/s": round(metrics["images_per_s"], 1)}
            )
        report_epoch(state, epoch, metrics, history)
    return history
