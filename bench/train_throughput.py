"""Images/s of the Ray Train loop against a plain single-process torch loop.

Same model (timm backbone + GeM + FC + CosFace head), same global batch size, same data
(pre-rendered glyphs, or your images decoded once: ``--scenario scenario.json``), same total
thread count. The plain loop runs in this process; the Ray Train runs use 1 and 2 DDP workers
(gloo) on an embedded local Ray. Throughput is taken from epochs after the first (the first
renders or decodes the images).

    python bench/train_throughput.py [--backbone lcnet_050] [--epochs 3] [--batch-size 128]
    python bench/train_throughput.py --scenario scenario.json --resolution 64 --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from raycompat.cluster import connect  # noqa: E402
from raycompat.data import build_scenario, read_scenario_file  # noqa: E402
from raycompat.models import ClassifierHead, Embedder  # noqa: E402
from raycompat.train import TrainConfig, fit  # noqa: E402
from raycompat.train.data import build_training_set  # noqa: E402


def plain_loop(cfg: TrainConfig, threads: int, epochs: int) -> float:
    """The baseline: a textbook torch loop, one process, ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    data = build_training_set(cfg, views=1)
    for i in range(len(data)):
        data.images(i)  # render once, like the Ray loop's first epoch
    model = Embedder(cfg.backbone, cfg.embed_dim, in_chans=cfg.in_chans)
    head = ClassifierHead(cfg.embed_dim, len(data.classes), kind=cfg.head)
    target = torch.full((max(data.classes) + 1,), -1, dtype=torch.long)
    target[torch.tensor(data.classes)] = torch.arange(len(data.classes))
    opt = torch.optim.SGD(
        list(model.parameters()) + list(head.parameters()),
        lr=cfg.lr,
        momentum=0.9,
        nesterov=True,
        weight_decay=cfg.weight_decay,
    )
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    rates = []
    for _ in range(epochs):
        started, images = time.perf_counter(), 0
        for x, _, labels in loader:
            y = target[labels]
            loss = F.cross_entropy(head(model(x), y), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            images += len(labels)
        rates.append(images / (time.perf_counter() - started))
    return sum(rates) / len(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="lcnet_050")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-classes", type=int, default=100)
    parser.add_argument("--images-per-class", type=int, default=40)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--scenario", default=None, help="a scenario.json of your images")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    if args.scenario:
        scenario = read_scenario_file(args.scenario)
    else:
        scenario = build_scenario(
            "extended-data",
            num_train_classes=args.train_classes,
            images_per_class=args.images_per_class,
            num_eval_classes=10,
            num_distractor_classes=0,
            seed=0,
        )
    storage = tempfile.mkdtemp(prefix="raycompat-bench-")

    def config(workers: int) -> TrainConfig:
        return TrainConfig.from_dict(
            dict(
                method="independent",
                backbone=args.backbone,
                embed_dim=128,
                head="cosface",
                epochs=args.epochs + 1,
                warmup_epochs=0,
                batch_size=args.batch_size,
                lr=0.05,
                scenario=scenario.to_dict(),
                split="new_train",
                resolution=args.resolution,
                in_chans=scenario.in_chans,
                num_workers=workers,
                threads_per_worker=max(1, args.threads // workers),
                storage_path=storage,
                run_name=f"bench-{workers}w",
                log_every=10**6,
                max_failures=0,
            )
        )

    baseline = plain_loop(config(1), args.threads, args.epochs)
    print(f"plain torch loop ({args.threads} threads): {baseline:.1f} images/s", flush=True)
    connect(num_cpus=max(2, args.threads))
    figures = {
        "data": scenario.source["path"] if scenario.user_data else "glyphs",
        "resolution": args.resolution,
        "backbone": args.backbone,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "plain_images_per_s": baseline,
    }
    for workers in (1, 2):
        run = fit(config(workers))
        steady = run.history[1:]
        rate = sum(h["images_per_s"] for h in steady) / len(steady)
        figures[f"ray_{workers}w_images_per_s"] = rate
        figures[f"ratio_{workers}w"] = rate / baseline
        print(
            f"Ray Train, {workers} worker(s) x {max(1, args.threads // workers)} threads: "
            f"{rate:.1f} images/s, ratio {rate / baseline:.3f}",
            flush=True,
        )
    print(json.dumps(figures, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
