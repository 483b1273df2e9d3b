"""What a gallery run reports: peak memory of the Ray processes, per-stage times from Ray
Data's execution stats, and the end-of-run summary (items, seconds, items/s)."""

from __future__ import annotations

import os
import threading
import time

MIB = 1 << 20


def _psutil():
    """psutil; Ray ships a copy in ``ray/thirdparty_files`` that ``import ray`` puts on the path."""
    try:
        import psutil
    except ImportError:
        import psutil
        import ray  # noqa: F401
    return psutil


def process_tree(root_pid: int | None = None):
    """The driver and every process it started (with an embedded Ray: GCS, raylet, dashboard,
    workers and actors); psutil ``Process`` objects."""
    psutil = _psutil()
    root = psutil.Process(root_pid or os.getpid())
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


def tree_memory(root_pid: int | None = None) -> dict:
    """Summed memory of the process tree in MiB: ``rss`` counts shared pages (object store
    mappings, libraries) once per process, ``pss`` splits each shared page among the processes
    mapping it (what the tree costs the machine)."""
    psutil = _psutil()
    rss = pss = 0
    procs = 0
    for p in process_tree(root_pid):
        try:
            info = p.memory_full_info()
        except (psutil.Error, OSError):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
        procs += 1
    return {"rss_mib": rss / MIB, "pss_mib": pss / MIB, "processes": procs}


class MemorySampler:
    """Samples :func:`tree_memory` every ``interval`` seconds in a thread; keeps the peaks
    and a time series ``(seconds, items_done, rss_mib, pss_mib)``."""

    def __init__(self, interval: float = 1.0, progress=lambda: 0):
        self.interval = interval
        self.progress = progress
        self.peak_rss_mib = 0.0
        self.peak_pss_mib = 0.0
        self.series: list[tuple[float, int, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()

    def _sample(self):
        m = tree_memory()
        self.peak_rss_mib = max(self.peak_rss_mib, m["rss_mib"])
        self.peak_pss_mib = max(self.peak_pss_mib, m["pss_mib"])
        self.series.append(
            (
                round(time.perf_counter() - self._t0, 2),
                int(self.progress()),
                round(m["rss_mib"], 1),
                round(m["pss_mib"], 1),
            )
        )

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def thinned_series(self, max_points: int = 60) -> list:
        step = max(1, len(self.series) // max_points)
        return self.series[::step] + (
            [self.series[-1]] if self.series and len(self.series) % step else []
        )

    def halves(self) -> dict:
        """Peak PSS in the first and second half of the run (flat memory: similar values)."""
        if len(self.series) < 4:
            return {}
        mid = len(self.series) // 2
        first = max(s[3] for s in self.series[:mid])
        second = max(s[3] for s in self.series[mid:])
        return {"peak_pss_first_half_mib": first, "peak_pss_second_half_mib": second}


def _total(stat) -> float | None:
    if stat is None:
        return None
    if isinstance(stat, dict):
        return stat.get("sum")
    return getattr(stat, "sum", None)


def stage_times(ds) -> list[dict]:
    """Per Ray Data operator of the executed dataset: name, rows out, wall time (operator
    lifetime), summed remote wall / cpu time of its tasks, and with
    ``DataContext.per_stage_map_timing`` the time split per fused stage."""
    try:
        summary = ds.get_stats_summary()
    except Exception as exc:  # stats are a report, never a reason to fail a finished run
        return [{"operator": "unavailable", "error": str(exc)}]
    ops, stack, seen = [], [summary], set()
    while stack:  # the summary is a chain: this dataset's operators plus its parents'
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        ops = list(node.operators_stats) + ops
        stack.extend(node.parents or [])
    rows = []
    for op in ops:
        out_rows = op.output_num_rows
        rows.append(
            {
                "operator": op.operator_name,
                "rows_out": _total(out_rows),
                "operator_wall_s": op.time_total_s,
                "task_wall_s": _total(op.wall_time),
                "task_cpu_s": _total(op.cpu_time),
                "udf_s": _total(op.function_body_time),
                "stage_s": [_total(s) for s in op.stage_time] if op.stage_time else None,
            }
        )
    return rows


def format_summary(summary: dict) -> str:
    from raycompat.report import markdown_table

    lines = [
        f"items written {summary['items_written']} (of {summary['items_planned']} planned; "
        f"{summary['items_resumed']} already done, {summary['items_skipped']} corrupt skipped) in "
        f"{summary['seconds']:.1f} s: {summary['items_per_s']:.1f} items/s"
        + (
            f" (first output after {summary['first_output_s']:.1f} s of start-up; "
            f"{summary['steady_items_per_s']:.1f} items/s after it)"
            if summary.get("steady_items_per_s")
            else ""
        ),
        f"peak memory (driver + Ray processes): PSS {summary['memory']['peak_pss_mib']:.0f} MiB, "
        f"RSS sum {summary['memory']['peak_rss_mib']:.0f} MiB",
    ]
    nodes = summary.get("nodes") or {}
    if nodes:  # {stage: {node id: rows}}; node ids shortened as `ray list nodes` shows them
        lines.append(
            "embedding stages ran on Ray nodes: "
            + "; ".join(
                f"{stage}: "
                + ", ".join(f"{node[:8]} ({rows} rows)" for node, rows in per_node.items())
                for stage, per_node in nodes.items()
            )
        )
    stages = [s for s in summary.get("stages", []) if "error" not in s]
    if stages:
        lines += [
            "",
            "Per-stage times (Ray Data stats; task times are summed over parallel tasks/actors):",
            "",
            markdown_table(
                [
                    "operator",
                    "rows out",
                    "operator wall s",
                    "task wall s",
                    "task cpu s",
                    "udf s",
                    "per fused stage s",
                ],
                [
                    (
                        s["operator"],
                        s["rows_out"],
                        s["operator_wall_s"],
                        s["task_wall_s"],
                        s["task_cpu_s"],
                        s["udf_s"],
                        ", ".join(f"{v:.1f}" for v in s["stage_s"] if v is not None)
                        if s["stage_s"]
                        else "",
                    )
                    for s in stages
                ],
                digits=1,
            ),
        ]
    return "\n".join(lines)
