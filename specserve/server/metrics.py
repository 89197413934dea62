"""Prometheus metrics for /metrics, names following vLLM's (``specserve:`` prefix), each
also served under vLLM's prefix (``vllm:``, the same name after it) so that dashboards made
for vLLM read them unchanged.

Latency histograms and token counters are observed by the HTTP side as outputs reach
clients; engine state (queue lengths, KV usage, preemptions, speculation counters, the
draft lengths chosen) is read at scrape time from the snapshot the engine thread publishes.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from specserve.async_engine import AsyncLLMEngine

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    """One registry per server, so several servers (tests) never share counters."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._model_name = model_name

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.ttft = histogram("specserve:time_to_first_token_seconds",
                              "Time from request arrival to its first token.", _LATENCY_BUCKETS)
        self.itl = histogram("specserve:inter_token_latency_seconds",
                             "Time between two successive outputs of a request (one output "
                             "may carry several accepted tokens).", _LATENCY_BUCKETS)
        self.tpot = histogram("specserve:time_per_output_token_seconds",
                              "Per request: (end-to-end - TTFT) / (output tokens - 1).",
                              _LATENCY_BUCKETS)
        self.e2e = histogram("specserve:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", _E2E_BUCKETS)
        self.prompt_tokens = Counter("specserve:prompt_tokens", "Prompt tokens processed.",
                                     ["model_name"], registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("specserve:generation_tokens", "Tokens generated.",
                                         ["model_name"], registry=self.registry).labels(**labels)
        self.requests = Counter("specserve:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))

    def request_finished(self, reason: str, e2e_s: float, first_token_at: float | None,
                         last_token_at: float, num_tokens: int) -> None:
        self.requests.labels(self._model_name, reason).inc()
        self.e2e.observe(e2e_s)
        if first_token_at is not None and num_tokens > 1:
            self.tpot.observe((last_token_at - first_token_at) / (num_tokens - 1))

    def render(self) -> bytes:
        """One reading of every series, written under both prefixes."""
        return generate_latest(_Read(list(self.registry.collect())))


class _Read:
    """Families read once, served as they are and again as ``vllm:``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        yield from self.families
        for family in self.families:
            if family.name.startswith("specserve:"):
                alias = Metric(_vllm(family.name), family.documentation, family.type, family.unit)
                alias.samples = [sample._replace(name=_vllm(sample.name)) for sample in family.samples]
                yield alias


def _vllm(name: str) -> str:
    return "vllm:" + name.removeprefix("specserve:")


class _EngineCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name]

    def describe(self):
        return []  # scrape-time values: nothing to describe up front

    def collect(self):
        snap = self.engine.snapshot
        spec = snap.spec_stats
        for name, doc, value in (
                ("specserve:num_requests_running", "Requests in the running batch.", snap.num_running),
                ("specserve:num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting),
                ("specserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                 snap.kv_cache_usage),
                ("specserve:kv_cache_free_blocks", "Free KV-cache blocks.", snap.num_free_blocks),
                ("specserve:prefix_cache_hit_rate",
                 "Fraction of the prompt tokens looked up in the prefix cache that were found there.",
                 snap.prefix_cache_hits / snap.prefix_cache_queries if snap.prefix_cache_queries else 0.0)):
            yield _gauge(name, doc, self.labels, value)
        for name, doc, value in (
                ("specserve:num_preemptions", "Requests preempted (recomputed later).", snap.num_preemptions),
                ("specserve:num_rope_restarts",
                 "Requests recomputed with LongRoPE's long factors on growing past its original length.",
                 snap.num_rope_restarts),
                ("specserve:engine_steps", "Engine steps run.", snap.num_steps),
                ("specserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.",
                 snap.prefix_cache_queries),
                ("specserve:prefix_cache_hits", "Prompt tokens found in the prefix cache at admission.",
                 snap.prefix_cache_hits),
                ("specserve:spec_decode_num_drafts", "Verify steps that carried draft tokens.",
                 spec.num_drafts),
                ("specserve:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
                ("specserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens),
                ("specserve:spec_decode_num_path_wins",
                 "Verify steps whose kept tokens came from a further draft path (num_draft_paths > 1) "
                 "or left a draft tree's chain (draft_tree_nodes).",
                 spec.num_path_wins)):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self.labels, value)
            yield counter
        per_pos = CounterMetricFamily("specserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this position was accepted.",
                                      labels=["model_name", "position"])
        for pos, count in enumerate(spec.accepted_per_position):
            per_pos.add_metric([*self.labels, str(pos)], count)
        yield per_pos
        yield _histogram("specserve:spec_decode_draft_length", "Draft length k verified per request per step.",
                         snap.draft_length_counts, self.labels)
        if snap.tree_size_counts:
            yield _histogram("specserve:spec_decode_tree_nodes",
                             "Further draft tree nodes verified per request per step with a tree "
                             "(beside the chain it kept).", snap.tree_size_counts, self.labels)
        if snap.draft_calibration is not None:
            yield from _calibration(snap.draft_calibration.describe(), self.labels)


def _gauge(name, doc, labels, value):
    gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
    gauge.add_metric(labels, value)
    return gauge


def _calibration(described: dict, labels: list[str]):
    """The adaptive controller's calibration map: per kind of request, draft depth and
    confidence bin (its upper edge), the acceptance it predicts and the observations
    behind it (forgetting-weighted)."""
    names = ["model_name", "kind", "depth", "confidence_le"]
    predicted = GaugeMetricFamily("specserve:spec_decode_calibrated_acceptance",
                                  "Predicted acceptance of a draft token by the drafter's confidence and depth "
                                  "(depth 3: 3 or deeper).", labels=names)
    observed = GaugeMetricFamily("specserve:spec_decode_calibration_observations",
                                 "Verified draft tokens behind each calibration bin (recent ones weigh most).",
                                 labels=names)
    edges = described["edges"][1:]
    for kind in ("greedy", "sampling"):
        for depth, (row, seen) in enumerate(zip(described[kind]["acceptance"], described[kind]["observations"])):
            for edge, value, count in zip(edges, row, seen):
                key = [*labels, kind, str(depth), str(edge)]
                predicted.add_metric(key, value)
                observed.add_metric(key, count)
    yield predicted
    yield observed


def _histogram(name: str, doc: str, counts: dict[int, int], labels: list[str]):
    """A histogram of small counts per request per step (``counts``: value -> request-steps;
    the draft length k, 0 = no speculation that step; a tree's further nodes)."""
    hist = HistogramMetricFamily(name, doc, labels=["model_name"])
    top = max(counts, default=0)
    buckets, cumulative = [], 0
    for k in range(top + 1):
        cumulative += counts.get(k, 0)
        buckets.append((str(float(k)), cumulative))
    buckets.append(("+Inf", cumulative))
    hist.add_metric(labels, buckets, sum_value=float(sum(k * n for k, n in counts.items())))
    return hist
