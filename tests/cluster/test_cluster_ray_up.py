"""`ray up` / `ray job submit` / `ray down` with the on-prem config, over SSH to this machine.

sshd runs in its own PID and mount namespaces (``unshare``): everything started over SSH lives
there, so the ``ray stop`` that ``ray up`` and ``ray down`` run cannot touch the test session's
own cluster, and ``~/.bashrc`` (which the setup commands edit, as on a real machine) is a
private copy. The cluster config is deploy/cluster-onprem.yaml with this machine as the head,
this checkout's venv instead of a fresh install, and free ports.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import locations
import pytest
import yaml
from multinode import free_port

# a head and a worker node on this machine (`ray start`), jobs through `ray job submit`: a
# job starts its own driver, Ray Train or Ray Data on both nodes (300 s, not the default 120)
pytestmark = [pytest.mark.cluster2, pytest.mark.subprocess, pytest.mark.timeout(300)]

REPO = locations.REPO
VENV_BIN = os.path.dirname(sys.executable)
RAY = os.path.join(VENV_BIN, "ray")


def _ensure_ssh_tools() -> None:
    """sshd and rsync (ray up syncs files with it); installed with apt when missing."""
    missing = [
        p
        for p in ("openssh-server", "rsync")
        if not shutil.which({"openssh-server": "sshd", "rsync": "rsync"}[p])
        and not os.path.exists("/usr/sbin/sshd" if p == "openssh-server" else "/usr/bin/rsync")
    ]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(
            f"{', '.join(missing)} not installed, "
            "and this user cannot install it (not root with apt)"
        )
    out = subprocess.run(
        ["apt-get", "install", "-y", "-q", *missing],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
    )
    if out.returncode != 0:
        pytest.skip(
            f"cannot install {missing} with apt-get: {out.stderr.strip().splitlines()[-1:]}"
        )


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.fixture(scope="module")
def sshd():
    _ensure_ssh_tools()
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"]).returncode != 0:
        pytest.skip("unshare (PID namespace) is not permitted here")
    tmp = tempfile.mkdtemp(prefix="rcup-")
    for name in ("host_key", "id"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(tmp, name)],
            check=True,
        )
    shutil.copy(os.path.join(tmp, "id.pub"), os.path.join(tmp, "authorized_keys"))
    bashrc = os.path.expanduser("~/.bashrc")
    if not os.path.exists(bashrc):
        open(bashrc, "a").close()  # a bind mount needs a target
    shutil.copy(bashrc, os.path.join(tmp, "bashrc"))
    os.makedirs("/run/sshd", exist_ok=True)
    port = free_port()
    inner = (
        f"mount --bind {tmp}/bashrc {bashrc} && exec /usr/sbin/sshd -D -e -p {port} "
        f"-o ListenAddress=127.0.0.1 -h {tmp}/host_key -o AuthorizedKeysFile={tmp}/authorized_keys "
        f"-o StrictModes=no -o PasswordAuthentication=no -o PidFile={tmp}/sshd.pid"
    )
    log = open(os.path.join(tmp, "sshd.log"), "w")
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", inner],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_port(port)
        yield dict(tmp=tmp, port=port, key=os.path.join(tmp, "id"))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # PID 1 of the namespace: everything inside goes
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _config(sshd, gcs_port: int, dashboard_port: int) -> dict:
    with open(os.path.join(REPO, "deploy", "cluster-onprem.yaml")) as f:
        cfg = yaml.safe_load(f)
    user = os.environ.get("USER") or "root"
    cfg["cluster_name"] = f"rc-up-test-{os.getpid()}"
    cfg["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    cfg["max_workers"] = 0
    cfg["auth"] = dict(
        ssh_user=user,
        ssh_private_key=sshd["key"],
        ssh_proxy_command=f"{sys.executable} {REPO}/tests/tcp_relay.py 127.0.0.1 {sshd['port']}",
    )
    cfg["file_mounts"] = {"~/.ray/auth_token": "~/.ray/auth_token"}  # the repo comes with each job
    # this machine already has the package in this venv: only the PATH line of the setup
    cfg["setup_commands"] = [
        c.replace("$HOME/raycompat-venv/bin", VENV_BIN)
        for c in cfg["setup_commands"]
        if ".bashrc" in c
    ]
    ports = (
        f"--port={gcs_port} --dashboard-port={dashboard_port} --dashboard-host=127.0.0.1 "
        f"--node-ip-address=127.0.0.1 --ray-client-server-port={free_port()} "
        f"--dashboard-agent-listen-port={free_port()} --dashboard-agent-grpc-port={free_port()} "
        f"--metrics-export-port={free_port()} --runtime-env-agent-port={free_port()} "
        f"--num-cpus=2 --temp-dir={sshd['tmp']}/ray"
    )
    cfg["head_start_ray_commands"] = [
        c.replace("--port=6379 --dashboard-host=0.0.0.0", ports)
        for c in cfg["head_start_ray_commands"]
    ]
    assert any(ports in c for c in cfg["head_start_ray_commands"])
    cfg["worker_start_ray_commands"] = []
    return cfg


@pytest.mark.subprocess
def test_ray_up_submit_down(sshd, tmp_path):
    from simulator_inputs import write_parquet

    gcs_port, dashboard_port = free_port(), free_port()
    cfg_path = tmp_path / "onprem.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(sshd, gcs_port, dashboard_port)))
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)

    up = subprocess.run(
        [RAY, "up", "-y", "--no-config-cache", str(cfg_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
    try:
        address = f"http://127.0.0.1:{dashboard_port}"
        embeddings = write_parquet(tmp_path / "embeddings.parquet")
        out_dir = tmp_path / "backfill"
        deadline = time.time() + 90
        while True:  # the head's job agent registers a few seconds after ray up returns
            job = subprocess.run(
                [
                    RAY,
                    "job",
                    "submit",
                    "--address",
                    address,
                    "--working-dir",
                    REPO,
                    "--",
                    "python",
                    "jobs/simulate_backfill.py",
                    "--embeddings",
                    str(embeddings),
                    "--policies",
                    "random",
                    "--modes",
                    "compatible",
                    "--no-plots",
                    "--out",
                    str(out_dir),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if "No available agent" not in job.stdout + job.stderr or time.time() > deadline:
                break
            time.sleep(3)
        assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, (
            job.stdout + job.stderr
        )[-4000:]
        curves = json.loads((out_dir / "curves.json").read_text())
        assert curves["policies"] == ["random"] and curves["n_items"] > 0
    finally:
        down = subprocess.run(
            [RAY, "down", "-y", str(cfg_path)], env=env, capture_output=True, text=True, timeout=300
        )
        for state in glob.glob(f"/tmp/cluster-rc-up-test-{os.getpid()}*"):
            os.remove(state) if os.path.isfile(state) else None
    assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
    # `ray down` ran `ray stop` on the head (through the PATH line of the setup commands)
    time.sleep(2)
    left = subprocess.run(
        ["pgrep", "-f", f"{sshd['tmp']}/ray"], capture_output=True, text=True
    ).stdout.split()
    assert not left, f"Ray processes still running after ray down: {left}"
