"""Configuration of the prefill tier as a Ray Serve application (``cluster.serve``), validated on creation.

A :class:`ServeConfig` holds the pool each replica runs (:class:`~configs.pool.PoolConfig`) and
what Serve needs around it: autoscaling bounds and delays, request limits and the KV handoff
endpoint. :meth:`ServeConfig.deployment_options` turns both into the options of ``serve.deployment``:
each Serve replica is one placement group, ``[replica actor] + tp * pcp`` worker bundles.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from configs.pool import PoolConfig
from configs.secrets import Secret, loopback


REPORT_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"
DECODE_ENDPOINTS = ("generate", "completions")  # ServeConfig.decode_endpoint
DECODE_FORWARDS = ("early", "after_first_token")  # ServeConfig.decode_forward


def load_report_interval_s() -> float:
    """How often Serve replicas report their load: Ray's ``RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S``
    (read by Serve's processes; default 10 s)."""
    return float(os.environ.get(REPORT_INTERVAL_ENV, 10.0))


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The prefill tier on Ray Serve.

    pool                     the pool of every replica (its ``replicas`` must be 1: Serve adds replicas)
    name                     deployment name, also the ``pool`` tag of the metrics
    min_replicas, max_replicas   autoscaling bounds (equal: a fixed number of replicas)
    target_ongoing_requests  requests per replica the autoscaler aims at
    upscale_delay_s, downscale_delay_s   how long demand must stay above / below target first
    look_back_period_s       the window over which replicas' load is averaged; longer than the interval
                             at which they report it (:func:`load_report_interval_s`)
    max_ongoing_requests     requests one replica takes at once (more wait in Serve's queue)
    max_body_bytes           larger request bodies get 413
    replica_cpus             CPUs of the replica actor itself (HTTP, scheduling; not the workers)
    kv_host, kv_port         where each replica's KV server listens (127.0.0.1: this node only;
                             0.0.0.0: tickets then name the node's address); port 0 = any free one
    kv_token                 the secret a decode server must present (``configs.secrets``: {env: NAME},
                             {file: PATH}); required when kv_host is not a loopback address: a receiver
                             with it reads the pool's KV (None: none, loopback only)
    api_keys                 secrets a client must present as ``Authorization: Bearer KEY`` on
                             ``/prefill``, ``/v1/*`` and ``GET /`` (none: no key asked)
    decode_api_key           the key sent to every decode server as ``Authorization: Bearer`` (vLLM's
                             ``--api-key``; None: none)
    decode_api_keys          per decode server (its URL as in decode_servers), a key in place of decode_api_key
    kv_ttl_s                 KV that no decode server claims within this long is freed
    decode_servers           base URLs of the vLLM decode servers behind ``/v1/completions`` and
                             ``/v1/chat/completions`` (none: those endpoints answer 503)
    served_model_name        the ``model`` clients name (default: the pool's checkpoint path, or its
                             model name), as vLLM's ``--served-model-name``
    decode_model_name        the model the decode servers serve (default: ``served_model_name``)
    tokenizer                where the OpenAI endpoints' tokenizer and chat template are (default:
                             the pool's checkpoint; without one, prompts must be token ids)
    decode_timeout_s         longest wait for the next bytes of a decode server's answer
    decode_resumptions       times one answer goes on on another decode server after its server broke
                             it off (``cluster.decode_answer``; 0: the client gets an error event)
    decode_probe_interval_s  how often an ejected decode server's ``/health`` is asked, to take it back
    decode_endpoint          how an answer whose first token the tier sampled is asked of the decode
                             servers: ``generate`` (vLLM's ``/inference/v1/generate``, token ids, the
                             text made by the tier: ``cluster.decode_tokens``) or ``completions``
                             (``/v1/completions``, vLLM detokenizing); other answers use completions
    decode_forward           when a streamed answer whose first token the tier samples goes to its decode
                             server: ``early`` (as its prefill is submitted, so that vLLM takes it in
                             while the pool prefills; vLLM then generates the tier's first token again,
                             which needs ``--logits-processors kv.vllm_first_token:TierFirstToken`` on
                             the decode servers: ``kv.vllm_first_token``) or ``after_first_token`` (its
                             prompt followed by that token, once sampled: for decode servers that cannot
                             load the processor, such as vLLM with speculative decoding)
    """

    pool: PoolConfig = field(default_factory=PoolConfig)
    name: str = "mlapool-prefill"
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    max_ongoing_requests: int = 32
    max_body_bytes: int = 16 << 20
    replica_cpus: float = 1.0
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_token: Secret | None = None
    api_keys: tuple[Secret, ...] = ()
    decode_api_key: Secret | None = None
    decode_api_keys: dict[str, Secret] = field(default_factory=dict)
    kv_ttl_s: float = 300.0
    decode_servers: tuple[str, ...] = ()
    served_model_name: str | None = None
    decode_model_name: str | None = None
    tokenizer: str | None = None
    decode_timeout_s: float = 600.0
    decode_resumptions: int = 2
    decode_probe_interval_s: float = 1.0
    decode_endpoint: str = "generate"
    decode_forward: str = "early"

    def __post_init__(self) -> None:
        if not isinstance(self.pool, PoolConfig):
            raise TypeError(f"serve config: pool must be a PoolConfig, got {type(self.pool).__name__}")
        if self.pool.replicas != 1:
            raise ValueError(f"serve config: pool.replicas must be 1 (Serve scales replicas), got {self.pool.replicas}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"serve config: need 0 <= min_replicas <= max_replicas >= 1, got {self.min_replicas}, {self.max_replicas}")
        positive = ("target_ongoing_requests", "look_back_period_s", "max_ongoing_requests", "max_body_bytes", "replica_cpus", "kv_ttl_s", "decode_timeout_s",
                    "decode_probe_interval_s")  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"serve config: {name} must be positive, got {getattr(self, name)!r}")
        if type(self.decode_resumptions) is not int or self.decode_resumptions < 0:
            raise ValueError(f"serve config: decode_resumptions must be an integer >= 0, got {self.decode_resumptions!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"serve config: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.look_back_period_s <= load_report_interval_s():
            raise ValueError(
                f"serve config: look_back_period_s ({self.look_back_period_s}) must be longer than the interval at which "
                f"replicas report their load ({load_report_interval_s()} s, {REPORT_INTERVAL_ENV})"
            )
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"serve config: kv_port must be in [0, 65535], got {self.kv_port}")
        if isinstance(self.decode_servers, str) or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.decode_servers):
            raise ValueError(f"serve config: decode_servers must be a list of http(s):// base URLs, got {self.decode_servers!r}")
        object.__setattr__(self, "decode_servers", tuple(self.decode_servers))
        if self.decode_endpoint not in DECODE_ENDPOINTS:
            raise ValueError(f"serve config: decode_endpoint must be one of {list(DECODE_ENDPOINTS)}, got {self.decode_endpoint!r}")
        if self.decode_forward not in DECODE_FORWARDS:
            raise ValueError(f"serve config: decode_forward must be one of {list(DECODE_FORWARDS)}, got {self.decode_forward!r}")
        self._check_secrets()

    def _check_secrets(self) -> None:
        """Secrets in their form (``configs.secrets.Secret``), and no KV server open to the network
        without a token."""
        if self.kv_token is not None:
            object.__setattr__(self, "kv_token", Secret.of(self.kv_token, "serve config: kv_token"))
        if self.decode_api_key is not None:
            object.__setattr__(self, "decode_api_key", Secret.of(self.decode_api_key, "serve config: decode_api_key"))
        if isinstance(self.api_keys, (str, dict, Secret)) or not isinstance(self.api_keys, (list, tuple)):
            raise ValueError("serve config: api_keys must be a list of secrets ({env: NAME}, {file: PATH})")
        object.__setattr__(self, "api_keys", tuple(Secret.of(k, f"serve config: api_keys[{i}]") for i, k in enumerate(self.api_keys)))
        if not isinstance(self.decode_api_keys, dict) or set(self.decode_api_keys) - set(self.decode_servers):
            extra = sorted(set(self.decode_api_keys) - set(self.decode_servers)) if isinstance(self.decode_api_keys, dict) else self.decode_api_keys
            raise ValueError(f"serve config: decode_api_keys must map URLs of decode_servers to secrets; not among them: {extra}")
        object.__setattr__(self, "decode_api_keys", {url: Secret.of(k, f"serve config: decode_api_keys[{url}]") for url, k in self.decode_api_keys.items()})
        if self.kv_token is None and not loopback(self.kv_host):
            raise ValueError(
                f"serve config: kv_host {self.kv_host!r} opens the KV server to the network without a kv_token: anyone who "
                "reaches it could read the KV of users' prompts. Set kv_token: {env: MLAPOOL_KV_TOKEN} (the same secret "
                "in the decode servers' kv_connector_extra_config token_env), or bind kv_host 127.0.0.1"
            )

    def decode_key(self, url: str) -> Secret | None:
        """The key sent to the decode server at ``url``."""
        return self.decode_api_keys.get(url, self.decode_api_key)

    @property
    def model_name(self) -> str:
        """The ``model`` clients of the OpenAI endpoints name."""
        return self.served_model_name or self.pool.checkpoint or self.pool.model

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ServeConfig:
        """From the ``args`` of a Serve config file: these fields, with ``pool`` a dict of PoolConfig fields;
        its secrets named ({env: VARIABLE}, {file: PATH}), never written inline."""
        if not isinstance(raw, dict):
            raise TypeError(f"serve config: expected a mapping, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"serve config: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
        inline = [key for key in ("kv_token", "decode_api_key") if isinstance(raw.get(key), str)]
        inline += [f"api_keys[{i}]" for i, key in enumerate(raw.get("api_keys") or []) if isinstance(key, str)]
        inline += [f"decode_api_keys[{url}]" for url, key in (raw.get("decode_api_keys") or {}).items() if isinstance(key, str)]
        if inline:  # a config file gets committed, shown, logged: it names its secrets, never holds them
            raise ValueError(f"serve config: {', '.join(inline)} written inline; name each secret as {{env: VARIABLE}} or {{file: PATH}}")
        pool = raw.get("pool", {})
        pool_fields = {f.name for f in dataclasses.fields(PoolConfig)}
        if not isinstance(pool, dict) or set(pool) - pool_fields:
            bad = sorted(set(pool) - pool_fields) if isinstance(pool, dict) else pool
            raise ValueError(f"serve config: pool has unknown keys {bad}; valid: {sorted(pool_fields)}")
        return cls(**{**raw, "pool": PoolConfig(**pool)})

    @property
    def uses_gpus(self) -> bool:
        """Whether worker bundles hold a GPU: ``pool.use_gpus``, or when unset, unless the device is the CPU."""
        return self.pool.use_gpus if self.pool.use_gpus is not None else self.pool.device != "cpu"

    def deployment_options(self) -> dict[str, Any]:
        """Options of ``serve.deployment``: autoscaling, limits and the replica's placement group."""
        worker = {"CPU": self.pool.worker_cpus, **({"GPU": 1} if self.uses_gpus else {})}
        return {
            "name": self.name,
            "max_ongoing_requests": self.max_ongoing_requests,
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "initial_replicas": max(self.min_replicas, 1),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
            },
            "ray_actor_options": {"num_cpus": self.replica_cpus},
            "placement_group_bundles": [{"CPU": self.replica_cpus}] + [worker] * self.pool.workers_per_replica,
            "placement_group_strategy": self.pool.placement,
        }
