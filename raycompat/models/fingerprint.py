"""A saved model bundle's identity without loading its weights: its fingerprint (SHA-256 of
the manifest and weight files), its manifest, its embedder's dimensions, and the check that a
new model was trained against a given old one (docs/pipeline.md, "Models")."""

from __future__ import annotations

import hashlib
import os

from raycompat.config import ConfigError

_LOCAL_COPIES: dict[str, str] = {}


def _local_bundle(path: str) -> str:
    """A bundle at a URI (``s3://.../models/old``) is read from a local copy, made once per
    process; the model actors load the URI themselves (``ModelBundle.load``)."""
    from raycompat.storage import is_uri, local_copy

    if not is_uri(path):
        return os.path.expanduser(path)
    if path not in _LOCAL_COPIES:
        try:
            _LOCAL_COPIES[path] = local_copy(path)
        except FileNotFoundError as exc:
            raise ConfigError(f"no model bundle at {path!r}: {exc}") from None
    return _LOCAL_COPIES[path]


def bundle_fingerprint(path: str) -> str:
    """sha256 (16 hex) of a saved bundle's manifest and weight files: equal fingerprints mean
    equal models, so a resumed run cannot mix vectors of two different models. ``path``: a
    folder or a storage URI."""
    path = _local_bundle(path)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise ConfigError(f"no model bundle at {path!r}: manifest.json is missing")
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name == "manifest.json" or name.endswith(".pt"):
            h.update(name.encode() + b"\0")
            with open(os.path.join(path, name), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def check_predecessor(old_path: str, new_path: str, allow_unrelated: bool = False) -> str | None:
    """Whether the new model was trained against this old model: ``None`` when the
    predecessor fingerprint the new bundle records equals the old bundle's; a warning when
    the new bundle records none (an older bundle, or one trained without an old model) or
    when they differ and ``allow_unrelated``; ``ConfigError`` when they differ otherwise."""
    predecessor = read_manifest(new_path).get("predecessor") or {}
    recorded = predecessor.get("fingerprint")
    if recorded is None:
        why = "an older bundle" if predecessor else "no predecessor in its manifest"
        return (
            f"new model {new_path} records no predecessor fingerprint ({why}): cannot check "
            f"that it was trained against --old-model {old_path}"
        )
    actual = bundle_fingerprint(old_path)
    if recorded == actual:
        return None
    message = (
        f"new model {new_path} was trained against old model {recorded} "
        f"({predecessor.get('path')}), but --old-model {old_path} is {actual}"
    )
    if allow_unrelated:
        return message + " (--allow-unrelated: used together anyway)"
    raise ConfigError(message + ": pass --allow-unrelated to use them together anyway")


def read_manifest(path: str) -> dict:
    import json

    bundle_fingerprint(path)  # existence check with a clear error
    with open(os.path.join(_local_bundle(path), "manifest.json")) as fh:
        return json.load(fh)


def embedder_info(path: str) -> dict:
    """``{embed_dim, in_chans, resolution, modules}`` from a bundle manifest (no weights loaded)."""
    manifest = read_manifest(path)
    modules = manifest.get("modules", {})
    spec = modules.get("embedder")
    if spec is None:
        raise ConfigError(f"model bundle {path!r} has no 'embedder' module (has {sorted(modules)})")
    return {
        "embed_dim": int(spec["embed_dim"]),
        "in_chans": int(spec.get("in_chans", manifest.get("in_chans", 1))),
        "resolution": manifest.get("resolution"),
        "modules": sorted(modules),
        "psi_dims": (int(modules["psi"]["in_dim"]), int(modules["psi"]["out_dim"]))
        if "psi" in modules
        else None,
    }
