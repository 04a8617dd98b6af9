"""Autoscaling run: the Serve tier on a cluster whose nodes Ray's own autoscaler adds and removes,
under a load that comes and goes, and a node lost under a replica.

The cluster is Ray's ``AutoscalingCluster``: the real autoscaler with a node provider that starts
each worker node as local processes (``fake_multinode``, what Ray's autoscaler tests use), so it runs
on one machine with logical resources. Its settings are the shipped ones (``deploy/cluster.yaml``:
upscaling speed, the worker group's bounds, capped at ``--max-nodes``; a head with no room for
replicas) and the tier's are ``deploy/serve.yaml``'s ``args`` (its autoscaling policy, its limits),
with the model made tiny, the pool on CPU workers, each worker node sized for one replica, and the
delays scaled down by ``--time-scale``. Then:

1. before the tier: no worker node;
2. the tier deployed: its first replica's placement group waits, the autoscaler adds a node, the
   replica starts there;
3. a load of ``--clients`` clients sending ``POST /prefill`` (every fourth with its KV kept and then
   taken by a ``KVReceiver`` over TCP): Serve asks for more replicas, their placement groups wait,
   the autoscaler adds nodes, the replicas start and take requests;
4. with ``--kill-node``, the node of one replica is killed (its raylet and every process on it) in the
   middle of the load: Serve replaces the replica, on a node the autoscaler adds if need be;
5. the load stops: the replicas drain to ``min_replicas``, the idle nodes are removed;
6. the tier deleted: the last node is removed.

Every request's outcome is kept (answered, or failed with the error the client saw); every second
the number of running replicas, of alive worker nodes and of placement groups waiting. The summary
(the trajectory, the time from a placement group waiting to its replica serving, the outcomes, the
KV held at the end) is printed and written as JSON, with a plot beside it (``--plot``).

    python benchmarks/autoscaling.py --out benchmarks/results/autoscaling-cpu.json --plot autoscaling-cpu.png

It runs Ray's own ``ray stop --force`` at its start and end (that is how ``AutoscalingCluster`` starts
and stops its nodes): run it alone, not beside another Ray on the same host.
``tests/ray/test_autoscaling.py`` runs :func:`run_autoscaling` in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import ray
import yaml
from ray import serve
from ray.cluster_utils import AutoscalingCluster
from ray.util.state import list_actors

from cluster.serve import build_app
from configs.serve import REPORT_INTERVAL_ENV, ServeConfig
from kv.receiver import KVReceiver

REPO = Path(__file__).resolve().parents[1]
NODE_TYPE = "prefill_node"
APP = "autoscale"


class FakeNodesCluster(AutoscalingCluster):
    """``AutoscalingCluster`` with its whole configuration given here (the fake provider's example
    file it reads its defaults from is not in Ray's wheels)."""

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = {
            "cluster_name": "mlapool-autoscaling", "max_workers": sum(t["max_workers"] for t in worker_node_types.values()),
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True},
            "available_node_types": {**worker_node_types, "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0}},
            "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
            "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }  # fmt: skip
        config.update(config_kwargs)
        return config


def shipped_configs(max_nodes: int, time_scale: float) -> tuple[dict, dict]:
    """``deploy/cluster.yaml``'s autoscaler settings and ``deploy/serve.yaml``'s tier arguments, made
    to run on one CPU machine (see the module docstring)."""
    launcher = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    group = next(t for name, t in launcher["available_node_types"].items() if name != launcher["head_node_type"])
    args = next(a for a in yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())["applications"] if a["name"] == "prefill")["args"]
    args = {k: v for k, v in args.items() if k not in ("kv_token", "api_keys", "kv_host")}  # secrets and the network: this host, no doors
    for key in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s"):
        args[key] = args[key] * time_scale
    args.update(name="mlapool-autoscale", max_replicas=min(args["max_replicas"], max_nodes), replica_cpus=0.5, kv_ttl_s=60,
                pool={"model": "tiny", "tp": 1, "pcp": 1, "device": "cpu", "use_gpus": False, "worker_cpus": 0.5, "placement": args["pool"]["placement"],
                      "kv_cache_tokens": 4096, "chunk_tokens": 256, "max_batch_tokens": 1024})  # fmt: skip
    node = {"resources": {"CPU": 1}, "node_config": {}, "min_workers": group.get("min_workers", 0), "max_workers": min(group["max_workers"], max_nodes)}
    cluster = {"upscaling_speed": launcher["upscaling_speed"], "idle_timeout_minutes": launcher["idle_timeout_minutes"] * time_scale,
               "worker_node_types": {NODE_TYPE: node}}  # fmt: skip
    return cluster, args


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


class Watch:
    """Every ``interval_s``: running replicas, alive worker nodes, placement groups waiting."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.samples: list[dict] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True, name="autoscaling-watch")
        self._thread.start()

    def now(self) -> dict:
        nodes = [n for n in ray.nodes() if n["Alive"] and not n.get("Resources", {}).get("node:__internal_head__")]
        pending = sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING")
        try:
            deployments = serve.status().applications.get(APP)
            replicas = sum(d.replica_states.get("RUNNING", 0) for d in deployments.deployments.values()) if deployments else 0
        except Exception:  # noqa: BLE001 -- the controller busy or gone: the sample says so
            replicas = None
        return {"t": round(time.monotonic() - self.started, 1), "replicas": replicas, "worker_nodes": len(nodes), "pending_placement_groups": pending}

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.samples.append(self.now())

    def wait_for(self, what: str, check, timeout_s: float, hold_s: float = 0.0) -> float:
        """Seconds until ``check(sample)`` holds (for ``hold_s`` on end); ``TimeoutError`` naming ``what``."""
        started, held = time.monotonic(), None
        while time.monotonic() - started < timeout_s:
            if check(self.now()):
                held = held or time.monotonic()
                if time.monotonic() - held >= hold_s:
                    return held - started
            else:
                held = None
            time.sleep(0.5)
        raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (last: {self.now()})")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Load:
    """``clients`` threads posting prefills until stopped; every request's outcome."""

    def __init__(self, url: str, clients: int, clock: float) -> None:
        self.url, self.clock, self.outcomes, self._stop = url, clock, [], threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(clients, thread_name_prefix="autoscaling-client")
        self._futures = [self._pool.submit(self._client, i) for i in range(clients)]

    def _client(self, index: int) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            handoff = count % 4 == 0
            prompt = [int(t) for t in np.random.default_rng(index * 100_003 + count).integers(0, 256, size=192)]
            body = json.dumps({"token_ids": prompt, "handoff": handoff, "return_logits": False}).encode()
            request = urllib.request.Request(self.url + "/prefill", data=body, headers={"content-type": "application/json"})
            started = time.monotonic()
            outcome = {"client": index, "handoff": handoff, "t": round(started - self.clock, 2)}
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    answer = json.loads(response.read())
                if handoff:
                    ticket = answer["ticket"]
                    KVReceiver(ticket["host"], ticket["port"], transport="tcp", model_fingerprint=ticket["model_fingerprint"]).fetch(ticket["request_id"])
                outcome["status"] = 200
            except urllib.error.HTTPError as exc:
                outcome.update(status=exc.code, error=exc.read().decode(errors="replace")[:300])
            except Exception as exc:  # noqa: BLE001 -- every outcome is recorded, none raised
                outcome.update(status=None, error=f"{type(exc).__name__}: {exc}"[:300])
            outcome["seconds"] = round(time.monotonic() - started, 3)
            with self._lock:
                self.outcomes.append(outcome)

    def stop(self) -> list[dict]:
        self._stop.set()
        for future in self._futures:
            future.result()
        self._pool.shutdown()
        return self.outcomes


def replica_actors() -> dict[str, str]:
    """The tier's replica actors alive: actor id -> node id."""
    return {a.actor_id: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000) if "ServeReplica" in a.class_name}


def kill_node_of_a_replica() -> str:
    """SIGKILL the raylet of a worker node that runs a replica of the tier (its workers die with it);
    returns the node id."""
    node_id = next(iter(replica_actors().values()))
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if command.endswith(b"raylet") and f"RAY_OVERRIDE_NODE_ID_FOR_TESTING={node_id}".encode() in environ:
            os.kill(int(pid), 9)
            return node_id
    raise RuntimeError(f"no raylet process found for node {node_id}")


def run_autoscaling(
    *, max_nodes: int = 3, clients: int = 6, time_scale: float = 0.02, kill_node: bool = True, timeout_s: float = 300,
    system_config: dict | None = None, settle_s: float = 5.0,
) -> dict:  # fmt: skip
    """The run above; ``system_config``: Ray's own settings for the head (``ray start --system-config``),
    e.g. a shorter node health check than Ray's 3 s x 5 misses, so that a lost node is seen sooner;
    ``settle_s``: how long the load runs on the scaled-up tier before a node is killed, and again
    before the load stops."""
    cluster_settings, args = shipped_configs(max_nodes, time_scale)
    interval = min(0.5, args["look_back_period_s"] / 2)
    env = {REPORT_INTERVAL_ENV: str(interval), "OMP_NUM_THREADS": "1", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # this process's (Serve's controller reads its interval): given back at the end
    fake = FakeNodesCluster(head_resources={"CPU": 0}, **cluster_settings)
    fake.start(_system_config=system_config, override_env=env)
    report: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "settings": {"cluster": cluster_settings, "tier": args,
                    "clients": clients, "time_scale": time_scale, "kill_node": kill_node, "ray_system_config": system_config,
                    "settle_s": settle_s}, "phases": {}}  # fmt: skip
    try:
        ray.init("auto", log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")  # one host: one proxy
        watch = Watch()
        report["phases"]["before"] = watch.now()
        started = time.monotonic()
        serve.run(build_app(ServeConfig.from_dict(args)), name=APP, route_prefix="/")
        report["phases"]["deployed_s"] = round(time.monotonic() - started, 1)
        url = f"http://127.0.0.1:{port}"
        report["phases"]["load_started"] = watch.now()["t"]
        load = Load(url, clients, watch.started)
        report["phases"]["scaled_up_s"] = round(watch.wait_for("replicas >= 2 on >= 2 nodes", lambda s: (s["replicas"] or 0) >= 2 and s["worker_nodes"] >= 2, timeout_s), 1)
        if kill_node:
            time.sleep(settle_s)
            serving, before = watch.now(), set(replica_actors())
            report["phases"]["killed_node"] = {"node": kill_node_of_a_replica(), "t": serving["t"]}
            seen = watch.wait_for("the lost node seen gone", lambda s: s["worker_nodes"] < serving["worker_nodes"], timeout_s)
            report["phases"]["node_seen_gone_s"] = round(seen, 1)
            back = watch.wait_for("the lost replica replaced (a new replica actor, as many running as before)",
                                  lambda s: (s["replicas"] or 0) >= serving["replicas"] and set(replica_actors()) - before, timeout_s)  # fmt: skip
            report["phases"]["replaced_s"] = round(seen + back, 1)
        time.sleep(settle_s)  # the load on the tier as it is now
        outcomes = load.stop()
        report["phases"]["load_stopped"] = watch.now()["t"]
        report["phases"]["scaled_down_s"] = round(watch.wait_for(f"replicas back to {args['min_replicas']} on one node", lambda s: s["replicas"] == args["min_replicas"]
                                                                 and s["worker_nodes"] == 1, timeout_s, hold_s=3.0), 1)  # fmt: skip
        with urllib.request.urlopen(url + "/", timeout=60) as response:
            report["kv_kept_at_the_end"] = json.loads(response.read())["kv_kept_requests"]
        report["phases"]["deleted"] = watch.now()["t"]
        serve.delete(APP)
        report["phases"]["emptied_s"] = round(watch.wait_for("no worker node", lambda s: s["worker_nodes"] == 0, timeout_s, hold_s=3.0), 1)
        watch.stop()
        report["phases"]["after"] = watch.now()
        report["trajectory"] = watch.samples
        failed = [o for o in outcomes if o["status"] != 200]
        report["outcomes"] = outcomes
        report["requests"] = {"sent": len(outcomes), "answered": len(outcomes) - len(failed), "failed": len(failed), "handoffs": sum(o["handoff"] for o in outcomes),
                              "errors": sorted({o["error"] for o in failed})[:20]}  # fmt: skip
        report["max_replicas"] = max(s["replicas"] or 0 for s in watch.samples)
        report["max_worker_nodes"] = max(s["worker_nodes"] for s in watch.samples)
        report["pending_to_serving_s"] = _pending_to_serving(watch.samples)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        fake.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return report


def _pending_to_serving(samples: list[dict]) -> list[float]:
    """For each rise of the running replicas: seconds since placement groups began to wait for it."""
    out, waiting_since, replicas = [], None, 0
    for s in samples:
        if s["pending_placement_groups"] and waiting_since is None:
            waiting_since = s["t"]
        if (s["replicas"] or 0) > replicas and waiting_since is not None:
            out.append(round(s["t"] - waiting_since, 1))
            waiting_since = s["t"] if s["pending_placement_groups"] else None
        replicas = s["replicas"] if s["replicas"] is not None else replicas
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in report["trajectory"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(t, [s["replicas"] or 0 for s in report["trajectory"]], where="post", label="replicas running")
    ax.step(t, [s["worker_nodes"] for s in report["trajectory"]], where="post", label="worker nodes alive")
    ax.step(t, [s["pending_placement_groups"] for s in report["trajectory"]], where="post", label="placement groups waiting", linestyle=":")
    phases = report["phases"]
    ax.axvspan(phases["load_started"], phases["load_stopped"], color="grey", alpha=0.12, label="load on")
    if "killed_node" in phases:
        ax.axvline(phases["killed_node"]["t"], color="red", linewidth=0.8, label="a node killed")
    ax.axvline(phases["deleted"], color="black", linewidth=0.8, linestyle="--", label="the tier deleted")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("seconds")
    ax.set_ylabel("count")
    ax.set_title("The tier on Ray's node autoscaler (fake nodes, CPU): load on, then off")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the summary JSON")
    parser.add_argument("--plot", type=Path, help="a PNG of replicas and nodes against time")
    parser.add_argument("--max-nodes", type=int, default=3, help="worker nodes at most (default 3)")
    parser.add_argument("--clients", type=int, default=6, help="clients sending prefills at once (default 6)")
    parser.add_argument("--time-scale", type=float, default=0.02, help="the shipped delays (Serve's, the idle timeout) times this (default 0.02)")
    parser.add_argument("--no-kill-node", action="store_true", help="leave out the node loss")
    args = parser.parse_args()
    report = run_autoscaling(max_nodes=args.max_nodes, clients=args.clients, time_scale=args.time_scale, kill_node=not args.no_kill_node)
    report["command"] = "python benchmarks/autoscaling.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False))
    report["failed_requests"] = [o for o in report.pop("outcomes") if o["status"] != 200]  # the answered ones are counted in "requests"
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(json.dumps({k: v for k, v in report.items() if k not in ("trajectory", "failed_requests")}, indent=1))


if __name__ == "__main__":
    main()
