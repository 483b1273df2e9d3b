"""The backfill controller's guarded upgrade: the canary gate, rollback, finalize and the stale
listing (docs/live-index.md, "Upgrading a live gallery safely").

:class:`UpgradeCommands` is a part of
:class:`raycompat.serving.backfill_controller.BackfillController`
(it uses the controller's lock, record ``ck``, shard handles and order):

* **canary** -- registered once (:meth:`~UpgradeCommands.register_canary`, stored by
  :class:`~raycompat.serving.canary_gate.CanaryGate`), measured by the walk (an asyncio
  task) at every ``canary_every``-th position (batches stop there), through the router's search path
  (``Router.canary_search``: the same query sides and batcher as ``POST /search``).  A point
  whose guard trips pauses the backfill (``paused_by``, a warning in the controller's log)
  unless ``resume`` was given ``override``;
* **rollback** -- the items upgraded since the last finalize (the store keeps their old
  vectors) at or after a position of the order (or all) are turned back in batches, latest
  upgraded first, each batch one commit of the store; the list is kept in the store beside
  the order, the record's ``rollback`` says how far the store committed it, so a crash resumes
  it; when it ends the backfill is paused at the first position rolled back;
* **finalize** -- the upgraded items' old vectors are no longer kept for a rollback; when every
  item is upgraded the store drops its old vector column (the space is freed);
* **stale** -- the ids whose vector another model produced, paged in the backfill's order.

Whether a command is accepted, and the state after it, is decided by
:mod:`raycompat.upgrade.state_machine` (the controller's ``_decide``); this module carries the
accepted commands out.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import numpy as np

from raycompat.serving.canary_gate import CanaryGate
from raycompat.serving.placement import split_by_shard
from raycompat.storage import StorageError
from raycompat.upgrade.canary import CanarySet
from raycompat.upgrade.state_machine import Command, State

__all__ = ["UpgradeCommands", "rollback_plan"]

logger = logging.getLogger("raycompat.serving")


def rollback_plan(
    kept: np.ndarray, order: np.ndarray | None, to: int | None
) -> tuple[np.ndarray, int | None]:
    """``(ids, first position)``: the ``kept`` ids (those with an old vector) to roll back,
    latest upgraded first -- those at position ``to`` or later of ``order`` (``to=None``: every
    kept id; ids not in the order come last) -- and the first position among them."""
    kept = np.unique(np.asarray(kept, np.int64))
    if order is None:
        return kept, None
    order = np.asarray(order, np.int64)
    sorter = np.argsort(order, kind="stable")
    at = np.minimum(np.searchsorted(order, kept, sorter=sorter), max(order.size - 1, 0))
    found = (order[sorter[at]] == kept) if order.size else np.zeros(kept.size, bool)
    pos = np.where(found, sorter[at] if order.size else 0, -1)
    if to is not None:
        kept, pos = kept[pos >= int(to)], pos[pos >= int(to)]
    first = int(pos[pos >= 0].min()) if (pos >= 0).any() else None
    return kept[np.lexsort((kept, -pos))], first


class UpgradeCommands:
    """The guarded-upgrade part of the backfill controller (see the module docstring)."""

    def _init_upgrade(self) -> None:
        run = (self.ck.get("order") or {}).get("run")
        self.gate = CanaryGate(self.up.records, self.cfg.canary, self.cfg.mode, run)
        rb = self.ck.get("rollback") or {}
        self.rollback_order = self.up.records.read_order(rb["ids"]) if rb.get("ids") else None
        self._router = None
        if rb.get("state") in ("running", "paused") and self.rollback_order is not None:
            self._reconcile_rollback(rb)

    def _reconcile_rollback(self, rb: dict) -> None:
        """An unfinished rollback's progress as the store has it: its items are turned back
        in their order, so ``done`` is the number of leading ids no longer upgraded (the
        record, saved at most once a second, may say fewer)."""
        from raycompat.stores import Filter

        ids = self.rollback_order
        still = set()
        for start in range(0, ids.size, 4096):
            chunk = tuple(int(i) for i in ids[start : start + 4096])
            for block in self.store.read_blocks(("id", "upgraded"), filter=Filter(ids=chunk)):
                still.update(block["id"][block["upgraded"]].tolist())
        up = np.fromiter((int(i) in still for i in ids), bool, ids.size)
        done = int(np.argmax(up)) if up.any() else int(ids.size)
        if done > int(rb.get("done") or 0):
            rb["rolled_back"] = int(rb.get("rolled_back") or 0) + done - int(rb["done"] or 0)
            rb["done"] = done

    # ------------------------------------------------------------------ canary
    def register_canary(
        self, vectors, relevant_ids=None, classes=None, old_vectors=None, groups=None
    ) -> dict:
        """Store a canary: ``vectors`` (new model), one of ``relevant_ids`` (item ids per
        query) or ``classes`` (a class name per query); ``{"error", "status"}`` for bad
        input."""
        if self.cfg.mode == "naive_merge" and old_vectors is None:
            return {
                "error": "the naive_merge mode searches with the old model's embedding of each "
                "query too: send 'old_vectors' (or images, with old_model configured)",
                "status": 422,
            }
        try:
            relevant, groups = self._canary_relevance(relevant_ids, classes)
            canary = CanarySet(vectors, relevant, groups, old_vectors)
        except KeyError as exc:
            return {"error": str(exc.args[0]), "status": 404}
        except ValueError as exc:
            return {"error": str(exc), "status": 422}
        with self.lock:
            total = int(self.ck.get("total") or self.plan.n_items)
            try:
                self.gate.register(canary)
                if self.ck.get("order"):  # backfill-store --status shows its points
                    self.ck["canary"] = self.gate.record_info(total)
                    self._save_record()
            except Exception as exc:  # the store refused the records
                return {"error": f"canary not stored in {self.store.uri.raw}: {exc}", "status": 503}
            return {
                "queries": canary.n_queries,
                "groups": int(np.unique(canary.groups).size),
                "relevant": int(sum(r.size for r in canary.relevant)),
                "old_vectors": canary.old_vectors is not None,
                "every": self.gate.every(total),
                "k": self.cfg.canary.canary_k,
            }

    def _canary_relevance(self, relevant_ids, classes) -> tuple[list, list]:
        """``(relevant ids per query, group per query)``; KeyError naming unknown ids or
        classes."""
        from raycompat.serving.gallery_source import gallery_classes

        src = self.gallery()
        if classes is not None:
            ids, names = gallery_classes(src)
            if names is None:
                raise ValueError("this gallery has no classes: give 'relevant_ids'")
            relevant = [ids[names == str(c)] for c in classes]
            missing = [str(c) for c, r in zip(classes, relevant, strict=True) if not r.size]
            if missing:
                raise KeyError(f"no gallery item has class {missing[0]!r}")
            return relevant, [str(c) for c in classes]
        known = np.sort(src.gallery_ids())
        flat = np.unique(np.concatenate([np.asarray(r, np.int64) for r in relevant_ids]))
        unknown = flat[~np.isin(flat, known)]
        if unknown.size:
            raise KeyError(f"unknown item id(s) in relevant_ids: {unknown[:10].tolist()}")
        groups = [
            hashlib.sha256(np.unique(np.asarray(r, np.int64)).tobytes()).hexdigest()[:12]
            for r in relevant_ids
        ]
        return [np.asarray(r, np.int64) for r in relevant_ids], groups

    def _canary_stop(self, pos: int, total: int) -> int:
        return self.gate.next_stop(pos, total)

    async def _search_canary(self, vectors, model: str, old_vectors=None) -> np.ndarray:
        """Result ids of the canary's queries through the router's search path."""
        if self._router is None:
            from ray import serve

            self._router = serve.get_deployment_handle("router", app_name=self.cfg.app_name)
        k = self.cfg.canary.canary_k

        async def call():
            return await self._router.canary_search.remote(vectors, k, model, old_vectors)

        return np.asarray(await asyncio.wait_for(call(), self.cfg.shard_timeout_s))

    def _has_new_items(self) -> bool:
        with self.store_lock:
            return self.store.count_upgraded() > 0

    def _canary_due(self):
        """(a worker thread) ``(run, position, generation, canary, wants old-old)`` when the
        canary is due at the current position, else ``None``."""
        with self.lock:
            run, pos, total = self.ck.get("started"), int(self.ck["position"]), self.ck["total"]
            if self.ck["state"] != "running" or not self.gate.due(run, pos, int(total)):
                return None
            wants_old = self.gate.wants_old_old(False) and not self._has_new_items()
            return run, pos, self.generation, self.gate.canary, wants_old

    async def _canary_step(self) -> bool:
        """Measure the canary when it is due at the current position (the walk)."""
        due = await asyncio.to_thread(self._canary_due)
        if due is None:
            return False
        run, pos, gen, canary, wants_old = due
        old_ids = None
        if wants_old:
            old_ids = await self._search_canary(canary.old_vectors, "old")
        ids = await self._search_canary(canary.vectors, "new", canary.old_vectors)
        await asyncio.to_thread(self._canary_point, run, pos, gen, canary, ids, old_ids)
        return True

    def _canary_point(self, run, pos: int, gen: int, canary, ids, old_ids) -> None:
        """(a worker thread) Record the point measured at ``pos`` and judge it, unless the
        backfill restarted or another canary came meanwhile (then it is measured again)."""
        with self.lock:
            if gen != self.generation or canary is not self.gate.canary:
                return
            self.gate.last = (run, pos)
            point = self.gate.measure(pos, ids, old_ids)
            self._judge(point)

    def _judge(self, point: dict) -> None:
        """(lock held) A tripped guard is the state machine's ``canary_trip``: it pauses a
        running (or just paused) backfill, unless overridden; logged either way.  A point
        judged after a rollback or a finalize began changes nothing."""
        if point["guard"] is None or not self.cfg.canary.canary_guard:
            return
        before = self._state()
        after = self._decide(Command.CANARY_TRIP).state
        if after is State.GUARD_PAUSED:
            self.ck["paused_by"] = {
                "guard": point["guard"],
                "position": point["position"],
                "reason": point["reason"],
            }
            self._enter(after)
            logger.warning(
                "backfill paused by the canary guard %s at position %d: %s",
                point["guard"],
                point["position"],
                point["reason"],
            )
            self._try_save("paused by the canary")
        elif before in (State.RUNNING, State.PAUSED) and self.ck.get("override"):
            point["overridden"] = True
            logger.warning(
                "canary guard %s tripped at position %d, backfill continues (override): %s",
                point["guard"],
                point["position"],
                point["reason"],
            )

    def _record_override(self) -> None:
        """(lock held) An accepted resume with ``override``: guards no longer pause this
        backfill; logged."""
        paused_by = self.ck.get("paused_by")
        self.ck["override"] = True
        logger.warning(
            "backfill resumed at position %d with override: canary guards no longer pause it%s",
            int(self.ck["position"]),
            f" (it was paused by {paused_by['guard']})" if paused_by else "",
        )

    # ------------------------------------------------------------------ rollback
    def rollback(self, to: int | None = None, batch_size: int = 256, rate=None) -> dict:
        """Start returning the upgraded items at or after position ``to`` of the order (all:
        ``None``) to their old vectors (see the module docstring).  Decided twice by the state
        machine: before the shards are asked which items keep an old vector, and with how
        many the rollback would return (none: 409)."""
        with self.lock:
            self._await_rest()
            answer = self._decide(Command.ROLLBACK, to=to)
            if not answer.ok:
                return answer.as_error()
        try:
            kept = self._kept_ids()
        except Exception as exc:
            return {"error": f"store unavailable: {type(exc).__name__}: {exc}", "status": 503}
        with self.lock:
            ids, first = rollback_plan(kept, self.order, to)
            answer = self._decide(Command.ROLLBACK, to=to, rollback_items=int(ids.size))
            if not answer.ok:
                return answer.as_error()
            self.rollback_order = ids
            rb = {"state": "running", "to": to, "done": 0, "total": int(ids.size), "first": first}
            rb.update(rolled_back=0, batch_size=int(batch_size), rate=rate, started=time.time())
            try:
                rb["ids"] = self._save_rollback_ids(ids)
                self.ck["rollback"] = rb
                self._enter(answer.state)
                self._save_record()
            except StorageError as exc:
                return {"error": f"rollback not started: {exc}", "status": 503}
            logger.warning("rollback of %d item(s) started (to position %s)", ids.size, to)
            self._notify()
            return self.status()

    def _save_rollback_ids(self, ids: np.ndarray) -> dict:
        """The rollback's ids, in the store beside the order (what the record keeps of them)."""
        run = "rollback-" + str((self.ck.get("order") or {}).get("run") or "by-hand")
        try:
            return self.up.records.write_order(run, ids)
        except Exception as exc:
            raise StorageError(
                f"store {self.store.uri.raw} refused the rollback's ids: {exc}"
            ) from None

    def _rollback_step(self) -> bool:
        """One batch of a running rollback (the walk, on a worker thread); ``False``: none
        runs.  The batch waits out a ``/status`` hold; its last acknowledgement ends the
        rollback, even when a pause came while it was in flight."""
        with self.lock:
            rb = self.ck.get("rollback")
            if self._state() is not State.ROLLING_BACK or not rb:
                return False
            done = int(rb["done"])
            if done >= rb["total"]:
                self._end_rollback(rb)
                return True
            self._wait_for_holds()
            if self._state() is not State.ROLLING_BACK or self.ck.get("rollback") is not rb:
                return True  # paused, or another rollback, meanwhile: look again
            done, gen = int(rb["done"]), self.generation
            batch = self.rollback_order[done : done + int(rb["batch_size"])]
            self._in_flight = {"kind": "rollback", "from": done, "items": int(batch.size)}
        try:
            moved = self._rollback_on_shards(batch)
        except Exception:
            self._settle()
            raise
        with self.lock:
            self._settle()
            if gen == self.generation and self.ck.get("rollback") is rb and rb["done"] == done:
                rb["done"] = done + int(batch.size)
                rb["rolled_back"] += moved
                if rb["done"] >= rb["total"]:
                    self._end_rollback(rb)
                elif time.monotonic() - self._record_saved >= self.record_every_s:
                    self._save_record()  # a rollback resumed from an older record reverts
                    # the same items again: reverting an item that is old changes nothing
        if rb.get("rate"):
            time.sleep(batch.size / float(rb["rate"]))
        return True

    def _end_rollback(self, rb: dict) -> None:
        """(lock held) The rollback is acknowledged (``rollback_end``): the backfill pauses at
        the first position rolled back (stays done when nothing of its order moved; idle
        without an order)."""
        pos = int(self.ck.get("position") or 0)
        if rb.get("first") is not None:
            pos = min(pos, int(rb["first"]))
        before = self._state()
        answer = self._decide(Command.ROLLBACK_END, position=pos)
        if before not in (State.ROLLING_BACK, State.ROLLBACK_PAUSED):
            return  # a restart or a failure took over
        self.ck["position"] = pos
        rb["state"] = "done"
        self._enter(answer.state)
        self._save_record()
        logger.warning(
            "rollback done: %d item(s) back to their old vectors; the backfill is %s at %d",
            rb["rolled_back"],
            self.ck["state"],
            self.ck["position"],
        )

    def _kept_ids(self) -> np.ndarray:
        """The items upgraded since the last finalize (whose old vectors a rollback returns
        to): upgraded rows the store wrote after the finalize's write sequence number."""
        since = int((self.ck.get("finalized") or {}).get("seq") or 0)
        with self.store_lock:
            blocks = list(self.store.read_changes(since, ["id", "upgraded"]))
        ids = [b["id"][b["upgraded"]] for b in blocks]
        return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)

    def _rollback_on_shards(self, ids: np.ndarray) -> int:
        """Turn ``ids`` back in one commit of the store; returns the items moved back."""
        return int(self.commit([], revert=ids)["applied"])

    # ------------------------------------------------------------------ finalize, stale
    def finalize(self) -> dict:
        """The upgraded items' old vectors are no longer kept for a rollback (the store drops
        its old column when every item is upgraded).  The controller is ``finalizing``
        meanwhile (every other command is refused), then back in the state it began in
        (``finalize_end``)."""
        with self.lock:
            self._await_rest()
            answer = self._decide(Command.FINALIZE)
            if not answer.ok:
                return answer.as_error()
            before = self._state()
            self._enter(answer.state)
            self._finalizing_from = before
            pos = int(self.ck.get("position") or 0)
        failed, dropped, column, seq = None, 0, False, 0
        try:
            dropped, column, seq = self._finalize_store()
        except Exception as exc:
            failed = f"store {self.store.uri.raw} refused the finalize: {exc}"
        with self.lock:
            if failed is None:
                self.ck["finalized"] = {
                    "position": pos,
                    "dropped": dropped,
                    "column_dropped": column,
                    "seq": seq,
                    "at": time.time(),
                }
                self.ck["rollback"] = None  # a rollback that ended (an unfinished one refuses)
            self._enter(self._decide(Command.FINALIZE_END, before=before).state)
            self._try_save("finalized" if failed is None else "finalize failed")
            if failed is not None:
                return {"error": failed, "status": 503}
            logger.warning("finalized at position %d: %d old vector(s) dropped", pos, dropped)
            return {"dropped": dropped, "column_dropped": column, "position": pos}

    def _finalize_store(self) -> tuple[int, bool, int]:
        """``(items whose old vector is no longer kept, whether the store dropped its old
        column, the store's write sequence number)``: the column goes when every item is
        upgraded, since no item uses an old vector then."""
        dropped = int(self._kept_ids().size)
        with self.store_lock:
            column = self.store.count_upgraded() == self.store.count()
            if column:
                self.store.finalize()
            return dropped, column, self.store.max_write_seq()

    async def stale(self, model: str, cursor: int = 0, limit: int = 1000) -> dict:
        """A page of the ids whose vector ``model`` did not produce, in the backfill's order
        (the gallery's before any backfill), from position ``cursor`` of that order."""
        order, kind = await asyncio.to_thread(self._stale_order)
        out: list[int] = []
        pos = int(cursor)
        while pos < order.size and len(out) < limit:
            chunk = order[pos : pos + max(4 * limit, 1024)]
            stale = np.flatnonzero(await self._models_of(chunk) != model)
            need = limit - len(out)
            if stale.size >= need:
                out += chunk[stale[:need]].tolist()
                pos += int(stale[need - 1]) + 1
                break
            out += chunk[stale].tolist()
            pos += int(chunk.size)
        return {
            "model": model,
            "ids": out,
            "next_cursor": pos if pos < order.size else None,
            "order": kind,
        }

    def _stale_order(self) -> tuple[np.ndarray, str]:
        with self.lock:
            order = self.order
        if order is not None:
            return order, "backfill"
        return self.gallery().gallery_ids(), "gallery"

    async def _models_of(self, ids: np.ndarray) -> np.ndarray:
        """The model fingerprint of every id (``""`` where no shard holds it)."""
        out = np.full(ids.size, "", dtype=object)
        parts = split_by_shard(ids, len(self.shards))
        calls = {s: self.shards[s].models_of.remote(ids[p]) for s, p in enumerate(parts) if p.size}
        for s, call in calls.items():

            async def answer(call=call):
                return await call

            res = await asyncio.wait_for(answer(), 60)
            out[parts[s]] = [m or "" for m in res]
        return out

    def upgrade_status(self) -> dict:
        """(lock held) What ``/status`` shows of the guarded upgrade."""
        total = int(self.ck.get("total") or self.plan.n_items)
        return {
            "paused_by": self.ck.get("paused_by"),
            "override": bool(self.ck.get("override")),
            "canary": self.gate.status(total),
            "rollback": self.ck.get("rollback"),
            "rollback_in_flight": bool(self._in_flight and self._in_flight["kind"] == "rollback"),
            "finalized": self.ck.get("finalized"),
            "kept": self._kept_status(),
        }

    def _kept_status(self) -> dict:
        """The items a rollback can turn back (upgraded since the last finalize; the store
        keeps their old vectors), or the store's error."""
        try:
            return {"items": int(self._kept_ids().size)}
        except Exception as exc:
            return {"items": None, "error": f"{type(exc).__name__}: {exc}"}
