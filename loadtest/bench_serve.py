"""`forespark bench serve`: tokens per second of each speculation policy as served, one `forespark serve` per policy.

Each policy gets its own application (one replica, that policy; `compare`'s server helpers start and stop it)
and, after a warm-up that is not counted, each prompt set in turn: `requests` greedy completions of `max_tokens`
tokens each (`ignore_eos`, so every request produces all of them), `concurrency` in flight (closed loop), over
real HTTP. A set's rate is its completion tokens over its wall time; the median per-request rate (a request's
tokens over its latency) is reported beside it.

Repeats run the whole policy rotation again, in reverse order every other time (A B C, C B A, ...) so a drift
of the machine falls on every policy alike; rows are medians over repeats. Two protocols, as `compare`:

- **interleaved** (the default on CPU with repeats): every policy's server starts once and stays up, paused
  (SIGSTOP on its process tree, no CPU taken) while the others are measured. A start costs about a minute on the
  2-core machines and an embedded-model server about 2.4 GiB (PSS of its tree; three up at once: about 7 GiB of
  24), so P servers up at once cost P starts instead of P x R and fit.
- **sequential** (the default with one repeat, where it costs the same starts and holds one server's memory
  at a time, and for GPU replicas, whose memory a paused server keeps): a fresh server per policy and repeat.

Every stopped server is checked: its exit status after SIGTERM and any process of its tree still alive after
it exited (those are killed by pid and reported).

The rows are only as good as the machine is quiet: the replicas run at Ray's worker niceness, so any other job on
these 2 cores takes most of their CPU (measured: 8-60 tok/s for `ar` beside a training job; issue 23 reports ~300 on a quiet machine). The result
records the load average at the start and the end.

Talks to the system over HTTP only; the prompts are the shipped workload files (data, read as in the load test).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from loadtest.compare import Server, ServerStarter, Variant, default_protocol, variant_app_config
from loadtest.config import SLOConfig
from loadtest.workload import shipped_prompts

POLICIES = ("ar", "static", "dspark", "wcs")
FIB_PROMPT = "def fibonacci(n):"
# Code whose continuation is the same token again and again: the case a drafter gets right every time.
REPETITIVE_PROMPT = "".join(f"x{i} = [{', '.join(['1'] * 24)}]\n" for i in range(4)) + "x4 = [1, 1, 1,"
PROMPT_SETS = ("code", "prose", "fib", "repetitive")
Protocol = Literal["interleaved", "sequential"]


def prompt_sets(names: Sequence[str], requests: int) -> dict[str, list[str]]:
    """`requests` prompts per named set: the shipped workload's first ones (cycled), or one prompt repeated."""
    unknown = [n for n in names if n not in PROMPT_SETS]
    if unknown or not names:
        raise ValueError(f"unknown prompt sets {unknown}; choose from {','.join(PROMPT_SETS)}")
    if requests < 1:
        raise ValueError("requests must be >= 1")
    shipped = shipped_prompts() if {"code", "prose"} & set(names) else {}
    out = {}
    for name in names:
        if name in ("code", "prose"):
            pool = [p["prompt"] for p in shipped[name]]
            out[name] = [pool[i % len(pool)] for i in range(requests)]
        else:
            out[name] = [FIB_PROMPT if name == "fib" else REPETITIVE_PROMPT] * requests
    return out


class SetRun(BaseModel):
    """One prompt set sent once to one server."""

    requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float  # completion tokens / wall time of the set
    per_request_tokens_per_s: float  # median over requests of tokens / latency
    errors: int = 0  # requests without a 200 reply
    short: int = 0  # requests that produced fewer than max_tokens tokens
    first_error: str | None = None


def set_run(results: list[tuple[float, int] | str], wall_s: float, max_tokens: int) -> SetRun:
    """A set's figures from its requests: (latency s, completion tokens) each, or an error message."""
    done = [r for r in results if not isinstance(r, str)]
    errors = [r for r in results if isinstance(r, str)]
    tokens = sum(n for _, n in done)
    return SetRun(
        requests=len(results), completion_tokens=tokens, wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        per_request_tokens_per_s=statistics.median([n / s for s, n in done if s > 0]) if done else 0.0,
        errors=len(errors), short=sum(1 for _, n in done if n < max_tokens), first_error=errors[0] if errors else None,
    )


async def _send_set(url: str, prompts: list[str], concurrency: int, max_tokens: int, model: str, api_key: str | None,
                    timeout_s: float) -> SetRun:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pending = iter(prompts)
    results: list[tuple[float, int] | str] = []

    async def user(client: httpx.AsyncClient) -> None:
        for prompt in pending:  # closed loop: the next request goes out when this user's last one is back
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            start = time.perf_counter()
            try:
                reply = await client.post(f"{url}/v1/completions", json=body, headers=headers)
                latency = time.perf_counter() - start
                if reply.status_code != 200:
                    results.append(f"HTTP {reply.status_code}: {reply.text[:300]}")
                else:
                    results.append((latency, int(reply.json()["usage"]["completion_tokens"])))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                results.append(f"{type(e).__name__}: {e}")

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - start
    return set_run(results, wall, max_tokens)


def send_set(url: str, prompts: list[str], concurrency: int, max_tokens: int, model: str = "forespark",
             api_key: str | None = None, timeout_s: float = 600.0) -> SetRun:
    """Sends `prompts` as greedy completions with `concurrency` requests in flight; the set's figures."""
    return asyncio.run(_send_set(url.rstrip("/"), prompts, concurrency, max_tokens, model, api_key, timeout_s))


class Row(BaseModel):
    """One (policy, prompt set, concurrency): medians over repeats."""

    policy: str
    prompts: str
    concurrency: int
    tokens_per_s: float
    per_request_tokens_per_s: float
    tokens_per_s_repeats: list[float]
    requests: int  # per repeat
    max_tokens: int
    completion_tokens: int  # over all repeats
    errors: int  # over all repeats
    short: int  # over all repeats


class ServerRun(BaseModel):
    """One server's life: how long it took to start and how it stopped."""

    policy: str
    start_s: float
    exit_code: int | None  # 0: it stopped on SIGTERM; negative: killed by that signal (SIGKILL after a timeout)
    clean_exit: bool
    leftover_pids: list[int]  # processes of its tree alive after it exited, killed here
    log: str | None = None


class BenchServeResult(BaseModel):
    protocol: Protocol
    repeats: int
    concurrency: int
    requests: int
    max_tokens: int
    rows: list[Row]
    ratios: dict[str, dict[str, float | None]]  # per prompt set: wcs_vs_ar, wcs_vs_static, wcs_vs_best
    best_baseline: dict[str, str | None]  # per prompt set: the fastest non-wcs policy
    servers: list[ServerRun]
    load_average: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average at the start and at the end
    cpus: int = 0


def rows_from_runs(runs: dict[tuple[str, str], list[SetRun]], concurrency: int, max_tokens: int) -> list[Row]:
    """{(policy, prompts): one SetRun per repeat} -> rows of medians, in the order given."""
    rows = []
    for (policy, prompts), reps in runs.items():
        rows.append(Row(
            policy=policy, prompts=prompts, concurrency=concurrency,
            tokens_per_s=statistics.median(r.tokens_per_s for r in reps),
            per_request_tokens_per_s=statistics.median(r.per_request_tokens_per_s for r in reps),
            tokens_per_s_repeats=[r.tokens_per_s for r in reps], requests=reps[0].requests, max_tokens=max_tokens,
            completion_tokens=sum(r.completion_tokens for r in reps), errors=sum(r.errors for r in reps),
            short=sum(r.short for r in reps),
        ))
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def ratios(rows: list[Row]) -> tuple[dict[str, dict[str, float | None]], dict[str, str | None]]:
    """Per prompt set: `wcs` tokens/s over `ar`'s, `static`'s and the best non-wcs policy's (None where one is
    missing); and which policy that best one is."""
    out: dict[str, dict[str, float | None]] = {}
    best_of: dict[str, str | None] = {}
    for prompts in dict.fromkeys(r.prompts for r in rows):
        rate = {r.policy: r.tokens_per_s for r in rows if r.prompts == prompts}
        others = {p: v for p, v in rate.items() if p != "wcs"}
        best = max(others, key=others.__getitem__) if others else None
        best_of[prompts] = best
        out[prompts] = {
            "wcs_vs_ar": _ratio(rate.get("wcs"), rate.get("ar")),
            "wcs_vs_static": _ratio(rate.get("wcs"), rate.get("static")),
            "wcs_vs_best": _ratio(rate.get("wcs"), others.get(best) if best else None),
        }
    return out, best_of


def format_bench_serve(result: BenchServeResult) -> str:
    lines = [
        f"protocol {result.protocol}, {result.repeats} repeat(s), concurrency {result.concurrency}, "
        f"{result.requests} requests x {result.max_tokens} tokens per set; load average {result.load_average[0]:.1f} at the "
        f"start, {result.load_average[1]:.1f} at the end, {result.cpus} CPUs (other work on the machine skews every row)",
        f"{'policy':>7} {'prompts':>10} {'tok/s':>8} {'per-req tok/s':>13} {'errors':>6}  tok/s per repeat",
    ]
    for r in result.rows:
        reps = ", ".join(f"{v:.0f}" for v in r.tokens_per_s_repeats)
        lines.append(f"{r.policy:>7} {r.prompts:>10} {r.tokens_per_s:>8.1f} {r.per_request_tokens_per_s:>13.1f} {r.errors:>6}  {reps}")
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for prompts, values in result.ratios.items():
        best = result.best_baseline.get(prompts)
        lines.append(f"{prompts}: " + ", ".join(f"{k} {fmt(v)}" for k, v in values.items()) + (f" (best: {best})" if best else ""))
    for s in result.servers:
        if not s.clean_exit or s.leftover_pids:
            lines.append(f"WARNING: the {s.policy} server exited with {s.exit_code}; leftover processes killed: {s.leftover_pids} (log {s.log})")
    return "\n".join(lines)


def policy_app_config(base: dict[str, Any], policy: str) -> dict[str, Any]:
    """`base` with one engine replica (unless it sets its own count) serving `policy`; router as `compare`'s, without
    SLO admission unless `base` asks for it: the bench times requests, and a refused one would be missing from the
    figure (a static server, slowed by the others starting beside it, refused its warm-up request with 429)."""
    config = variant_app_config(base, Variant(name=policy, policy=policy, router="acceptance_headroom"), SLOConfig())
    config["replica"].setdefault("num_replicas", 1)
    config["router"].setdefault("admission", {}).setdefault("enabled", False)
    return config


def _process_tree(server: Server) -> list:
    import psutil

    proc = getattr(server, "proc", None)
    if proc is None:
        return []
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def checked_server(start_server: ServerStarter, app: dict[str, Any], work: Path, record: Callable[[ServerRun], None],
                   policy: str, linger_s: float = 30.0) -> Iterator[Server]:
    """`start_server`, recording how long it took to start and, once stopped, its exit status and any process of
    its tree that outlived it (given `linger_s` to go, then killed by pid)."""
    import psutil

    t0 = time.monotonic()
    tree: list = []
    server = None
    try:
        with start_server(app, work) as server:
            start_s = time.monotonic() - t0
            try:
                yield server
            finally:
                tree = _process_tree(server)  # the tree as it is now: Ray's workers start after the server
    finally:
        if server is not None:
            deadline = time.monotonic() + linger_s
            while (left := [p for p in tree[1:] if _alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.5)
            for p in left:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc = getattr(server, "proc", None)
            code = proc.returncode if proc is not None else 0
            log = getattr(server, "log_path", None)
            record(ServerRun(policy=policy, start_s=start_s, exit_code=code, clean_exit=code == 0,
                             leftover_pids=[p.pid for p in left], log=str(log) if log else None))


Measure = Callable[[str, list[str]], SetRun]  # (server url, prompts) -> the set's figures


def rotation(policies: Sequence[str], repeat: int) -> list[str]:
    """The policies' order in a repeat: as given, reversed every other repeat."""
    return list(policies) if repeat % 2 == 0 else list(reversed(policies))


def run_bench_serve(
    policies: Sequence[str],
    sets: dict[str, list[str]],
    start_server: ServerStarter,
    measure: Measure,
    work_dir: Path,
    base_app: dict[str, Any] | None = None,
    concurrency: int = 1,
    max_tokens: int = 64,
    repeats: int = 1,
    warmup: int = 2,
    protocol: Protocol | None = None,
    settle_s: float = 3.0,
    log: Callable[[str], None] = print,
    progress: Callable[[str], None] = lambda _desc: None,
) -> BenchServeResult:
    """Every policy x prompt set, `repeats` times; `measure` sends one set to one server.

    A fresh server gets `warmup` requests of each set first, not counted; a resumed one gets one of each (its
    caches went cold while it was paused) after `settle_s`. `progress` is called after each measured set.
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies or len(set(policies)) != len(policies):
        raise ValueError(f"policies must be distinct names from {','.join(POLICIES)}; got {list(policies)}")
    if repeats < 1 or warmup < 0 or concurrency < 1:
        raise ValueError("repeats and concurrency must be >= 1, warmup >= 0")
    base_app = base_app or {}
    if protocol is None:
        protocol = "sequential" if repeats == 1 else default_protocol(base_app)
    runs: dict[tuple[str, str], list[SetRun]] = {(p, s): [] for p in policies for s in sets}
    servers: list[ServerRun] = []
    load_start = os.getloadavg()[0]

    def start(policy: str, work: Path, stack: ExitStack) -> Server:
        work.mkdir(parents=True, exist_ok=True)
        log(f"== {policy}: starting its server")
        server = stack.enter_context(checked_server(start_server, policy_app_config(base_app, policy), work, servers.append, policy))
        warm(policy, server, warmup)
        return server

    def warm(policy: str, server: Server, count: int) -> None:
        for name, prompts in sets.items():
            if count > 0:
                run = measure(server.url, prompts[:1] * count)
                if run.errors:
                    raise RuntimeError(f"the {policy} server failed its warm-up on {name}: {run.first_error}")

    def measure_all(policy: str, server: Server, rep: int) -> None:
        for name, prompts in sets.items():
            run = measure(server.url, prompts)
            runs[(policy, name)].append(run)
            if run.errors:
                log(f"   {policy} {name}: {run.errors} of {run.requests} requests failed, e.g. {run.first_error}")
            progress(f"{policy} {name} repeat {rep + 1}: {run.tokens_per_s:.0f} tok/s")

    if protocol == "sequential":
        for rep in range(repeats):
            for policy in rotation(policies, rep):
                with ExitStack() as stack:
                    measure_all(policy, start(policy, work_dir / policy / f"repeat-{rep}", stack), rep)
    else:
        with ExitStack() as stack:
            up: dict[str, Server] = {}
            for policy in policies:
                up[policy] = start(policy, work_dir / policy, stack)
                up[policy].pause()
            for rep in range(repeats):
                for policy in rotation(policies, rep):
                    up[policy].resume()
                    time.sleep(settle_s)
                    warm(policy, up[policy], min(1, warmup))
                    measure_all(policy, up[policy], rep)
                    up[policy].pause()
    rows = rows_from_runs(runs, concurrency, max_tokens)
    ratio_values, best = ratios(rows)
    return BenchServeResult(
        protocol=protocol, repeats=repeats, concurrency=concurrency, requests=len(next(iter(sets.values()))),
        max_tokens=max_tokens, rows=rows, ratios=ratio_values, best_baseline=best, servers=servers,
        load_average=(load_start, os.getloadavg()[0]), cpus=os.cpu_count() or 0,
    )


def bench_serve_command(args) -> int:
    """`forespark bench serve` from its parsed arguments (cluster/cli.py)."""
    import json
    import sys

    import yaml
    from tqdm import tqdm

    from loadtest.compare import local_servers

    try:
        sets = prompt_sets(args.prompts, args.requests)
        base_app = (yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else {}
        if args.max_tokens < 1 or args.concurrency < 1 or args.repeats < 1 or args.warmup < 0:
            raise ValueError("--max-tokens, --concurrency and --repeats must be >= 1, --warmup >= 0")
        if len(set(args.policies)) != len(args.policies):
            raise ValueError(f"--policies lists a policy twice: {','.join(args.policies)}")
    except (ValueError, OSError) as e:
        print(f"forespark bench serve: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    with tqdm(total=args.repeats * len(args.policies) * len(sets), desc="bench serve", unit="set") as bar:
        def progress(desc: str) -> None:
            bar.set_postfix_str(desc)
            bar.update()

        result = run_bench_serve(
            args.policies, sets, local_servers(args.port),
            lambda url, prompts: send_set(url, prompts, args.concurrency, args.max_tokens, api_key=args.api_key),
            out, base_app, concurrency=args.concurrency, max_tokens=args.max_tokens, repeats=args.repeats,
            warmup=args.warmup, protocol=args.protocol, log=tqdm.write, progress=progress,
        )
    print(format_bench_serve(result))
    path = Path(args.json) if args.json else out / "bench_serve.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    print(f"wrote {path}")
    failed = any(r.errors for r in result.rows) or any(not s.clean_exit for s in result.servers)
    return 1 if failed else 0
