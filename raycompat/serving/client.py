"""A small HTTP client for the live index (``requests``): search, status, admin calls, and
waiting for the backfill to reach a position."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

__all__ = ["ServingClient", "ServingHTTPError"]


class ServingHTTPError(RuntimeError):
    def __init__(self, status: int, body):
        self.status, self.body = status, body
        msg = body.get("error") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {msg}")


class ServingClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0):
        import requests

        self.base = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.http = requests.Session()

    def _call(self, method: str, path: str, json=None, admin: bool = False):
        headers = {"Authorization": f"Bearer {self.token}"} if admin and self.token else {}
        r = self.http.request(
            method, self.base + path, json=json, headers=headers, timeout=self.timeout
        )
        try:
            body = r.json()
        except ValueError:
            body = r.text
        if r.status_code >= 400:
            raise ServingHTTPError(r.status_code, body)
        return body

    def search(
        self,
        vectors: np.ndarray,
        k: int = 10,
        model: str = "new",
        batch: int = 256,
        old_vectors: np.ndarray | None = None,
        exact: bool = False,
    ):
        """``(ids [Q, k], scores [Q, k], reps [Q, k])`` (-1 / -inf / '' padded); ``old_vectors``:
        the old model's embeddings of the same queries (naive_merge mode); ``exact``: brute
        force, whatever the index (the reference of recall)."""
        q = np.asarray(vectors, np.float32)
        old = None if old_vectors is None else np.asarray(old_vectors, np.float32)
        ids = np.full((q.shape[0], k), -1, np.int64)
        scores = np.full((q.shape[0], k), -np.inf)  # canonical scores (float64)
        reps = np.full((q.shape[0], k), "", dtype=object)
        for s in range(0, q.shape[0], batch):
            body = {"vectors": q[s : s + batch].tolist(), "k": int(k), "model": model}
            if exact:
                body["exact"] = True
            if old is not None:
                body["old_vectors"] = old[s : s + batch].tolist()
            res = self._call("POST", "/search", body)
            for j, row in enumerate(res["results"]):
                for r, hit in enumerate(row):
                    ids[s + j, r], scores[s + j, r] = hit["id"], hit["score"]
                    reps[s + j, r] = hit["representation"]
        return ids, scores, reps

    def search_images(self, images_b64: Sequence[str], k: int = 10) -> dict:
        return self._call("POST", "/search", {"images": list(images_b64), "k": int(k)})

    def status(self) -> dict:
        """The index's status (with the token: process ids, actor names, model paths too)."""
        return self._call("GET", "/status", admin=True)

    def metrics(self) -> str:
        return self.http.get(self.base + "/metrics", timeout=self.timeout).text

    def upsert(self, items: list) -> dict:
        return self._call("POST", "/admin/upsert", {"items": items}, admin=True)

    def start_backfill(self, **kw) -> dict:
        return self._call("POST", "/admin/backfill/start", kw, admin=True)

    def pause_backfill(self) -> dict:
        return self._call("POST", "/admin/backfill/pause", None, admin=True)

    def resume_backfill(
        self,
        until: int | None = None,
        rate: float | None = None,
        clear_until: bool = False,
        override: bool = False,
    ) -> dict:
        """Resume; ``until`` / ``rate`` replace the old ones when given, ``clear_until`` removes
        an earlier ``until`` (the body then says ``"until": null``); ``override``: past a canary
        guard."""
        body: dict = {} if rate is None else {"rate": rate}
        if clear_until or until is not None:
            body["until"] = None if clear_until else until
        if override:
            body["override"] = True
        return self._call("POST", "/admin/backfill/resume", body, admin=True)

    def register_canary(self, vectors, classes=None, relevant_ids=None, old_vectors=None) -> dict:
        """Register the canary: new-model ``vectors`` and, per query, its class or its relevant
        item ids (``old_vectors``: the old model's, for the old-old reference)."""
        body: dict = {"vectors": np.asarray(vectors, np.float32).tolist()}
        if old_vectors is not None:
            body["old_vectors"] = np.asarray(old_vectors, np.float32).tolist()
        if classes is not None:
            body["classes"] = [str(c) for c in classes]
        if relevant_ids is not None:
            body["relevant_ids"] = [[int(i) for i in r] for r in relevant_ids]
        return self._call("POST", "/admin/canary", body, admin=True)

    def rollback_backfill(self, to: int | None = None, **kw) -> dict:
        """Roll back the items upgraded at or after ``to`` (all: ``None``); ``batch_size``,
        ``rate``."""
        return self._call("POST", "/admin/backfill/rollback", {"to": to, **kw}, admin=True)

    def finalize_backfill(self) -> dict:
        return self._call("POST", "/admin/backfill/finalize", None, admin=True)

    def stale(self, model: str, limit: int = 1000) -> list[int]:
        """Every id whose vector ``model`` did not produce, in the backfill's order (all pages)."""
        ids, cursor = [], 0
        while cursor is not None:
            params = f"?model={model}&cursor={cursor}&limit={int(limit)}"
            page = self._call("GET", "/admin/stale" + params, admin=True)
            ids += page["ids"]
            cursor = page["next_cursor"]
        return ids

    def wait_backfill(self, position: int, timeout: float = 600.0, poll: float = 0.1) -> dict:
        """Wait until the backfill has reached ``position`` and stopped moving (paused/done)."""
        t0 = time.time()
        while True:
            bf = self.status()["backfill"]
            if bf["state"] == "error":
                raise RuntimeError(f"backfill failed: {bf.get('error')}")
            if bf["position"] >= position and bf["state"] in ("paused", "done"):
                return bf
            if time.time() - t0 > timeout:
                raise TimeoutError(
                    f"backfill at {bf['position']} ({bf['state']}), waiting for {position}"
                )
            time.sleep(poll)

    def wait_ready(self, timeout: float = 120.0) -> dict:
        t0 = time.time()
        while True:
            try:
                return self.status()
            except Exception:
                if time.time() - t0 > timeout:
                    raise
                time.sleep(0.5)
