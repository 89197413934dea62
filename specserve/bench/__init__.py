"""The latency benchmark suite behind ``specserve bench``.

* ``serve_bench`` — the serving benchmark: streaming requests against a server URL or a
  server it starts itself, arrivals at a request rate (Poisson or gamma) or fixed concurrency,
  client-side TTFT / TPOT / ITL / end-to-end latency, throughput, goodput and speculation
  statistics read from ``/metrics``; results under ``vllm bench serve``'s key names.
* ``offline`` — the engine in-process, no HTTP: throughput and per-request latency.
* ``spec_sweep`` — every drafter and k beside speculation off, at batch 1 and under load.

``workloads`` holds the prompt sets (all built offline) and the JSONL format for users'
own; ``arrivals``, ``client`` and ``stats`` are the pieces the benchmarks share; ``plots``
draws the PNGs.
"""
