"""Seeded random malformed OpenAI request bodies for the fuzz test (`tests/test_serve.py`).

Each case is `(path, raw bytes)`: a valid completion or chat body with one to
three fields replaced by values of the wrong type, huge or negative numbers,
empty or nested containers, plus unknown fields, broken JSON and JSON that is
not an object; streaming and not. Bodies that stay valid keep `max_tokens`
small, so the test is bounded by the invalid ones.
"""

from __future__ import annotations

import json
import random

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

FIELDS = [
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "logprobs", "prompt_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
    "min_tokens", "logit_bias", "echo", "ignore_eos", "stream_options", "skip_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "best_of", "suffix", "user",
]
COMPLETION_FIELDS = ["prompt"]
CHAT_FIELDS = ["messages", "top_logprobs", "max_completion_tokens", "response_format", "tools", "tool_choice"]

VALUES = [
    None, True, False, 0, -1, 1, 2, -7, 1.5, -0.5, 2**31, 2**31 - 1, -(2**31), 2**63, -(2**63), 2**64 + 1,
    1e308, -1e308, 1e-308, 3.0e38, "", "x", "-1", "1e999", "9" * 40, "forespark", [], [1, 2], [-1], [2**40],
    ["a", 1], [[1, 2]], {}, {"a": 1}, {"1": 1e308}, {"-5": -200}, {"type": "nope"}, [{"role": "user"}],
    [{"role": "user", "content": 5}], [{"content": "x"}], [{"role": "nobody", "content": "x"}],
]


def _valid(path: str, stream: bool) -> dict:
    body: dict = {"model": "forespark", "max_tokens": 4, "stream": stream}
    if path == COMPLETIONS:
        body["prompt"] = "def f(x):"
    else:
        body["messages"] = [{"role": "user", "content": "def f():"}]
    return body


def malformed(seed: int, count: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        path = COMPLETIONS if i % 2 == 0 else CHAT
        body = _valid(path, stream=rng.random() < 0.5)
        fields = FIELDS + (COMPLETION_FIELDS if path == COMPLETIONS else CHAT_FIELDS)
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(fields) if rng.random() < 0.85 else f"unknown_{rng.randint(0, 999)}"
            value = rng.choice(VALUES)
            if value is None and name in ("max_tokens", "max_completion_tokens"):
                value = -1  # None means "the rest of the context": a long generation, not a malformed body
            body[name] = value
        kind = rng.random()
        if kind < 0.08:  # broken JSON
            raw = json.dumps(body).encode()
            raw = raw[: rng.randint(0, max(len(raw) - 2, 0))] + rng.choice([b"", b"}}", b"\xff\xfe", b",]"])
        elif kind < 0.12:  # JSON, but not an object
            raw = json.dumps(rng.choice([[body], "text", 42, None, [1, 2]])).encode()
        else:
            raw = json.dumps(body).encode()
        cases.append((path, raw))
    return cases
