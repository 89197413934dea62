"""When requests are sent: a Poisson or gamma arrival process at a request rate, as
``vllm bench serve`` draws it; fixed concurrency is a cap the client applies on top."""
from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times in seconds after the start, one per request, the first at 0.

    Gaps between requests are gamma-distributed with shape ``burstiness`` and mean
    ``1 / request_rate``: burstiness 1 is a Poisson process, lower is burstier, higher is
    more regular. ``request_rate`` inf sends everything at once. The same seed gives the
    same times.
    """
    if num_requests < 0:
        raise ValueError(f"the number of requests must be >= 0, got {num_requests}")
    check_rate(request_rate)
    if not burstiness > 0 or not math.isfinite(burstiness):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def check_rate(request_rate: float) -> None:
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request rates must be > 0 (or inf), got {request_rate}")


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2,inf"`` -> [0.5, 1.0, 2.0, inf]; ValueError on anything else."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise ValueError(f"bad request rate {part.strip()!r} in {text!r}: give numbers or inf") from None
        check_rate(rate)
        rates.append(rate)
    return rates
