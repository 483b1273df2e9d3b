"""A real two-node Ray cluster on one machine, started the way a user starts one:
``ray start --head`` and a second ``ray start --address ...`` with its own resources.

Both run as ``--block`` processes in their own process groups, under a temporary
``--temp-dir`` (each extra node in its own sub-folder, as on separate machines), so that
stopping them never touches the test session's embedded cluster (``ray stop`` would kill
every Ray process of the user). Jobs go through the real
``ray job submit`` CLI against the head's dashboard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalMultiNodeCluster:
    """Head + extra nodes on this machine; ``address`` is the dashboard URL for jobs."""

    def __init__(self, head_cpus: int = 2, head_resources: dict | None = None):
        self.temp_dir = tempfile.mkdtemp(prefix="rc-")  # short: unix socket paths are limited
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.head_cpus = head_cpus
        self.head_resources = head_resources or {"head_node": 1}
        self.processes: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.env = dict(
            os.environ,
            RAY_AUTH_MODE="token",
            RAY_TRAIN_V2_ENABLED="1",
            RAY_TRAIN_ENABLE_PRINT_PATCH="0",
            PYTHONUNBUFFERED="1",
        )
        self.env.pop("RAY_ADDRESS", None)
        subprocess.run(
            [RAY, "get-auth-token", "--generate"], env=self.env, check=True, capture_output=True
        )
        with open(os.path.expanduser("~/.ray/auth_token")) as f:
            self.token = f.read().strip()
        self.node_ip = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], name: str) -> None:
        # every node of every cluster on this machine needs its own agent ports (the defaults
        # are fixed numbers, taken by the test session's own cluster)
        args = args + [
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        log = os.path.join(self.temp_dir, f"{name}.log")
        self.logs.append(log)
        with open(log, "w") as out:
            self.processes.append(
                subprocess.Popen(
                    [RAY, "start", "--block", *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            )

    def start_head(self) -> LocalMultiNodeCluster:
        self._start(
            [
                "--head",
                f"--node-ip-address={self.node_ip}",
                f"--port={self.gcs_port}",
                f"--dashboard-port={self.dashboard_port}",
                "--dashboard-host=127.0.0.1",
                f"--ray-client-server-port={free_port()}",
                f"--num-cpus={self.head_cpus}",
                f"--resources={json.dumps(self.head_resources)}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=true",
            ],
            "head",
        )
        self.wait_for_nodes(1)
        return self

    def add_node(self, cpus: int, resources: dict) -> None:
        # Each node gets its own temp dir, as separate machines have: nodes sharing one session
        # folder share runtime_resources/, and a node setting up a job's working_dir there
        # deletes and re-unpacks the copy that the driver on the head is importing from.
        name = f"node{len(self.processes)}"
        temp_dir = os.path.join(self.temp_dir, name)
        os.makedirs(temp_dir, exist_ok=True)
        self._start(
            [
                f"--address={self.node_ip}:{self.gcs_port}",
                f"--node-ip-address={self.node_ip}",
                f"--num-cpus={cpus}",
                f"--resources={json.dumps(resources)}",
                f"--temp-dir={temp_dir}",
            ],
            name,
        )
        self.wait_for_nodes(len(self.processes))

    def _get(self, path: str):
        request = urllib.request.Request(
            self.address + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def nodes(self) -> list[dict]:
        """Alive nodes from the dashboard's state API: ``node_id``, ``resources_total``."""
        data = self._get("/api/v0/nodes?limit=100&detail=true")
        return [n for n in data["data"]["result"]["result"] if n.get("state") == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            for p, log in zip(self.processes, self.logs, strict=False):
                if p.poll() is not None:
                    raise RuntimeError(
                        f"ray start exited early ({p.returncode}):\n" + open(log).read()[-3000:]
                    )
            try:
                if len(self.nodes()) >= count:
                    return
            except Exception as exc:  # dashboard not up yet
                last = exc
            time.sleep(1.0)
        raise TimeoutError(f"{count} node(s) did not come up in {timeout} s (last error: {last})")

    def submit(self, entrypoint: list[str], working_dir: str, submission_id: str) -> str:
        """``ray job submit --no-wait`` exactly as a user types it; returns the job id.

        Right after start-up the head's job agent may not be registered yet ("No available
        agent"): that answer is retried for up to a minute, anything else fails at once."""
        deadline = time.time() + 60
        while True:
            out = subprocess.run(
                [
                    RAY,
                    "job",
                    "submit",
                    "--address",
                    self.address,
                    "--working-dir",
                    working_dir,
                    "--submission-id",
                    submission_id,
                    "--no-wait",
                    "--",
                    *entrypoint,
                ],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            if (
                out.returncode == 0
                or "No available agent" not in out.stdout + out.stderr
                or time.time() > deadline
            ):
                break
            time.sleep(3.0)
        if out.returncode != 0:
            raise RuntimeError(f"ray job submit failed:\n{out.stdout}\n{out.stderr}")
        assert re.search(re.escape(submission_id), out.stdout + out.stderr)
        return submission_id

    def job_status(self, job_id: str) -> str:
        """The job's status from the job REST API (what `ray job status` asks)."""
        return self._get(f"/api/jobs/{job_id}")["status"]

    def job_logs(self, job_id: str) -> str:
        out = subprocess.run(
            [RAY, "job", "logs", "--address", self.address, job_id],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout + out.stderr

    def wait_for_job(self, job_id: str, timeout: float) -> tuple[str, list[str]]:
        """Poll until the job ends; returns (final status, statuses seen)."""
        deadline = time.time() + timeout
        seen: list[str] = []
        while time.time() < deadline:
            status = self.job_status(job_id)
            if not seen or seen[-1] != status:
                seen.append(status)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status, seen
            time.sleep(0.5)
        return "TIMEOUT", seen

    def stop(self) -> None:
        for p in reversed(self.processes):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 3.0  # `ray start --block` stops its node on SIGTERM
        for p in self.processes:
            try:
                p.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.processes:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        # workers started by a raylet live in the raylet's group; anything left is found by its
        # session folder on the command line
        subprocess.run(["pkill", "-KILL", "-f", self.temp_dir], check=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
