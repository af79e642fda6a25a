"""Metrics on synthetic timelines equal hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.cluster.bench.client import RequestRecord, _finish, _is_token_chunk
from pdserve.cluster.bench.metrics import SLO, distribution, summarize
from pdserve.cluster.bench.sweep import GoodputMethod, distserve_goodput, parse_rates


def timeline(index: int, chunk_times: list[float], output_tokens: int | None = None, usage: bool = True,
             output_len: int | None = None) -> RequestRecord:
    """A request sent at t=0 whose token chunks arrived at `chunk_times`."""
    n = output_tokens if output_tokens is not None else len(chunk_times)
    rec = RequestRecord(index, input_len=10, output_len=output_len if output_len is not None else n, scheduled=0.0)
    if usage:
        rec.usage_reported, rec.output_tokens = True, n
    return _finish(rec, 0.0, chunk_times, done=True)


def failed(index: int, why: str) -> RequestRecord:
    rec = RequestRecord(index, input_len=10, output_len=4, scheduled=0.0)
    rec.error = why
    return rec


def test_ttft_tpot_itl_e2e_of_one_timeline() -> None:
    r = timeline(0, [0.2, 0.25, 0.35, 0.40])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.4)
    assert r.itl == pytest.approx([0.05, 0.1, 0.05])
    assert r.tpot == pytest.approx((0.4 - 0.2) / 3)


def test_multi_token_chunks_one_itl_gap_per_chunk_tpot_per_token() -> None:
    # 3 chunks carrying 1 + 4 + 3 tokens (speculative decoding): usage says 8
    r = timeline(0, [0.1, 0.2, 0.3], output_tokens=8)
    assert r.itl == pytest.approx([0.1, 0.1])
    assert r.tpot == pytest.approx(0.2 / 7)


def test_without_usage_tokens_are_counted_from_chunks() -> None:
    r = timeline(0, [0.1, 0.2, 0.3], usage=False)
    assert r.output_tokens == 3 and r.tpot == pytest.approx(0.1)


def test_one_output_token_has_no_tpot() -> None:
    r = timeline(0, [0.1])
    assert r.tpot is None and r.itl == []


def test_stream_without_done_or_tokens_is_a_failure() -> None:
    rec = _finish(RequestRecord(0, 1, 1, 0.0), 0.0, [0.1], done=False)
    assert not rec.success and "before [DONE]" in (rec.error or "")
    rec = _finish(RequestRecord(0, 1, 1, 0.0), 0.0, [], done=True)
    assert not rec.success and "no token" in (rec.error or "")


def test_summary_equals_numpy_on_synthetic_runs() -> None:
    rng = np.random.default_rng(0)
    recs = []
    for i in range(40):
        ttft = float(rng.uniform(0.05, 0.5))
        gaps = rng.uniform(0.01, 0.05, size=int(rng.integers(1, 12)))
        recs.append(timeline(i, [ttft, *(ttft + np.cumsum(gaps)).tolist()]))
    recs += [failed(40, "HTTP 500: boom"), failed(41, "HTTP 500: boom"), failed(42, "timeout: 1s")]
    duration = 4.0
    s = summarize(recs, duration)
    ok = recs[:40]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok]
    itl = [g for r in ok for g in r.itl]
    for key, vals in (("ttft_s", ttft), ("tpot_s", tpot), ("itl_s", itl), ("e2e_s", [r.e2e for r in ok])):
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(np.percentile(vals, p)), (key, p)
        assert s[key]["mean"] == pytest.approx(np.mean(vals))
        assert s[key]["median"] == pytest.approx(np.median(vals))
        assert s[key]["std"] == pytest.approx(np.std(vals))
        assert (s[key]["min"], s[key]["max"]) == pytest.approx((min(vals), max(vals)))
    assert (s["completed"], s["failed"]) == (40, 3)
    assert s["failure_reasons"] == {"HTTP 500: boom": 2, "timeout: 1s": 1}
    assert s["request_throughput"] == pytest.approx(40 / 4.0)
    assert s["output_token_throughput"] == pytest.approx(sum(r.output_tokens for r in ok) / 4.0)
    assert s["input_token_throughput"] == pytest.approx(400 / 4.0)


def test_goodput_and_attainment_by_hand() -> None:
    recs = [
        timeline(0, [0.10, 0.15, 0.20]),  # ttft 100, tpot 50: meets both (inclusive)
        timeline(1, [0.30, 0.32, 0.34]),  # ttft 300 misses, tpot 20
        timeline(2, [0.05, 0.20, 0.35]),  # tpot 150 misses
        timeline(3, [0.05]),  # one token: no TPOT, meets it
        failed(4, "HTTP 500: boom"),  # misses everything
    ]
    g = summarize(recs, duration=2.0, slo=SLO.parse(["ttft:100", "tpot:50"]))["goodput"]
    assert g["good_requests"] == 2
    assert g["request_goodput"] == pytest.approx(1.0)
    assert g["attainment"] == pytest.approx(2 / 5)
    assert g["attainment_by_slo"] == pytest.approx({"ttft": 3 / 5, "tpot": 3 / 5})
    e2e = summarize(recs, 2.0, SLO.parse(["e2e:200"]))["goodput"]
    assert e2e["good_requests"] == 2  # requests 0 (0.20) and 3 (0.05)


def test_slo_parse() -> None:
    assert SLO.parse(["ttft:250", "tpot:100", "e2el:2000"]) == SLO(ttft=0.25, tpot=0.1, e2e=2.0)
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_distribution_of_nothing_is_none() -> None:
    assert distribution([])["p99"] is None


@pytest.mark.parametrize("payload,is_token", [
    ({"choices": [{"text": "a", "finish_reason": None}]}, True),
    ({"choices": [{"text": "", "finish_reason": None}]}, True),  # half a UTF-8 char
    ({"choices": [{"text": "", "finish_reason": "length"}]}, False),  # bare end marker
    ({"choices": [{"text": "z", "finish_reason": "length"}]}, True),
    ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, False),  # chat preamble
    ({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}, True),
    ({"choices": [], "usage": {"completion_tokens": 3}}, False),
])
def test_token_chunks(payload: dict, is_token: bool) -> None:
    assert _is_token_chunk(payload) is is_token


def test_distserve_goodput_interpolates_the_first_crossing() -> None:
    best = distserve_goodput([1, 2, 3, 4], [1.0, 0.95, 0.85, 0.95])
    assert best.method is GoodputMethod.INTERPOLATED
    assert best.rate == pytest.approx(2.5)
    best = distserve_goodput([1, 2], [0.99, 0.9])
    assert (best.rate, best.method) == (2, GoodputMethod.HIGHEST_MEASURED)
    assert distserve_goodput([1, 2], [0.5, 0.4]).rate is None


def test_parse_rates() -> None:
    assert parse_rates("4,1, 2") == [1.0, 2.0, 4.0]
    for bad in ("", "a,b", "0,1", "inf"):
        with pytest.raises(ValueError):
            parse_rates(bad)
