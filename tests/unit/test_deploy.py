"""Every YAML under deploy/ parses and has what its tool requires: the cluster launcher's file is
valid against Ray's own JSON schema, Serve config files (also the one inside the RayService) load
with Serve's schema and their args build a valid ServeConfig, the KubeRay manifests carry the keys
the CRDs require."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

pytest.importorskip("ray", reason="the deploy files are checked against Ray's own schemas")  # a GPU node may lack Ray
import ray.autoscaler  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from configs.secrets import loopback  # noqa: E402
from configs.serve import ServeConfig  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERAY = DEPLOY / "kuberay"


def _load(path):
    return yaml.safe_load(path.read_text())


def test_every_yaml_parses_and_each_is_checked_here():
    files = sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*.yaml"))
    assert files == ["cluster.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "kuberay/rayservice.yaml",
                     "serve-gpu-bench.yaml", "serve-tiny.yaml", "serve.yaml"]  # fmt: skip
    for name in files:
        assert isinstance(_load(DEPLOY / name), dict), name


def test_the_cluster_launcher_yaml_is_valid_against_rays_schema():
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = _load(DEPLOY / "cluster.yaml")
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu = [name for name, spec in types.items() if name != config["head_node_type"]]
    assert gpu and all(types[name]["max_workers"] > types[name]["min_workers"] for name in gpu)  # autoscaled
    assert config["idle_timeout_minutes"] > 0 and config["max_workers"] >= sum(types[n]["max_workers"] for n in gpu)


def _serve_configs():
    service = _load(KUBERAY / "rayservice.yaml")
    return {
        "serve.yaml": _load(DEPLOY / "serve.yaml"),
        "serve-tiny.yaml": _load(DEPLOY / "serve-tiny.yaml"),
        "serve-gpu-bench.yaml": _load(DEPLOY / "serve-gpu-bench.yaml"),
        "rayservice.yaml serveConfigV2": yaml.safe_load(service["spec"]["serveConfigV2"]),
    }


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_serve_configs_load_with_serves_schema_and_build_a_valid_serve_config(name):
    raw = _serve_configs()[name]
    schema = ServeDeploySchema.model_validate(raw)
    (application,) = schema.applications
    assert application.import_path == "cluster.serve:app"
    config = ServeConfig.from_dict(application.args)
    options = config.deployment_options()
    assert options["autoscaling_config"]["max_replicas"] >= options["autoscaling_config"]["min_replicas"] >= 1
    assert len(options["placement_group_bundles"]) == 1 + config.pool.workers_per_replica
    config.pool.model_config()  # the model exists and fits the TP degree


def _check_ray_cluster_spec(spec, autoscaled):
    assert spec["rayVersion"] == ray.__version__
    head = spec["headGroupSpec"]
    assert "rayStartParams" in head and head["template"]["spec"]["containers"][0]["image"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and "rayStartParams" in group
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        container = group["template"]["spec"]["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) > 0
    if autoscaled:
        assert spec["enableInTreeAutoscaling"] is True
        assert any(g["maxReplicas"] > g["minReplicas"] for g in spec["workerGroupSpecs"])


@pytest.mark.parametrize(("file", "kind"), [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob"), ("rayservice.yaml", "RayService")])
def test_kuberay_manifests_have_the_keys_their_crds_require(file, kind):
    manifest = _load(KUBERAY / file)
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind and manifest["metadata"]["name"]
    spec = manifest["spec"]
    if kind == "RayCluster":
        _check_ray_cluster_spec(spec, autoscaled=True)
    elif kind == "RayJob":
        assert spec["entrypoint"].startswith("python -m cluster.job ") and spec["shutdownAfterJobFinishes"] is True
        from cluster.job import parser

        parser().parse_args(spec["entrypoint"].split()[3:])  # the job accepts the entrypoint's options
        _check_ray_cluster_spec(spec["rayClusterSpec"], autoscaled=False)
    else:
        assert "serveConfigV2" in spec
        _check_ray_cluster_spec(spec["rayClusterConfig"], autoscaled=True)


def test_a_look_back_window_shorter_than_the_load_reports_is_refused_and_a_longer_one_builds_quietly(monkeypatch):
    """Serve averages each replica's reported load over ``look_back_period_s``: a window no longer than
    the report interval (Ray's environment variable) is refused with both values; a longer one, even
    under Serve's deprecated 10 s default, builds the application without Serve's FutureWarning."""
    import warnings

    from cluster.serve import build_app
    from configs.pool import PoolConfig

    monkeypatch.delenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", raising=False)  # Ray's default, 10 s
    with pytest.raises(ValueError, match=r"look_back_period_s \(5.0\) must be longer .* \(10.0 s, RAY_SERVE_REPLICA_AUTOSCALING"):
        ServeConfig(look_back_period_s=5.0)
    monkeypatch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    config = ServeConfig(pool=PoolConfig(device="cpu"), look_back_period_s=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_app(config)


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_shipped_configs_name_their_secrets_and_expose_no_kv_server_without_a_token(name):
    """Secrets are read from the environment or a file, never written in a config that gets committed,
    and a KV server bound beyond loopback has a token (ServeConfig refuses one without, too)."""
    (application,) = _serve_configs()[name]["applications"]
    args = application["args"]
    named = [args[key] for key in ("kv_token", "decode_api_key") if key in args] + list(args.get("api_keys", []))
    named += list(args.get("decode_api_keys", {}).values())
    assert all(isinstance(secret, dict) and set(secret) <= {"env", "file"} for secret in named), named
    config = ServeConfig.from_dict(args)
    assert loopback(config.kv_host) or config.kv_token is not None


def test_the_kuberay_service_fills_every_secret_variable_from_a_kubernetes_secret():
    service = _load(KUBERAY / "rayservice.yaml")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    wanted = {s["env"] for s in [application["args"].get("kv_token"), *application["args"].get("api_keys", [])] if s and "env" in s}
    assert wanted == {"MLAPOOL_KV_TOKEN", "MLAPOOL_API_KEY"}
    spec = service["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]] + [group["template"] for group in spec["workerGroupSpecs"]]
    for pod in pods:  # a Serve replica may run on any of them
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        assert wanted <= set(env) and all("secretKeyRef" in env[name]["valueFrom"] for name in wanted)


AUTOSCALING = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "look_back_period_s",
               "max_ongoing_requests")  # fmt: skip


def test_the_kuberay_service_autoscales_as_the_tested_configs_say():
    """The RayService's tier and node autoscaling are those of deploy/serve.yaml and deploy/cluster.yaml,
    which tests/ray/test_autoscaling.py runs (scaled down) on Ray's autoscaler."""
    def prefill(config):
        return next(a for a in config["applications"] if a["name"] == "prefill")["args"]

    service = _load(KUBERAY / "rayservice.yaml")["spec"]
    tier, tested = prefill(yaml.safe_load(service["serveConfigV2"])), prefill(_load(DEPLOY / "serve.yaml"))
    assert {k: tier.get(k) for k in AUTOSCALING} == {k: tested.get(k) for k in AUTOSCALING}
    launcher, cluster = _load(DEPLOY / "cluster.yaml"), service["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] and cluster["autoscalerOptions"]["idleTimeoutSeconds"] == launcher["idle_timeout_minutes"] * 60
    group = cluster["workerGroupSpecs"][0]
    assert group["maxReplicas"] >= tier["max_replicas"]  # room for every replica: one node each (tp x pcp GPUs, STRICT_PACK)



def test_a_decode_endpoint_not_vllms_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"decode_endpoint must be one of \['generate', 'completions'\], got 'tokens'"):
        ServeConfig(decode_endpoint="tokens")
    assert ServeConfig().decode_endpoint == "generate"


def test_a_decode_forward_not_known_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"decode_forward must be one of \['early', 'after_first_token'\], got 'late'"):
        ServeConfig(decode_forward="late")
    assert ServeConfig().decode_forward == "early"
