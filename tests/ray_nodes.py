"""A local Ray cluster whose nodes share nothing latentforge writes: a head and worker nodes, each a `ray start --block`
process of its own (its own process group, stopped by its PID) with its own HOME, TMPDIR, XDG_CACHE_HOME, HF_HOME,
LATENTFORGE_CACHE_DIR, PREFECT_HOME and Ray temp dir under one root a node (`Node.dirs`).

The head has no CPU, so no task runs there; each worker node has one CPU and its own custom resource (``lf-node-N``),
so shard tasks (``num_cpus=1``) run only on the worker nodes. The nodes import this checkout (PYTHONPATH), as a
cluster's hosts import what they installed; what else they get from the environment is `NODE_ENV` and what the test
hands them (a store's endpoint and keys).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infra.ops import runners
from tests.procs import free_port, stop_group

#: What a node takes of the test process's environment (the interpreter and the machine's settings; no path
#: latentforge, Prefect, the Hub or Ray write under).
NODE_ENV = ("PATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
#: A node's own directories: the environment variable, and its folder under the node's root.
OWN_DIRS = {
    "HOME": "home",
    "TMPDIR": "tmp",
    "XDG_CACHE_HOME": "cache",
    "HF_HOME": "hf",
    "LATENTFORGE_CACHE_DIR": "lf-cache",
    "PREFECT_HOME": "prefect",
}
RAY_DIR = "ray"  # the node's Ray temp dir (sessions, logs, sockets)
START_TIMEOUT = 60.0
OBJECT_STORE_BYTES = 100 * 2**20  # a worker node's object store (the tasks pass plans and results, not tensors)
#: Unix socket paths are at most 107 bytes: the roots live in a short folder of /tmp, not pytest's deep one.
SHORT_TMP = "/tmp"


@dataclass
class Node:
    name: str
    root: Path
    proc: subprocess.Popen | None = None

    @property
    def dirs(self) -> dict[str, Path]:
        """The node's own directories by environment variable."""
        return {env: self.root / sub for env, sub in OWN_DIRS.items()}

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: os.environ[k] for k in NODE_ENV if k in os.environ}
        env |= {k: str(v) for k, v in self.dirs.items()}
        env["PYTHONPATH"] = runners.CODE_ROOT
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env | extra


@dataclass
class Cluster:
    """The head's address, its nodes (head first) and the root holding every node's folder."""

    root: Path
    address: str = ""
    nodes: list[Node] = field(default_factory=list)

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _start(node: Node, args: list[str], extra: dict[str, str]) -> None:
    for path in node.dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    (node.root / RAY_DIR).mkdir(exist_ok=True)
    ports = ["--dashboard-agent-listen-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
    ports += ["--metrics-export-port", str(free_port())]
    command = [_ray(), "start", "--block", "--disable-usage-stats", "--temp-dir", str(node.root / RAY_DIR), *ports]
    with (node.root / "ray-start.log").open("wb") as log:
        node.proc = subprocess.Popen(
            [*command, *args],
            env=node.env(extra),
            cwd=node.dirs["HOME"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_nodes(address: str, count: int, cluster: Cluster) -> None:
    """Until `count` nodes are alive (asked through `ray status` of the head, in the head's environment)."""
    deadline = time.monotonic() + START_TIMEOUT
    head = cluster.nodes[0]
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            if node.proc is not None and node.proc.poll() is not None:
                log = (node.root / "ray-start.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"ray node {node.name} exited with {node.proc.returncode}: {log}")
        status = subprocess.run(
            [_ray(), "status", "--address", address],
            env=head.env({}),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if status.returncode == 0 and status.stdout.count(" node_") >= count:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the Ray cluster at {address} did not show {count} nodes within {START_TIMEOUT} s")


def start(workers: int, node_env: dict[str, str]) -> Cluster:
    """A head (no CPU) and `workers` worker nodes (one CPU and ``lf-node-N`` each), every one with `node_env` on top
    of its own directories."""
    root = Path(tempfile.mkdtemp(prefix="lf-ray-", dir=SHORT_TMP))
    cluster = Cluster(root=root)
    port = free_port()
    cluster.address = f"127.0.0.1:{port}"
    head = Node("head", root / "head")
    cluster.nodes.append(head)
    try:
        head_args = ["--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "0"]
        head_args += ["--include-dashboard", "false", "--ray-client-server-port", str(free_port())]
        _start(head, head_args, node_env)
        for index in range(1, workers + 1):
            node = Node(f"n{index}", root / f"n{index}")
            cluster.nodes.append(node)
            resources = f'{{"lf-node-{index}": 1}}'
            args = ["--address", cluster.address, "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
            args += ["--resources", resources, "--object-store-memory", str(OBJECT_STORE_BYTES)]
            _start(node, args, node_env)
        _wait_nodes(cluster.address, workers + 1, cluster)
    except BaseException:
        stop(cluster)
        raise
    return cluster


#: Seconds a node's group gets after SIGTERM before SIGKILL.
STOP_GRACE = 5.0


def stop(cluster: Cluster) -> None:
    """Every node's process group at once: SIGTERM to all, SIGKILL what lingers 5 s on (a `ray start --block` group
    outlives a SIGTERM by 20 s and more; nothing of a test cluster needs keeping); the root removed."""
    procs = [node.proc for node in reversed(cluster.nodes) if node.proc is not None and node.proc.poll() is None]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for proc in procs:
        stop_group(proc, timeout=max(0.1, deadline - time.monotonic()))
    shutil.rmtree(cluster.root, ignore_errors=True)


def running(workers: int, node_env: dict[str, str]) -> Iterator[Cluster]:
    """`start`, yielded, then `stop` (a fixture's body)."""
    cluster = start(workers, node_env)
    try:
        yield cluster
    finally:
        stop(cluster)
