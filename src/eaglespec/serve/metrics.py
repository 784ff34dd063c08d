"""Prometheus metrics under vLLM's names and `model_name` label, so vLLM dashboards, speculators'
evaluation and AIPerf read them unchanged. Counters are exposed with prometheus_client's `_total`
suffix, as vLLM's are. Definitions follow vLLM v1: inter-token latency is observed once per engine
step that gives a request tokens (with speculation, one step can give several).

Ours (`eaglespec:` prefix): decoding steps by the speculation shape the policy chose.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # as vLLM: no *_created series

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name

        def counter(name, doc, extra=()):
            return Counter(name, doc, label + list(extra), registry=r)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ["position"])  # fmt: skip
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["finished_reason"])  # fmt: skip
        self.shape_steps = counter("eaglespec:spec_decode_steps", "Decoding steps by the speculation shape chosen "
                                   "(width 0 = a plain step).", ["width", "depth", "nodes"])  # fmt: skip
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", label,
                             registry=r)  # fmt: skip
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", label,
                             registry=r)  # fmt: skip
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", label,
                              registry=r)  # fmt: skip
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              label, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             label, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             label, buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", label,
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        # every series exists from the start (0 before the first request), as vLLM's do
        for metric in (self.drafts, self.draft_tokens, self.accepted, self.prompt_tokens, self.generation_tokens,
                       self.running, self.waiting, self.kv_usage, self.ttft, self.itl, self.e2e, self.tpot):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)

    def observe_spec(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        m = self.model_name
        if drafts:
            self.drafts.labels(m).inc(drafts)
            self.draft_tokens.labels(m).inc(draft_tokens)
            self.accepted.labels(m).inc(accepted)
        for pos, n in enumerate(per_pos):
            if n:
                self.accepted_per_pos.labels(m, str(pos)).inc(n)

    def observe_step(self, shape: tuple[int, int, int] | None) -> None:
        if shape is not None:
            self.shape_steps.labels(self.model_name, *map(str, shape)).inc()

    def observe_queue(self, running: int, waiting: int, kv_usage: float) -> None:
        m = self.model_name
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
