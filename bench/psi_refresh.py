"""psi gallery refresh (DMU forward adaptation) throughput against this machine's matmul rate.

Measures, in one process and alternating to share the same machine conditions:
  * psi features/s: ``raycompat.pipeline.psi_refresh.FoldedPsi`` (3 x [Linear-BN-ReLU] +
    Linear, hidden 1024, BN folded) on batches of stored old features;
  * the matrix-multiply rate: ``torch.mm`` of a (batch x hidden) by (hidden x hidden) float32
    matrix, the shape of psi's dominant layers, as FLOP/s;
and prints psi's achieved FLOP/s (features/s x matmul FLOPs per feature) as a fraction of the
matmul rate (goal >= 0.7), and the projected time for 1 billion features. Uses CUDA when
available (then the projection is for that GPU; goal < 10 min on one H100).

    python bench/psi_refresh.py [--old-dim 128 --new-dim 128 --hidden 1024 --batch-size 8192]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def timed_rate(fn, work_per_call: float, seconds: float, sync) -> float:
    fn()
    sync()
    calls, started = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0:
            sync()
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                return calls * work_per_call / elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-dim", type=int, default=128)
    p.add_argument("--new-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating psi / matmul rounds (median reported)"
    )
    p.add_argument(
        "--model", default=None, help="a new-model bundle with a 'psi' module (default: random psi)"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads on CPU (default: all usable cores)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from raycompat.models import ModelBundle, PsiMLP
    from raycompat.pipeline.psi_refresh import FoldedPsi

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else (args.device if args.device != "auto" else "cpu")
    )
    if device.type == "cpu":
        torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    if args.model:
        psi = ModelBundle.load(args.model).modules["psi"].eval()
    else:
        psi = PsiMLP(args.old_dim, args.new_dim, hidden_dim=args.hidden).eval()
        with torch.no_grad():  # non-trivial BN statistics so that folding is exercised
            for m in psi.modules():
                if isinstance(m, torch.nn.BatchNorm1d):
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 2.0)
    folded = FoldedPsi(psi, device=device)
    b = args.batch_size
    old = torch.randn(b, folded.in_dim, device=device)
    with torch.inference_mode():
        ref = psi.to(device)(old)
    err = (folded(old) - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
    hidden = folded.weights[1].shape[0]
    a = torch.randn(b, hidden, device=device)
    w = torch.randn(hidden, hidden, device=device)
    out = torch.empty(b, hidden, device=device)

    def gemm():
        torch.mm(a, w, out=out)

    psi_rates, mm_rates = [], []
    for _ in range(args.rounds):
        psi_rates.append(timed_rate(lambda: folded(old), b, args.seconds, sync))
        mm_rates.append(timed_rate(gemm, 2.0 * b * hidden * hidden, args.seconds, sync))
    psi_fps = statistics.median(psi_rates)
    mm_flops = statistics.median(mm_rates)
    fraction = psi_fps * folded.flops_per_feature / mm_flops
    where = f"{device.type}" + (
        f" ({torch.cuda.get_device_name()})"
        if device.type == "cuda"
        else f" ({torch.get_num_threads()} threads)"
    )
    billion_s = 1e9 / psi_fps
    print(
        f"device: {where}; psi {folded.in_dim}->{hidden}x3->{folded.out_dim}, batch {b}, "
        f"{folded.flops_per_feature / 1e6:.2f} MFLOP/feature; "
        f"folded-vs-module max rel. error {err:.1e}"
    )
    print(
        f"psi refresh: {psi_fps:,.0f} features/s "
        f"(rounds: {', '.join(f'{r:,.0f}' for r in psi_rates)})"
    )
    print(
        f"matmul rate: {mm_flops / 1e9:.1f} GFLOP/s ({b}x{hidden} @ {hidden}x{hidden}; rounds: "
        f"{', '.join(f'{r / 1e9:.1f}' for r in mm_rates)})"
    )
    print(
        f"psi achieved {psi_fps * folded.flops_per_feature / 1e9:.1f} GFLOP/s = "
        f"{fraction:.3f} of the matmul rate "
        f"(goal >= 0.7)"
    )
    print(
        f"projected time for 1e9 features on this {device.type}: "
        f"{billion_s / 60:.1f} min ({billion_s / 3600:.2f} h)"
        + (
            "; goal < 10 min on one H100, DMU paper: < 8 h on a T4"
            if device.type == "cuda"
            else "; (GPU projection: run this script where CUDA is available)"
        )
    )
    if args.json:
        from raycompat.report import write_json

        write_json(
            args.json,
            dict(
                device=where,
                batch_size=b,
                flops_per_feature=folded.flops_per_feature,
                psi_features_per_s=psi_fps,
                psi_rounds=psi_rates,
                matmul_flops=mm_flops,
                matmul_rounds=mm_rates,
                fraction=fraction,
                billion_features_s=billion_s,
                folded_rel_error=err,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
