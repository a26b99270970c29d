"""What a workload run gave its users, from each request's timings: throughput, latency percentiles, goodput.

A request's record holds when it was sent, when each event of new tokens reached the client (a streamed server may
bring several tokens in one event) and how many tokens each brought. TTFT is the first event's time after sending;
inter-token latency (ITL) spreads an event's wait over the tokens it brought; end-to-end latency runs to the last.
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    conversation: int
    turn: int
    sent_s: float  # from the run's start
    prompt_tokens: int
    events: list[tuple[float, int]] = field(default_factory=list)  # (time from the run's start, new tokens)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def ttft_s(self) -> float | None:
        return self.events[0][0] - self.sent_s if self.events else None

    @property
    def end_to_end_s(self) -> float | None:
        return self.events[-1][0] - self.sent_s if self.events else None

    def inter_token_s(self) -> list[float]:
        """One gap per token after the first: an event's wait since the one before, shared by its tokens."""
        gaps = []
        for (before, _), (at, n) in zip(self.events, self.events[1:]):
            gaps += [(at - before) / n] * n
        return gaps

    def to_json(self) -> dict:
        return {**asdict(self), "ttft_s": self.ttft_s, "end_to_end_s": self.end_to_end_s,
                "output_tokens": self.output_tokens}

    @classmethod
    def from_json(cls, saved: dict) -> RequestRecord:
        fields = {name: saved[name] for name in cls.__dataclass_fields__}
        return cls(**{**fields, "events": [tuple(event) for event in saved["events"]]})


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between order statistics; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def meets(record: RequestRecord, ttft_bound_s: float, itl_bound_ms: float) -> bool:
    """Whether a request completed within both bounds: its TTFT, and the 99th percentile of its own ITL."""
    if record.error is not None or record.ttft_s is None or record.ttft_s > ttft_bound_s:
        return False
    itl = percentile(record.inter_token_s(), 99)
    return itl is None or 1e3 * itl <= itl_bound_ms


def summarize(records: list[RequestRecord], wall_s: float, ttft_bound_s: float, itl_bound_ms: float) -> dict:
    """The run's figures: wall time, requests/min, output and total tok/s, TTFT p50/p90/p99 (and p50 of the turns
    after a conversation's first, which a prefix cache serves), ITL p50/p99 (ms), end-to-end p50/p99, goodput
    (requests/min meeting both bounds), and the counts of errors. Each figure counts the requests that completed,
    but streamed_tok_s: every token streamed to a client, its request finished or not (a run cut at a time limit
    still says how fast it decoded)."""
    done = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    later_ttft = [r.ttft_s for r in done if r.ttft_s is not None and r.turn > 0]
    e2e = [r.end_to_end_s for r in done if r.end_to_end_s is not None]
    itl = [gap for r in done for gap in r.inter_token_s()]
    output = sum(r.output_tokens for r in done)
    per_min = 60.0 / wall_s
    return {
        "requests": len(records), "errors": len(records) - len(done), "wall_s": wall_s,
        "requests_per_min": len(done) * per_min, "output_tok_s": output / wall_s,
        "streamed_tok_s": sum(r.output_tokens for r in records) / wall_s,
        "total_tok_s": (output + sum(r.prompt_tokens for r in done)) / wall_s,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "later_turns_ttft_p50_s": percentile(later_ttft, 50),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "ttft_bound_s": ttft_bound_s, "itl_bound_ms": itl_bound_ms,
        "goodput_per_min": sum(meets(r, ttft_bound_s, itl_bound_ms) for r in records) * per_min,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds
