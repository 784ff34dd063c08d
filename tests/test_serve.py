"""`eaglespec serve` end to end: a real uvicorn server on a free port with the bundled models, driven by
the official `openai` client and raw HTTP. Greedy output is checked against `transformers`."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from eaglespec.serve.cli import add_parser, build_server
from eaglespec.settings import default_models_dir

MODELS = default_models_dir()
PROMPTS = ["The history of the city", "def read_config(path):\n", "Once upon a time there was"]


def _args(**over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--target", str(MODELS / "target"), "--port", "0", "--dtype", "fp32", "--mode",
                         "tree", "--max-num-seqs", "4", "--no-adaptive", "--compile", "off"])
    # --no-adaptive: always speculate, so acceptance is on every response
    for k, v in over.items():
        setattr(args, k, v)
    return args


class Server:
    """uvicorn in a thread; `url` once it listens; `stop()` is the graceful shutdown SIGTERM triggers."""

    def __init__(self, **over):
        self.app, self.server = build_server(_args(**over))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=over.get("api_key") or "none", max_retries=0)

    def post(self, path: str, body, **kw) -> httpx.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(self.url + path, content=data, headers=headers, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_greedy():
    """transformers' own greedy continuation of each prompt (fp32): the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    model = AutoModelForCausalLM.from_pretrained(str(MODELS / "target"), dtype=torch.float32).eval()

    def run(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
        return out[0, len(ids) :].tolist()

    return tok, run


def test_completions_greedy_equal_transformers(server, hf_greedy):
    tok, run = hf_greedy
    resp = server.client.completions.create(model="target", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, resp.choices):
        want = run(tok.encode(prompt, add_special_tokens=False), 24)
        assert choice.text == tok.decode(want, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if tok.eos_token_id in want else "length")
    prompt_tokens = sum(len(tok.encode(p, add_special_tokens=False)) for p in PROMPTS)
    assert resp.usage.prompt_tokens == prompt_tokens and resp.usage.completion_tokens > 0
    spec = resp.model_extra["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] > 1.0  # the drafter really accepts


def test_quantized_target_serves_its_own_plain_greedy_output():
    """`serve --quantize w8a8`: speculative responses equal the quantized target's plain greedy decoding."""
    from eaglespec.api import generate, load_engine

    plain = load_engine(MODELS / "target", None, mode="off", dtype="fp32", quantize="w8a8")
    s = Server(quantize="w8a8")
    try:
        resp = s.client.completions.create(model="target", prompt=PROMPTS, max_tokens=24, temperature=0)
    finally:
        s.stop()
    for prompt, choice in zip(PROMPTS, resp.choices):
        ids = plain.tokenizer.encode(prompt, add_special_tokens=False)
        want = generate(plain, [ids], max_new_tokens=24).results[0].output_ids
        assert choice.text == plain.tokenizer.decode(want, skip_special_tokens=True)
    assert resp.model_extra["spec_decode"]["mean_acceptance_length"] > 1.0


def test_token_id_prompts_and_stream_equal_non_stream(server):
    ids = server.client.completions.create(model="target", prompt="The history of the city", max_tokens=1,
                                           temperature=0).usage.prompt_tokens  # fmt: skip
    assert ids > 0
    whole = server.client.completions.create(prompt=PROMPTS[0], model="target", max_tokens=30, temperature=0)
    parts, finish = [], None
    for chunk in server.client.completions.create(prompt=PROMPTS[0], model="target", max_tokens=30, temperature=0,
                                                  stream=True):  # fmt: skip
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.choices[0].text and finish == whole.choices[0].finish_reason
    assert len(parts) > 2  # it really streamed


def test_chat_stream_with_usage_and_stop_string(server):
    messages = [{"role": "user", "content": "hi, how are you doing today?"}]
    whole = server.client.chat.completions.create(model="target", messages=messages, max_tokens=40, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    chunks = list(server.client.chat.completions.create(model="target", messages=messages, max_tokens=40,
                                                        temperature=0, stop=[stop], stream=True,
                                                        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == cut  # the stop string and what follows it never reach the client
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_per_request_sampling_in_one_batch_is_isolated_and_reproducible(server):
    """Greedy and seeded sampled requests with different settings run concurrently in one batch; each
    gets exactly what it gets alone (no request sees another's tokens or noise)."""
    settings = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=0.7, top_p=0.8, seed=2),
                dict(temperature=1.2, seed=3, extra_body={"top_k": 5}), dict(temperature=0.9, seed=4)]  # fmt: skip

    def one(i, kw):
        return server.client.completions.create(model="target", prompt=PROMPTS[i % 3], max_tokens=20, **kw)

    alone = [one(i, kw).choices[0].text for i, kw in enumerate(settings)]

    async def together():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        outs = await asyncio.gather(*[client.completions.create(model="target", prompt=PROMPTS[i % 3], max_tokens=20,
                                                                **kw) for i, kw in enumerate(settings)])  # fmt: skip
        return [o.choices[0].text for o in outs]

    assert asyncio.run(together()) == alone
    assert len(set(alone[1:])) > 1
    n3 = server.client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=9,
                                          n=3)  # fmt: skip
    texts = [c.text for c in n3.choices]
    assert len(texts) == 3 and len(set(texts)) > 1  # n choices differ, each reproducible from the seed
    again = server.client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=9,
                                             n=3)  # fmt: skip
    assert [c.text for c in again.choices] == texts


@pytest.mark.parametrize("body,status,needle", [
    ('{"prompt": "x",', 400, "not valid JSON"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [1, 2, 99999999]}, 400, "token ids must be in"),
    ({"prompt": "x", "logit_bias": {"5": 10}, "frequency_penalty": 0.5}, 400, "frequency_penalty, logit_bias"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ({"prompt": "x", "max_tokens": 40000}, 400, "maximum context length is 32768"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
])  # fmt: skip
def test_bad_requests_get_openai_errors(server, body, status, needle):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "presence_penalty": 0, "logprobs": None,
                                        "user": "someone"})  # fmt: skip
    assert r.status_code == 200, r.text


def test_over_long_prompt_names_the_limit(server):
    r = server.post("/v1/completions", {"prompt": list(range(5, 40005)), "max_tokens": 1})
    assert r.status_code == 400 and "32768" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_models_health_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["target"]
    before = server.metrics()
    resp = server.client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    after = server.metrics()
    label = '{model_name="target"}'

    def delta(name):
        return after.get(name + label, 0) - before.get(name + label, 0)

    spec = resp.model_extra["spec_decode"]
    assert delta("vllm:spec_decode_num_drafts_total") == spec["num_drafts"] > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    assert delta("vllm:generation_tokens_total") == resp.usage.completion_tokens
    assert delta("vllm:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    pos0 = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="0"}'
    assert after[pos0] - before.get(pos0, 0) == spec["num_accepted_tokens_per_pos"][0]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:inter_token_latency_seconds_count"):  # fmt: skip
        assert name + label in after
    assert any(k.startswith("eaglespec:spec_decode_steps_total{") and 'width="4"' in k for k in after)


def test_adversarial_inputs_get_clear_400s_and_client_message_dumps_are_accepted(server):
    raw = '{"prompt": "\\ud800abc", "max_tokens": 2}'  # a lone surrogate, legal JSON, not encodable text
    for body in [raw, '{"prompt": ["fine", "\\ud800"], "max_tokens": 2}',
                 '{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}']:  # fmt: skip
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = server.post(path, body)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], (body, r.text)
    # what the official client returns as choices[0].message, appended to the conversation as it is
    first = server.client.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, temperature=0)  # fmt: skip
    reply = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(reply)
    again = server.client.chat.completions.create(model="target", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Hi"}, reply, {"role": "user", "content": "And?"}])  # fmt: skip
    assert again.choices[0].message.content is not None
    # a body larger than the context could ever hold: 413 before it is parsed or tokenized, sized or chunked
    huge = json.dumps({"prompt": "x" * (3 << 20), "max_tokens": 2}).encode()
    for content in (huge, iter([huge[i : i + 65536] for i in range(0, len(huge), 65536)])):
        r = httpx.post(server.url + "/v1/completions", content=content, timeout=60,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health").status_code == 200
    reply["tool_calls"] = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}, reply], "max_tokens": 2})
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"]


def _wait_idle(server, timeout=10.0) -> float:
    core = server.app.state.engine.core
    t0 = time.time()
    while core.has_work and time.time() - t0 < timeout:
        time.sleep(0.01)
    assert not core.has_work, "the aborted request is still running"
    return time.time() - t0


def test_client_disconnect_aborts_streaming_and_plain_requests(server):
    core = server.app.state.engine.core
    body = {"prompt": PROMPTS[1], "max_tokens": 3000, "temperature": 0.0}  # greedy code runs on without EOS
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
        assert core.has_work
    _wait_idle(server)
    assert not any(core.tcache.in_use)  # the cache slot is free
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    _wait_idle(server)
    assert not any(core.tcache.in_use)


def test_api_key_queue_limit_timeout_and_graceful_shutdown():
    s = Server(api_key="sekret", max_queue=1, max_num_seqs=1, request_timeout=1.5)
    try:
        fresh = s.metrics()  # every vLLM series is there before the first request, at 0
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total",
                     "vllm:spec_decode_num_drafts_total", "vllm:time_to_first_token_seconds_count"):  # fmt: skip
            assert fresh[name + '{model_name="target"}'] == 0, name
        assert any(k.startswith("vllm:request_success_total{") for k in fresh)
        r = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
        auth = {"authorization": "Bearer sekret"}
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics need no key
        # one request runs (max_num_seqs 1), one waits (max_queue 1): the rest get 429
        long = {"prompt": PROMPTS[1], "max_tokens": 3000, "temperature": 0}  # greedy: runs on, no EOS

        async def burst():
            async with httpx.AsyncClient(timeout=30, headers=auth) as c:
                return await asyncio.gather(*[c.post(s.url + "/v1/completions", json=long) for _ in range(5)])

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert 429 in codes and codes.count(408) >= 1  # the long ones ran into the 1.5 s timeout
        r429 = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert "max-queue" in r429.json()["error"]["message"] and r429.headers["retry-after"] == "1"
        # more prompts x n than the queue can ever hold: a 400 saying so, not a 429 to retry for nothing
        r = s.post("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, headers=auth)
        assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"]
        r = s.post("/v1/completions", {"prompt": "a", "n": 2, "max_tokens": 2}, headers=auth)
        assert r.status_code == 400 and "prompts x n" in r.json()["error"]["message"]
        _wait_idle(s)
        # graceful shutdown: a request in flight when the server is told to stop still completes
        result = {}

        def in_flight():
            # short enough to finish inside the 1.5 s request timeout on a loaded 2-core machine
            body = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0}
            result["r"] = s.post("/v1/completions", body, headers=auth)
            result["done"] = time.time()

        t = threading.Thread(target=in_flight)
        t.start()
        while not s.app.state.engine.core.has_work:
            time.sleep(0.005)
        stopped = time.time()
        s.stop()
        t.join(30)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] > 0
        assert result["done"] > stopped  # it was still running when the shutdown began
    finally:
        s.stop()


def test_past_the_graceful_timeout_running_requests_end_with_an_error_not_a_cut():
    """Requests that cannot finish within --graceful-timeout get an OpenAI error body (non-streaming) or an
    SSE error event followed by [DONE] (streaming), not uvicorn's plain-text 500 or a truncated stream."""
    s = Server(graceful_timeout=1.0, max_num_seqs=2)
    long = {"prompt": PROMPTS[1], "max_tokens": 3000, "temperature": 0}  # greedy: runs on, no EOS
    result = {}

    def plain():
        result["plain"] = s.post("/v1/completions", long)

    def streamed():
        with httpx.stream("POST", s.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            result["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while s.app.state.engine.core.num_running < 2:
            assert time.time() < deadline, "the two requests did not start"
            time.sleep(0.01)
    finally:
        s.stop()
    for t in threads:
        t.join(30)
    r = result["plain"]
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
    assert "--graceful-timeout 1 s" in r.json()["error"]["message"]
    status, lines = result["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert "--graceful-timeout" in error["error"]["message"]
    assert len(lines) > 3  # it had streamed tokens before it was ended


def test_bench_serving_measures_systems_level_by_level(tmp_path, monkeypatch):
    """`eaglespec bench-serving` end to end on the 8.4M pair: both of our servers at two levels, each level
    on fresh servers in alternating order (so a VM's drifting load does not become a ratio), with the CPU
    time the host stole during each level beside its figures."""
    from eaglespec.cli import main

    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "serving"
    assert main(["bench-serving", "--target", str(MODELS / "target"), "--draft", str(MODELS / "drafter-eagle3.1"),
                 "--systems", "eaglespec_spec,eaglespec_plain", "--concurrency", "1,2", "--requests-per-level", "1",
                 "--repeats", "2",
                 "--max-tokens", "4", "--categories", "chat", "--threads", "1", "--out", str(out)]) == 0  # fmt: skip
    report = json.loads((out / "serving.json").read_text())
    for system in ("eaglespec_spec", "eaglespec_plain"):
        rows = report["systems"][system]
        assert [r["concurrency"] for r in rows] == [1, 1, 2, 2] and all(r["errors"] == 0 for r in rows)
        assert all(r["cpu_steal"] is None or 0 <= r["cpu_steal"] <= 1 for r in rows)
    assert report["systems"]["eaglespec_spec"][0]["tau"] >= 1.0
    markdown = (out / "serving.md").read_text()
    assert "CPU steal %" in markdown and "throughput spec/plain" in markdown and "2 (median of 2)" in markdown
