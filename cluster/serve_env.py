"""The Ray Serve settings ForeSpark serves with: Serve's throughput-optimized mode, keeping its HTTP proxy.

Serve reads these from the environment when its processes import it, so they
must be set before `ray.init` starts a local cluster (`forespark serve` does),
or in the environment of `ray start` on every node (the shipped manifests do).

- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: Serve's documented high-throughput mode:
  user code and the handle's router on the replica's own event loop, gRPC
  between deployments, request-path logs buffered, the GC frozen after start.
  Each streamed chunk crosses two deployment boundaries (engine replica ->
  ingress -> proxy); on the 2-core CPU default these hops took as much CPU as
  both engines together before.
- `RAY_SERVE_ENABLE_DIRECT_INGRESS=0`: that mode would also move HTTP from the
  proxy to the ingress replica on a port from 30000 up, which needs HAProxy in
  front to be reachable on the serving port; we keep the proxy on `--port`.
- `RAY_SERVE_PROXY_USE_GRPC=1`: the proxy -> ingress hop over gRPC too (Serve
  derives this flag before applying the throughput mode, so it is set here).
- `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`: the proxy answers refusals
  itself while admission's gate is shut (`cluster/proxy_gate.py`).

Values already in the environment win, so an operator can turn any of them off.

A Ray that `forespark serve` starts itself also gets `LOCAL_RAY_ENV`:
- `RAY_metrics_report_interval_ms=2000`: its processes export metrics every 2 s
  instead of Ray's 10 s, so that a load test's per-replica account
  (`loadtest/server_metrics.py`) settles within seconds of the run. A cluster
  keeps Ray's default, which its Prometheus scrape interval matches.
- `RAY_worker_niceness=0`: Ray starts its workers at niceness 15, the HTTP
  proxy and the ingress among them, so on a host whose cores the engines fill
  (the CPU default) a refusal or a stream's chunk waited for the CPU behind
  engine steps. Workers start at 0 and the engine replicas lower themselves to
  `replica.niceness` (15). A cluster's `ray start` may set the same; without
  it every worker stays at 15, engines included, as before.
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "cluster.proxy_gate:proxy_middlewares",
}


LOCAL_RAY_ENV = {"RAY_metrics_report_interval_ms": "2000", "RAY_worker_niceness": "0"}


def serve_environment() -> dict[str, str]:
    """Set `SERVE_ENV` where unset; returns the values in effect."""
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in SERVE_ENV}


def local_ray_environment() -> dict[str, str]:
    """Set `LOCAL_RAY_ENV` where unset, before `ray.init` starts a local Ray; returns the values in effect."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in LOCAL_RAY_ENV}
