"""train_ract job: `python jobs/train.py --method ract` with small, quick defaults.

Runs embedded or under `ray job submit -- python jobs/train_ract.py`. Without `--old-model`
it first trains the old model (independent, on the scenario's old split, same data and model
arguments) and then trains the RACT model against it, so the bare command runs end to end.
Every option of train.py is accepted (see `--help`); the defaults below are only defaults.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycompat.cli import train_main, train_old_main  # noqa: E402
from raycompat.config import ConfigError, parse_key_values  # noqa: E402

PROG = "train_ract.py"
# A small default scale: a couple of minutes on 2 CPU cores, both models included.
DEFAULTS = ["--backbone", "lcnet_050", "--epochs", "3", "--train-classes", "40",
            "--images-per-class", "16", "--eval-classes", "20", "--gallery-per-class", "5",
            "--distractor-classes", "20", "--batch-size", "64"]


def _new_model_only_args() -> argparse.ArgumentParser:
    """The train.py options that train_old.py does not take (they are stripped for the old run)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--method", default="ract")
    parser.add_argument("--opt", action="append", default=[])
    parser.add_argument("--old-model")
    parser.add_argument("--init-model")
    parser.add_argument("--split")
    parser.add_argument("--out")
    parser.add_argument("--run-name")
    parser.add_argument("--storage", default="~/raycompat_runs")
    return parser


def main(argv=None) -> int:
    argv = DEFAULTS + list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        return train_main(argv, default_method="ract", prog=PROG)
    known, rest = _new_model_only_args().parse_known_args(argv)
    try:  # fail on a bad method option before spending minutes on the old model
        from raycompat.methods import parse_method_options
        parse_method_options(known.method, parse_key_values(known.opt))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not known.old_model:
        stamp = int(time.time())
        old_path = os.path.join(os.path.expanduser(known.storage), "models", f"ract-old-{stamp}")
        print(f"[raycompat] no --old-model: training the old model first -> {old_path}", flush=True)
        code = train_old_main(rest + ["--storage", known.storage, "--out", old_path,
                                      "--run-name", f"ract-old-{stamp}"])
        if code:
            return code
        argv = argv + ["--old-model", old_path]
    return train_main(argv, default_method="ract", prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
