"""The output manifest ``_manifest.json``: everything that decides the content of the shards
(source, id plan and chunking, columns, models by fingerprint). A run refuses to resume into
an output whose manifest differs, so the shards of one output never mix two settings."""

from __future__ import annotations

import json
import os

from raycompat.config import ConfigError
from raycompat.storage import is_uri

MANIFEST_NAME = "_manifest.json"
FORMAT_VERSION = 1


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def content_manifest(
    source, plan, columns, uncertainty_columns, models: dict, schema_dims: dict
) -> dict:
    """``models``: ``{"old": path_or_None, "new": ...}``; paths are recorded but only the
    fingerprints must match on resume (a bundle may move)."""
    from raycompat.models.fingerprint import bundle_fingerprint

    return {
        "format_version": FORMAT_VERSION,
        "source": json.loads(json.dumps(source.describe(), default=str)),
        "plan": plan.describe(),
        "columns": list(columns),
        "uncertainty_columns": list(uncertainty_columns),
        "dims": dict(schema_dims),
        "models": {
            k: (
                {
                    "fingerprint": bundle_fingerprint(p),
                    "path": p if is_uri(p) else os.path.abspath(p),
                }
                if p
                else None
            )
            for k, p in models.items()
        },
    }


def _comparable(manifest: dict) -> dict:
    flat = _flatten(manifest)
    return {k: v for k, v in flat.items() if not k.endswith(".path")}


def check_or_write(directory, manifest: dict) -> bool:
    """Write the manifest into a new output; for an existing one, raise ``ConfigError``
    listing every setting that differs. Returns True when resuming an existing output.
    ``directory``: a local path, a URI or a :class:`~raycompat.storage.Location`."""
    from raycompat.pipeline.location import open_output

    out = open_output(directory, check=False)
    if out.is_file(MANIFEST_NAME):
        old = json.loads(out.read_bytes(MANIFEST_NAME))
        a, b = _comparable(old), _comparable(manifest)
        diffs = [
            f"{k}: {a.get(k)!r} in the output vs {b.get(k)!r} now"
            for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)
        ]
        if diffs:
            shown = "; ".join(diffs[:6]) + (
                f"; and {len(diffs) - 6} more" if len(diffs) > 6 else ""
            )
            raise ConfigError(
                f"cannot resume into {out.uri}: it was written with different settings "
                f"({shown}). Use another --out, or --overwrite to start again."
            )
        return True
    if any(name.endswith(".parquet") for name in out.listdir()):
        raise ConfigError(
            f"{out.uri} holds parquet files but no {MANIFEST_NAME}: not an output of this job; "
            "use another --out, or --overwrite to start again"
        )
    out.make_dirs()
    out.write_bytes(MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return False
