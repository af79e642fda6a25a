"""The stall watch (cluster/stall_watch.py) on a fake clock and fake reports: which
workers it gives up, when, and which it leaves alone."""

from __future__ import annotations

import pytest

from pdserve.cluster.stall_watch import StallWatch, WorkerStalledError
from pdserve.workers.stats import EngineSnapshot

T = 10.0  # the stall timeout under test


def report(running: int = 0, waiting: int = 0, computed: int = 0, generated: int = 0) -> EngineSnapshot:
    return EngineSnapshot(running=running, waiting=waiting, prompt_tokens_computed=computed,
                          generation_tokens=generated)


def ticks(watch: StallWatch, start: float, end: float, tries: dict[str, int] | None = None,
          workers: tuple[str, ...] = ("d0",), every: float = 0.25) -> list[tuple[float, str]]:
    """Check every `every` s from `start` to `end`: (when, worker) of each stall reported."""
    out: list[tuple[float, str]] = []
    t = start
    while t <= end + 1e-9:
        out += [(t, s.worker) for s in watch.check(t, tries or {}, workers)]
        t += every
    return out


def test_a_worker_that_stops_answering_with_tries_on_it_is_given_up_once_after_the_timeout() -> None:
    watch = StallWatch(T)
    watch.answered("d0", 0.0, report(running=4, generated=100))
    fired = ticks(watch, 0.0, 40.0, tries={"d0": 4})
    assert fired and fired[0][0] == pytest.approx(T + 0.25)  # the first tick past the timeout
    # Given up once: it starts afresh (nothing running we know of), and fires again only
    # after another full timeout with tries still on it.
    assert [t for t, _ in fired] == pytest.approx([T + 0.25, 2 * (T + 0.25), 3 * (T + 0.25)])


def test_the_last_report_alone_is_work_enough() -> None:
    """Another gateway's requests (none of this one's tries): its report's running batch counts."""
    watch = StallWatch(T)
    watch.answered("d0", 0.0, report(running=2, generated=5))
    assert ticks(watch, 0.0, 12.0)[0][0] == pytest.approx(T + 0.25)
    watch = StallWatch(T)
    watch.answered("d0", 0.0, report(waiting=1))  # a queued request: work too
    assert ticks(watch, 0.0, 12.0)


def test_a_worker_with_no_work_is_never_stalled_however_long_it_is_silent() -> None:
    """A model load, a compile at start, a restart: no request on it, no stall."""
    watch = StallWatch(T)
    assert ticks(watch, 0.0, 120.0) == []  # never answered
    watch.answered("d0", 0.0, report())
    assert ticks(watch, 0.0, 120.0) == []


def test_a_long_step_shorter_than_the_timeout_is_not_a_stall() -> None:
    watch = StallWatch(T)
    watch.answered("d0", 0.0, report(running=8, generated=10))
    assert ticks(watch, 0.0, 9.5, tries={"d0": 8}) == []
    watch.answered("d0", 9.5, report(running=8, generated=18))  # the step ended: it answers again
    assert ticks(watch, 9.75, 19.0, tries={"d0": 8}) == []


def test_a_worker_that_answers_but_computes_nothing_with_requests_running_is_given_up() -> None:
    watch = StallWatch(T)
    t = 0.0
    fired: list[tuple[float, str]] = []
    while t <= 12.0 and not fired:
        watch.answered("d0", t, report(running=3, computed=50, generated=7))  # the same counts every poll
        fired = [(t, s.worker) for s in watch.check(t, {"d0": 3}, ["d0"])]
        t += 0.25
    assert fired and fired[0][0] == pytest.approx(T + 0.25)


def test_progress_or_an_empty_batch_keeps_a_worker_alive() -> None:
    watch = StallWatch(T)
    for i in range(200):  # 50 s of polls
        t = i * 0.25
        if i % 20 == 0:
            watch.answered("d0", t, report(running=3, generated=i))  # a token every 5 s: slow, not stalled
        else:
            watch.answered("d0", t, report(running=3, generated=i - i % 20))
        assert watch.check(t, {"d0": 3}, ["d0"]) == []
    watch = StallWatch(T)
    for i in range(200):  # requests only awaiting their KV (waiting): nothing to compute
        watch.answered("d0", i * 0.25, report(waiting=2, generated=1))
        assert watch.check(i * 0.25, {"d0": 2}, ["d0"]) == []


def test_a_late_tick_does_not_count_the_gateways_own_pause_against_workers() -> None:
    """The gateway's loop held up for 30 s: nobody read the answers meanwhile."""
    watch = StallWatch(T)
    watch.answered("d0", 0.0, report(running=2, generated=1))
    assert watch.check(0.0, {"d0": 2}, ["d0"]) == []
    assert watch.check(30.0, {"d0": 2}, ["d0"]) == []  # 30 s late: the pause is not the worker's
    assert ticks(watch, 30.25, 39.9, tries={"d0": 2}) == []
    assert ticks(watch, 40.0, 41.0, tries={"d0": 2})  # silent for the timeout after the pause: given up


def test_only_the_silent_worker_is_given_up() -> None:
    watch = StallWatch(T)
    fired: list[tuple[float, str]] = []
    for i in range(60):
        t = i * 0.25
        watch.answered("d1", t, report(running=4, generated=i))
        if t < 2.0:
            watch.answered("d0", t, report(running=4, generated=i))
        fired += [(t, s.worker) for s in watch.check(t, {"d0": 4, "d1": 4}, ["d0", "d1", "p0"])]
    assert [w for _, w in fired] == ["d0"]
    assert fired[0][0] == pytest.approx(1.75 + T + 0.25)


def test_forget_starts_a_worker_afresh() -> None:
    """A worker that died (Ray restarts it) holds nothing: its long load is no stall."""
    watch = StallWatch(T)
    watch.answered("d0", 0.0, report(running=4, generated=3))
    watch.forget("d0", 1.0)
    assert ticks(watch, 1.0, 60.0) == []


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout: float) -> None:
    with pytest.raises(ValueError, match="stall timeout"):
        StallWatch(timeout)


def test_the_error_is_a_worker_loss_the_migration_path_moves() -> None:
    from pdserve.cluster.token_streams import RETRYABLE, WORKER_LOST

    e = WorkerStalledError("worker d0 stalled")
    assert isinstance(e, WORKER_LOST) and isinstance(e, RETRYABLE) and str(e) == "worker d0 stalled"


def test_the_flag_and_the_serve_yaml_set_the_same_stall_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--stall-timeout` and the Serve YAML's `stall_timeout`: one setting, checked alike."""
    import importlib
    from pathlib import Path

    from pdserve.cluster.cli import build_parser, settings_from_flags
    from pdserve.cluster.serve_config import ServeConfig, serve_config
    from pdserve.workers.config import EngineConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    deploy = importlib.import_module("deploy.pdserve_app")
    argv = ["serve", "--model", "/m", "--stall-timeout", "3"]
    from_flags = serve_config(settings_from_flags(build_parser().parse_args(argv)))
    assert from_flags == deploy.config_from_args({"model": "/m", "stall_timeout": 3})
    assert from_flags.stall_timeout == 3.0
    assert ServeConfig(EngineConfig("/m")).stall_timeout == 10.0  # the default the README gives
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="stall_timeout"):
            ServeConfig(EngineConfig("/m"), stall_timeout=bad)


def test_ticks_as_far_apart_as_the_gap_allows_still_find_a_stall() -> None:
    """The caller ticks slowly (a long poll interval): its regular ticks are not pauses."""
    watch = StallWatch(T, max_tick_gap_s=2.5 + 1.0)
    watch.answered("d0", 0.0, report(running=2, generated=1))
    fired = ticks(watch, 0.0, 20.0, tries={"d0": 2}, every=2.5)
    assert fired and fired[0][0] == pytest.approx(12.5)
    slow = StallWatch(T)  # a gap under the caller's own interval: every tick would look late
    slow.answered("d0", 0.0, report(running=2, generated=1))
    assert ticks(slow, 0.0, 60.0, tries={"d0": 2}, every=2.5) == []
