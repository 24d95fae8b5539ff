"""What one refused request costs the host's CPUs (`forespark overload --url URL --refusal-cpu`).

Under overload most requests are refused, and on a host whose cores the engines share with the serving path
each refusal takes CPU from them: the simulator's host model charges it (`forespark simulate ...
--refusal-cpu-ms`), and this measures it. With the server idle, the host's busy CPU time (`/proc/stat`) over
a quiet interval gives the baseline. Then `requests` completions that admission must refuse go out from a few
client threads: each carries a TTFT SLO of a microsecond (`X-SLO-TTFT-Ms`), which no replica can meet, so the
ingress refuses it before reading its body and the gate stays open (cluster/admission.py). The busy time above
the baseline, over the refusals, is one refusal's CPU: Serve's proxy's, the ingress's and this client's (the
load generator's share, as in an overload run on the same host). Only meaningful for a server on this host.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel

TTFT_HEADER = "x-slo-ttft-ms"  # a request's own TTFT SLO (docs/overload.md)
IMPOSSIBLE_TTFT_MS = "0.001"


class RefusalCPU(BaseModel):
    requests: int
    refused: int
    seconds: float
    baseline_cores: float  # busy cores while nothing was sent
    busy_cores: float  # ... and while the refusals went out
    refusal_cpu_ms: float  # host CPU per refusal above the baseline


def busy_seconds(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds the host's cores have spent busy (not idle, not waiting for I/O) since boot."""
    fields = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure_refusal_cpu(url: str, model: str = "forespark", api_key: str | None = None, requests: int = 500,
                        clients: int = 4, quiet_s: float = 3.0) -> RefusalCPU:
    """Raises RuntimeError when the server does not refuse the probes (admission off, or another answer)."""
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers = {**auth, TTFT_HEADER: IMPOSSIBLE_TTFT_MS}
    body = {"model": model, "prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=url.rstrip("/"), timeout=60.0) as client:
        # A served request first: admission decides only once the router has its replicas' stats.
        first = client.post("/v1/completions", json=body, headers=auth)
        if first.status_code != 200:
            raise RuntimeError(f"a plain completion got {first.status_code}: {first.text[:200]}")
        time.sleep(1.0)
        t0, b0 = time.perf_counter(), busy_seconds()
        time.sleep(quiet_s)
        t1, b1 = time.perf_counter(), busy_seconds()
        with ThreadPoolExecutor(clients) as pool:
            statuses = list(pool.map(lambda _: client.post("/v1/completions", json=body, headers=headers).status_code,
                                     range(requests)))
        t2, b2 = time.perf_counter(), busy_seconds()
    refused = statuses.count(429)
    if refused < requests:
        others = sorted({s for s in statuses if s != 429})
        raise RuntimeError(f"{requests - refused} of {requests} requests with an impossible TTFT SLO were not refused "
                           f"(statuses {others}): is admission on (router.admission.enabled)?")
    baseline = (b1 - b0) / (t1 - t0)
    busy = (b2 - b1) / (t2 - t1)
    return RefusalCPU(requests=requests, refused=refused, seconds=t2 - t1, baseline_cores=baseline, busy_cores=busy,
                      refusal_cpu_ms=max(busy - baseline, 0.0) * (t2 - t1) * 1000.0 / refused)
