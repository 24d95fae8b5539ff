"""A replica's stream to the ingress (`replicas.deployment.batched`): each batch is one Ray message through the
ingress and the proxy, so tokens are batched, but neither the first token nor the stream's end waits for a batch."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas.deployment import batched


async def _lines(gaps_s: list[float], fail: bool = False):
    for i, gap in enumerate(gaps_s):
        await asyncio.sleep(gap)
        yield f"data: {i}\n\n"
    if fail:
        raise RuntimeError("engine failed")


async def _collect(gaps_s: list[float], window_s: float, fail: bool = False) -> list[tuple[float, list[str]]]:
    start, out = time.perf_counter(), []
    async for batch in batched(_lines(gaps_s, fail), window_s):
        out.append((time.perf_counter() - start, batch))
    return out


def test_the_first_line_goes_alone_at_once_the_rest_in_windows_and_the_end_without_waiting():
    window = 0.2
    gaps = [0.0] + [0.01] * 40  # 41 lines over 0.4 s, the last at ~0.4 s
    got = asyncio.run(_collect(gaps, window))
    assert got[0][1] == ["data: 0\n\n"] and got[0][0] < window / 2
    assert [line for _, batch in got for line in batch] == [f"data: {i}\n\n" for i in range(41)]  # all, in order
    assert 2 <= len(got) <= 5  # batched: a handful of messages for 41 lines
    last_line_at = sum(gaps)
    assert got[-1][0] - last_line_at < window / 2  # the end did not wait out a window
    # Control: without a window every line that arrives apart goes alone.
    assert len(asyncio.run(_collect(gaps, 0.0))) == 41


def test_an_error_in_the_stream_reaches_the_caller_after_the_lines_before_it():
    got = []

    async def go():
        async for batch in batched(_lines([0.0, 0.01, 0.01], fail=True), 0.05):
            got.extend(batch)

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(go())
    assert got == [f"data: {i}\n\n" for i in range(3)]
