"""Gallery pipeline throughput: Ray Data pipeline vs a plain single-process torch loop.

Both do the same work per item: render the built-in glyph (same ``GlyphGallerySource``),
scale to [-1, 1], old embedder, new embedder, psi on the old feature (columns
old,new,adapted; ``--uncertainty`` adds the RACT scores to both). The loop runs in this
process with torch using every core this process may use (and, for reference, 1 thread);
the pipeline runs on the embedded Ray cluster over the same cores. Prints images/s of each
and the ratio pipeline / best loop (goal >= 0.85).

``--large-items N`` also runs the pipeline end to end on an N-item gallery (e.g. 1000000) and
prints its rate and peak memory (sum over the driver and the Ray processes; see
``raycompat.pipeline.summary``). ``--large-from DIR`` instead reports the ``_summary.json`` a
``jobs/embed_gallery.py`` run wrote into DIR (labelled as such).

    python bench/embed_throughput.py --items 20000 [--large-items 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


def plain_loop(
    source, old_path, new_path, n: int, batch_size: int, threads: int, uncertainty: bool
) -> float:
    """images/s of render -> preprocess -> old -> new -> psi (-> uncertainty) in this process."""
    import torch

    from raycompat.models import ModelBundle
    from raycompat.models.uncertainty_head import UncertaintyHead
    from raycompat.pipeline.stages import preprocess
    from raycompat.upgrade.policies import uncertainty_scores

    torch.set_num_threads(threads)
    old, new = ModelBundle.load(old_path).eval(), ModelBundle.load(new_path).eval()
    psi = new.modules["psi"]
    head = UncertaintyHead.from_classifier_head(new.head) if uncertainty else None
    source.load(np.arange(min(n, batch_size)))  # warm the renderer like the pipeline's first batch
    started = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, n, batch_size):
            batch = preprocess(source.load(np.arange(s, min(s + batch_size, n))))
            x = torch.from_numpy(batch["pixels"])
            o = old.embedder(x)
            new.embedder(x)
            psi(o)
            if head is not None:
                for kind in ("least_confidence", "margin", "entropy"):
                    uncertainty_scores(o.numpy(), head, kind)
    return n / (time.perf_counter() - started)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=20000, help="items per measurement (default 20000)")
    p.add_argument("--loop-batch-size", type=int, default=256)
    p.add_argument("--uncertainty", action="store_true")
    p.add_argument(
        "--models",
        default=None,
        help="bundle dir with old/ and new/ (default: random-init lcnet_050)",
    )
    p.add_argument(
        "--large-items", type=int, default=0, help="also run an N-item gallery end to end"
    )
    p.add_argument(
        "--large-from", default=None, help="report the _summary.json of an earlier job run"
    )
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", default=None, help="write the results here")
    from raycompat.pipeline.options import add_pipeline_arguments, pipeline_options_from_args

    add_pipeline_arguments(p)
    args = p.parse_args(argv)

    from raycompat.cluster import connect
    from raycompat.data import build_scenario, default_catalog
    from raycompat.pipeline import GlyphGallerySource, embed_gallery, make_random_bundles

    work = args.work_dir or tempfile.mkdtemp(prefix="embed_bench_")
    if args.models:
        old_path, new_path = os.path.join(args.models, "old"), os.path.join(args.models, "new")
    else:
        old_path, new_path = make_random_bundles(os.path.join(work, "models"))
    scenario = build_scenario("extended-class", catalog=default_catalog())
    n0 = sum(len(scenario.splits[k]) for k in ("query", "gallery", "distractors"))
    cores = len(os.sched_getaffinity(0))
    opts = pipeline_options_from_args(args)
    opts.overwrite = True
    opts.progress_every_s = 30.0

    def source_for(n):
        return GlyphGallerySource(scenario, max(0, n - n0), 32, 0)

    results = {
        "cores": cores,
        "items": args.items,
        "uncertainty": args.uncertainty,
        "note": "timings on a shared machine: other jobs compete for the same cores",
    }
    loop_rates = {}
    for threads in sorted({1, cores}):
        loop_rates[threads] = plain_loop(
            source_for(args.items),
            old_path,
            new_path,
            args.items,
            args.loop_batch_size,
            threads,
            args.uncertainty,
        )
        print(
            f"plain torch loop, {threads} thread(s): {loop_rates[threads]:.1f} images/s", flush=True
        )
    best_threads = max(loop_rates, key=loop_rates.get)
    connect(None, num_cpus=cores)
    run = embed_gallery(
        os.path.join(work, "pipeline"),
        source_for(args.items),
        old_model=old_path,
        new_model=new_path,
        columns=("old", "new", "adapted"),
        uncertainty=args.uncertainty,
        options=opts,
        log=lambda m: None,
    )
    rate = run.summary["items_per_s"]
    steady = run.summary.get("steady_items_per_s") or float("nan")
    ratio = rate / loop_rates[best_threads]
    print(
        f"Ray Data pipeline ({cores} cores, end to end incl. "
        f"{run.summary['first_output_s']:.1f} s of actor "
        f"start-up): {rate:.1f} images/s; after start-up: {steady:.1f} images/s"
    )
    print(
        f"ratio pipeline / plain loop ({best_threads} thread(s), the faster): "
        f"{ratio:.3f} end to end, "
        f"{steady / loop_rates[best_threads]:.3f} after start-up (goal >= 0.85)"
    )
    results.update(
        loop_images_per_s={str(k): v for k, v in loop_rates.items()},
        loop_best_threads=best_threads,
        pipeline_images_per_s=rate,
        ratio=ratio,
        pipeline_steady_images_per_s=steady,
        steady_ratio=steady / loop_rates[best_threads],
        pipeline_stages=run.summary["stages"],
        pipeline_peak_pss_mib=run.summary["memory"]["peak_pss_mib"],
    )
    large = None
    if args.large_items:
        large = embed_gallery(
            os.path.join(work, "large"),
            source_for(args.large_items),
            old_model=old_path,
            new_model=new_path,
            columns=("old", "new", "adapted"),
            uncertainty=args.uncertainty,
            options=opts,
        ).summary
        large["measured_by"] = "this benchmark run"
    elif args.large_from:
        with open(os.path.join(args.large_from, "_summary.json")) as fh:
            large = json.load(fh)
        large["measured_by"] = f"jobs/embed_gallery.py run in {args.large_from}"
    if large:
        mem = large["memory"]
        print(
            f"large gallery ({large['measured_by']}): {large['items_total']} items, "
            f"{large['seconds']:.0f} s, {large['items_per_s']:.1f} images/s end to end, "
            f"peak memory PSS {mem['peak_pss_mib']:.0f} MiB "
            f"(first half {mem.get('peak_pss_first_half_mib', 0):.0f}, "
            f"second half {mem.get('peak_pss_second_half_mib', 0):.0f}), "
            f"RSS sum {mem['peak_rss_mib']:.0f} MiB"
        )
        large_ratio = large["items_per_s"] / loop_rates[best_threads]
        print(
            f"ratio large gallery end to end / plain loop of this run: {large_ratio:.3f} "
            f"(goal >= 0.85)"
        )
        results["large"] = {
            k: large[k]
            for k in (
                "items_total",
                "items_written",
                "seconds",
                "items_per_s",
                "memory",
                "stages",
                "measured_by",
            )
        }
        results["large"]["ratio_to_plain_loop"] = large_ratio
    if args.json:
        from raycompat.report import write_json

        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
