"""What an embedding-model upgrade of a gallery is, shared by the simulator, the live index
and the store job (docs/methods.md): the backfill policies (one module each behind one
registry, ``policy_order`` the one dispatch), the query modes as score sides, the backfill grid
and its rounding rule, the canary's guards, the upgrade state machine (``state_machine``: start,
pause, resume, rollback, finalize; docs/live-index.md), the wall-clock cost model and query
logs.  Nothing here runs a simulation or serves a request.
"""

import importlib

_EXPORTS = {
    "POLICIES": "policies",
    "PolicyInputs": "policies",
    "policy_order": "policies",
    "MODES": "modes",
    "SERVED_MODES": "modes",
    "ModeSpec": "modes",
    "SideBuilder": "modes",
    "apply_bundle_modules": "modes",
    "available_modes": "modes",
    "mode_spec": "modes",
    "backfill_counts": "grid",
    "cold_counts": "grid",
    "default_grid": "grid",
    "CostModel": "cost",
    "measure_items_per_s": "cost",
    "QueryLog": "query_log",
    "read_query_log": "query_log",
    "UpgradeState": "state_machine",
    "UpgradeCommand": "state_machine",
    "UpgradeFacts": "state_machine",
    "StateMachine": "state_machine",
}

#: names exported under another name than their module's
_RENAMED = {"UpgradeState": "State", "UpgradeCommand": "Command", "UpgradeFacts": "Facts"}


def __getattr__(name):
    """Lazy exports: importing the package stays light (no torch) until a name is used."""
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, _RENAMED.get(name, name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
