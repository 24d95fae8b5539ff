"""Locust users for ForeSpark SLO load tests (run by `forespark loadtest`; never imported into a Ray process).

    FORESPARK_LOADTEST_CONFIG=run.json locust -f loadtest/locustfile.py --headless [--processes N ...]

Arrivals are open loop: each Locust user is an independent Poisson source of
`rate / users` requests per second that sends each request in its own
greenlet, so arrivals never wait for the server (the superposition of the
users is a Poisson process at `rate`). Arrival times are drawn on an absolute
schedule: when this process is short of CPU a late arrival is sent as soon as
it can be and the next ones keep their planned times, so the offered rate
holds; how late each request left is recorded (`lag_ms`). `RateShape` sets
the number of users from the configured shape (constant, step, burst) and
ends the arrivals after `duration_s`; requests in flight then get `drain_s`
to finish. With `arrivals: closed` each user instead waits for its reply
(Locust's `constant_throughput`), the classic closed loop, kept as the
contrast.

Every request streams `/v1/completions` and is measured here, not by
Locust's own row (which times the response headers): TTFT, TPOT = (E2E -
TTFT) / (n - 1), ITL between stream events, and E2E are fired through
`events.request.fire` (request type `SLO`) and written as one CSV row per
request to `out_dir/requests-<pid>.csv`.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import random
import time
from pathlib import Path

import gevent
from gevent.pool import Group
from locust import FastHttpUser, LoadTestShape, constant_throughput, events, task

from loadtest.config import CONFIG_ENV, LoadTestConfig
from loadtest.report import ANSWERED_HEADER
from loadtest.workload import Workload

CONFIG = LoadTestConfig.model_validate_json(Path(os.environ[CONFIG_ENV]).read_text())
CSV_FIELDS = (
    "request_id", "domain", "status", "scheduled_s", "lag_ms", "start_s", "first_token_s", "end_s", "prompt_tokens", "output_tokens",
    "ttft_ms", "tpot_ms", "itl_mean_ms", "itl_max_ms", "e2e_ms", "error", "refused_by",
)
_user_ids = itertools.count()
_origin: float | None = None


def _arrival_origin(now: float) -> float:
    """When this process's first user started: time zero of its arrival schedule."""
    global _origin
    if _origin is None:
        _origin = now
    return _origin


class RequestLog:
    """This process's per-request CSV (one file per Locust process, merged by the report)."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = (out_dir / f"requests-{os.getpid()}.csv").open("w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_FIELDS)
        self.writer.writeheader()
        self.file.flush()

    def write(self, row: dict) -> None:
        self.writer.writerow(row)
        self.file.flush()


_log: RequestLog | None = None


def request_log() -> RequestLog:
    global _log
    if _log is None:
        _log = RequestLog(CONFIG.out_dir)
    return _log


def _sse_events(response):
    """Parsed `data:` payloads of an SSE body as each line arrives; None for `[DONE]`.

    Line by line from geventhttpclient's response: Locust's `iter_content(n)` waits until n bytes
    have arrived, which would time every token at the end of the stream.
    """
    raw = response._response
    while True:
        line = raw.readline(b"\n")
        if not line:
            return
        if line.startswith(b"data:"):
            data = line[5:].strip()
            yield None if data == b"[DONE]" else json.loads(data)


class OpenAIStreamUser(FastHttpUser):
    host = CONFIG.url
    concurrency = 1024  # connections of one user: its requests in flight at once
    network_timeout = 600.0
    connection_timeout = 30.0

    def on_start(self) -> None:
        # Seeded by (seed, Locust worker, user), never by process id: runs with the same seed and settings send
        # the same prompts on the same schedule (scaled by the rate), so variants compared at a rate see one load.
        stream = f"{CONFIG.seed}-{self.environment.runner.worker_index}-{next(_user_ids)}"
        self.rng = random.Random(stream)  # arrival gaps
        self.workload = Workload(CONFIG, random.Random(f"{stream}-prompts"))
        self.in_flight = Group()
        self.headers = {"Authorization": f"Bearer {CONFIG.api_key}"} if CONFIG.api_key else {}
        self._closed_wait = constant_throughput(CONFIG.rate_per_user())
        now = time.perf_counter()
        origin = _arrival_origin(now)
        # The users of the first spawn share this process's origin, so the schedule does not depend on the few
        # milliseconds spawning takes; a user added later (step, burst) starts from its own start.
        self.next_arrival = origin if now - origin < 1.0 else now
        self.arrivals_end = origin + CONFIG.duration_s
        if CONFIG.arrivals == "poisson":
            gevent.sleep(self.wait_time())  # memoryless: a new source's first arrival is one exponential gap away, not now

    def wait_time(self) -> float:
        if CONFIG.arrivals == "closed":
            return self._closed_wait(self)
        self.next_arrival += self.rng.expovariate(CONFIG.rate_per_user())
        return max(0.0, self.next_arrival - time.perf_counter())

    @task
    def arrive(self) -> None:
        if CONFIG.arrivals == "closed":
            self.send(time.perf_counter())
        elif self.next_arrival < self.arrivals_end:  # after it, only the shape's next tick is left to stop the users
            self.in_flight.spawn(self.send, self.next_arrival)

    def on_stop(self) -> None:
        self.in_flight.join(timeout=CONFIG.drain_s)
        self.in_flight.kill()

    def send(self, scheduled: float) -> None:
        """One request; `scheduled` is its planned arrival (perf_counter), which may lie before now."""
        domain, body = self.workload.next()
        row = {"request_id": f"{os.getpid()}-{id(body)}-{time.time_ns()}", "domain": domain, "status": 0, "error": ""}
        start, start_wall = time.perf_counter(), time.time()
        row.update(start_s=start_wall, scheduled_s=start_wall - (start - scheduled), lag_ms=max(0.0, start - scheduled) * 1000.0)
        first = last = None
        gaps: list[float] = []
        usage = None
        try:
            with self.client.post(
                "/v1/completions", json=body, headers=self.headers, stream=True, catch_response=True, name="/v1/completions (headers)"
            ) as response:
                row["status"] = response.status_code or 0
                if response.status_code != 200:
                    row["error"] = _error_text(response)
                    row["refused_by"] = response.headers.get(ANSWERED_HEADER, "")
                    response.failure(f"HTTP {response.status_code}")
                else:
                    for event in _sse_events(response):
                        if event is None:
                            break
                        if "error" in event:
                            row["status"] = int(event["error"].get("code") or 500)
                            row["error"] = str(event["error"].get("message", ""))[:200]
                            break
                        now = time.perf_counter()
                        if any(c.get("text") for c in event.get("choices", [])):
                            if first is None:
                                first = now
                            else:
                                gaps.append(now - last)
                            last = now
                        usage = event.get("usage") or usage
                    if row["status"] == 200 and (first is None or usage is None):
                        row["status"], row["error"] = 0, "stream ended without tokens or usage"
                    if row["status"] != 200:
                        response.failure(row["error"])
        except gevent.GreenletExit:  # drain time over: the request is abandoned (the server aborts it)
            row["status"], row["error"] = 0, "abandoned after the drain time"
            raise
        except Exception as e:  # connection refused, reset, timeout: recorded, the run goes on
            row["status"], row["error"] = 0, f"{type(e).__name__}: {e}"[:200]
        finally:
            end = time.perf_counter()
            self._record(row, start, start_wall, first, end, gaps, usage)

    def _record(self, row, start, start_wall, first, end, gaps, usage) -> None:
        e2e = (end - start) * 1000.0
        row.update(end_s=start_wall + (end - start), e2e_ms=e2e)
        ok = row["status"] == 200
        if ok:
            n = int(usage["completion_tokens"])
            ttft = (first - start) * 1000.0
            row.update(
                first_token_s=start_wall + (first - start), ttft_ms=ttft,
                prompt_tokens=int(usage["prompt_tokens"]), output_tokens=n,
                tpot_ms=(e2e - ttft) / (n - 1) if n > 1 else "",
                itl_mean_ms=1000.0 * sum(gaps) / len(gaps) if gaps else "",
                itl_max_ms=1000.0 * max(gaps) if gaps else "",
            )
        request_log().write(row)
        fire = self.environment.events.request.fire
        exception = None if ok else RuntimeError(f"{row['status']}: {row['error']}")
        fire(request_type="SLO", name=f"E2E {row['domain']}", response_time=e2e, response_length=row.get("output_tokens", 0), exception=exception)
        if ok:
            fire(request_type="SLO", name=f"TTFT {row['domain']}", response_time=row["ttft_ms"], response_length=0, exception=None)
            if row["tpot_ms"] != "":
                fire(request_type="SLO", name=f"TPOT {row['domain']}", response_time=row["tpot_ms"], response_length=0, exception=None)
            if row["itl_mean_ms"] != "":
                fire(request_type="SLO", name=f"ITL {row['domain']}", response_time=row["itl_mean_ms"], response_length=0, exception=None)


def _error_text(response) -> str:
    try:
        return str(json.loads(response.text)["error"]["message"])[:200]
    except Exception:
        return (response.text or "")[:200]


class RateShape(LoadTestShape):
    """Users over time from the configured shape; stops the arrivals after `duration_s`."""

    def tick(self):
        t = self.get_run_time()
        if t >= CONFIG.duration_s:
            return None
        return CONFIG.users_at(t), 10_000


@events.quitting.add_listener
def _close_log(environment, **_kwargs) -> None:
    if _log is not None:
        _log.file.close()
