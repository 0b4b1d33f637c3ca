"""`strata-jax serve --replicas N`: N engine replicas as one Ray Serve application behind one
endpoint.

    ingress "strata-ingress"  ->  deployments "strata-0" .. "strata-{N-1}", one replica each

Why N one-replica deployments and not one deployment of N replicas: routing by conversation needs a
stable name to hash on. A replica of a multi-replica deployment gets a new id when Ray replaces it,
so a hash over replica ids would move its conversations for good (and a custom request router is an
alpha API); "strata-0" stays "strata-0" across Ray's restarts, so a conversation goes back to its
replica when it is up again. Why plain `serve.deployment` and not Ray Serve LLM's
`build_openai_app`: that one drives vLLM engines through its own OpenAI layer; ours is a whole
server (supervisor, fault ledger, limits, llama.cpp's routes) that a replica runs as it is, so all a
replica adds is the process, the health check and the byte relay.

Ray is imported only here, and only when this runs: the engine and `serve` without --replicas never
need it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence

from ... import envs
from .replicas import ReplicaServer

PIP_HINT = "pip install 'ray[serve]==2.60.0'  (or: pip install 'strata-jax[ray]')"
APP_NAME = "strata"
# The environment a replica's server gets from the process that deploys it (a Ray cluster's workers
# have their own): our variables, JAX's and XLA's.
_PASSED_ENV = ("STRATA", "JAX_", "XLA_", "CUDA_VISIBLE_DEVICES", "HF_", "TPU_")


def need_ray():
    """Ray Serve, or a ValueError that says how to install it (the CLI prints it as its error)."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError("--replicas runs its replicas on Ray Serve, which is not installed here "
                         f"({e}): {PIP_HINT}") from None
    return ray, serve


def replica_names(n: int) -> list[str]:
    return [f"strata-{i}" for i in range(n)]


def build_app(server_args: Sequence[str], replicas: int, *, health_period_s: float = 2.0,
              health_grace_s: float = 60.0, accept_timeout_s: float = 10.0,
              replica_cpus: float = 0.0, api_key: str | None = None, max_body_bytes: int = 8 << 20):
    """The Ray Serve application (bind it with serve.run). `server_args`: `strata-jax serve`'s
    arguments for each replica's server, without --host and --port (each replica listens on
    127.0.0.1 on a port of its own). replica_cpus: Ray's CPU count a replica claims; 0 by default,
    since the work is in its server process, outside Ray's accounting (on a cluster, raise it, or
    give num_gpus, to spread replicas over machines). api_key, max_body_bytes: the servers' own,
    which the ingress checks before it reads a body."""
    _, serve = need_ray()
    from .replica_ingress import ReplicaIngress  # starlette comes with ray[serve]

    if replicas < 1:
        raise ValueError(f"--replicas {replicas}: must be 1 or more")
    env = {k: v for k, v in envs.environ_with().items() if k.startswith(_PASSED_ENV)}
    names = replica_names(replicas)
    handles = [
        serve.deployment(ReplicaServer).options(
            name=name, num_replicas=1,
            # our server has its own queue bound (--max-queue: 503 past it)
            max_ongoing_requests=10_000,
            health_check_period_s=health_period_s,
            health_check_timeout_s=max(10.0, 2 * health_period_s),
            graceful_shutdown_timeout_s=30, ray_actor_options={"num_cpus": replica_cpus},
        ).bind(name, list(server_args), env, health_grace_s=health_grace_s)
        for name in names
    ]
    ingress = serve.deployment(ReplicaIngress).options(
        name="strata-ingress", num_replicas=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(handles, names, accept_timeout_s=accept_timeout_s, api_key=api_key,
                        max_body_bytes=max_body_bytes)


def start(server_args: Sequence[str], replicas: int, host: str = "127.0.0.1", port: int = 8000,
          ray_init: dict | None = None, **options) -> str:
    """Start Ray (or join $RAY_ADDRESS's cluster), Serve's HTTP proxy on host:port, and the
    application; returns its URL once every replica's server is ready. Undo with stop()."""
    _, serve = need_ray()
    init_ray(ray_init)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(server_args, replicas, **options), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def init_ray(ray_init: dict | None = None):
    """Start a local Ray without its dashboard: the dashboard's job API (127.0.0.1:8265) runs any
    code it is sent, to any local user or a page that reaches it (/cors-proxy), so it is not
    started. Joining a cluster ($RAY_ADDRESS) leaves that cluster's own settings alone (Ray refuses
    the option there). Returns ray.init's context (None when Ray was started already)."""
    ray, _ = need_ray()
    if ray.is_initialized():
        return None
    joins = bool(envs.ray_address()) or (ray_init or {}).get("address") not in (None, "local")
    return ray.init(**({} if joins else {"include_dashboard": False}), **(ray_init or {}))


def stop() -> None:
    _, serve = need_ray()
    serve.delete(APP_NAME)


def run_replicas(server_args: Sequence[str], replicas: int, host: str, port: int,
                 api_key: str | None = None, max_body_bytes: int = 8 << 20) -> int:
    """The CLI's `serve --replicas N`: serve until Ctrl-C, then take the application and Ray
    down."""
    ray, serve = need_ray()
    if "," in host:
        raise ValueError(f"--host {host}: with --replicas, one address (Ray Serve's proxy listens "
                         "on one)")
    try:
        url = start(server_args, replicas, host, port, api_key=api_key,
                    max_body_bytes=max_body_bytes)
        # after ray.init (it sets its own): `kill PID` acts as Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
        print(f"strata-jax: {replicas} replicas ({', '.join(replica_names(replicas))}) behind "
              f"{url} (GET {url}/health shows each); Ctrl-C stops them", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:                 # the replicas stop their servers; a local Ray started here goes too
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def replica_argv(argv: Sequence[str], options: Sequence[str], model: str | None) -> list[str]:
    """`serve`'s arguments less --replicas, --host and --port (abbreviated or not, `--port 1` or
    `--port=1`), with `model` first when the command named none (the default model, fetched once by
    the caller): what each replica's own server is started with. `options`: every option string
    `serve` takes."""
    rest, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = token.partition("=")
        # argparse takes unique abbreviations
        matches = [o for o in options if o.startswith(name)]
        full = name if name in options else (matches[0] if len(matches) == 1 else None)
        if token.startswith("--") and full in ("--replicas", "--host", "--port"):
            skip = not eq
            continue
        rest.append(token)
    return ([model] if model else []) + rest

