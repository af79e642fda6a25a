"""Train a tiny target/draft pair on the stdlib corpus, for speculative decoding.

Random weights (builder.py) exercise the machinery, but a random draft agrees
with a random target about 1 time in `vocab_size`, so speculative decoding has
nothing to measure. This module trains both on CPU in a few minutes:

- the target (the default tiny spec: 4 layers, hidden 256) on next-token loss
  over packed windows of the tokenized corpus, files joined by EOS;
- then the draft (1 layer, same width, same tokenizer), started from the
  target's embeddings, first layer, final norm and lm_head (every tensor whose
  name and shape match), and distilled: KL(target ‖ draft) on the next-token
  distributions. (`distill_weight` can mix in the plain next-token loss; a
  quarter of it lowered the draft's held-out loss but also its agreement with
  the target, see docs/speculative.md.)

Budgets are step counts, not wall time, so a `PairSpec` gives the same weights
wherever the software is the same (the default pair came out byte-identical
trained with 2 threads on an idle machine and with 1 on a loaded one).
`pair_spec(minutes=...)` converts a time budget to steps with fixed
steps-per-minute rates (measured on the machine docs/speculative.md, "The
trained tiny pair", names), so a given `minutes` means the same steps anywhere.

Every `heldout_every`-th corpus file is held out. `quality.json`, next to
`target/` and `draft/`, records each model's held-out loss, the draft/target
greedy next-token agreement, and the greedy acceptance length at k=4.

The windows come from windows.py; the quality measures are in quality.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from . import tokenizer as tiny_tokenizer
from .builder import TinyModelSpec, build_dir, init_model, save_model_dir
from .corpus import DEFAULT_CORPUS_BYTES, cache_dir, corpus_fingerprint
from .quality import acceptance, heldout_loss, pair_quality
from .windows import batch_order, corpus_windows

__all__ = [
    "DEFAULT_PAIR",
    "PairSpec",
    "TrainConfig",
    "acceptance",  # measured in quality.py; callers (and tests) reach it here too
    "default_pair_dir",
    "make_tiny_pair",
    "pair_dir",
    "pair_spec",
]

# Bump when training or the files written for a given PairSpec change: it is
# part of the cached pair's directory name.
TRAIN_FORMAT_VERSION = 1

# Steps per minute of each phase at the default sizes (batch 2 x 256 tokens),
# measured on an otherwise idle machine (which one: docs/speculative.md, "The
# trained tiny pair"); `pair_spec` turns minutes into steps with these, two
# thirds of the time for the target.
_TARGET_STEPS_PER_MIN = 470
_DRAFT_STEPS_PER_MIN = 600
DEFAULT_MINUTES = 4.5
# How long a first user waits for another process training the same pair: well past a
# training's minutes on a loaded machine.
TRAIN_LOCK_WAIT_S = 30 * 60.0

def _require(name: str, ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")


@dataclass(frozen=True)
class TrainConfig:
    """One model's training run: AdamW, linear warmup, cosine decay to `min_lr_ratio * lr`.

    `distill_weight` is the share of KL(teacher ‖ model) in the loss (the rest
    is the next-token loss); it needs a teacher, so only the draft uses it.
    """

    steps: int
    # At a fixed token budget, batch 2 at lr 1.5e-3 reached a lower held-out
    # loss than batch 4 or 8 at any lr tried (docs/speculative.md, "How the
    # choices were made").
    batch_size: int = 2
    lr: float = 1.5e-3
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    distill_weight: float = 0.0

    def __post_init__(self) -> None:
        _require("steps", self.steps > 0, "must be > 0")
        _require("batch_size", self.batch_size > 0, "must be > 0")
        _require("lr", self.lr > 0, "must be > 0")
        _require("warmup_frac", 0 <= self.warmup_frac < 1, "must be in [0, 1)")
        _require("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        _require("distill_weight", 0 <= self.distill_weight <= 1, "must be in [0, 1]")

    def lr_factor(self, step: int) -> float:
        """Multiplier on `lr` for optimizer step `step` (0-based)."""
        warmup = max(1, round(self.warmup_frac * self.steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class PairSpec:
    """Everything that determines a trained pair (and so its cache key)."""

    target: TinyModelSpec = TinyModelSpec()
    draft: TinyModelSpec = TinyModelSpec(num_layers=1)
    target_train: TrainConfig = TrainConfig(steps=1410)
    draft_train: TrainConfig = TrainConfig(steps=900, distill_weight=1.0)
    seq_len: int = 256
    # Twice the tokenizer's corpus, so that neither model sees a window twice
    # in the default budget. The codec tables (encodings/cp*.py, ...) are
    # generated hex tables, a quarter of the first 4 MB: easy loss, no code.
    corpus_bytes: int = 2 * DEFAULT_CORPUS_BYTES
    skip_dirs: tuple[str, ...] = ("encodings",)
    heldout_every: int = 20
    eval_windows: int = 64
    seed: int = 0  # batch order; the model specs carry their own init seeds

    def __post_init__(self) -> None:
        _require("draft", self.draft.vocab_size == self.target.vocab_size, "vocab_size must equal the target's")
        for name in ("seq_len", "corpus_bytes", "eval_windows"):
            _require(name, getattr(self, name) > 0, "must be > 0")
        limit = min(self.target.max_position_embeddings, self.draft.max_position_embeddings)
        _require("seq_len", self.seq_len <= limit, f"must be <= max_position_embeddings ({limit})")
        _require("heldout_every", self.heldout_every >= 2, "must be >= 2")
        _require("target_train", self.target_train.distill_weight == 0, "distill_weight: the target has no teacher")

    def key(self) -> str:
        """Short stable hash of the spec, both corpora and the format versions."""
        fields = asdict(self)
        fields["target"], fields["draft"] = self.target.key(), self.draft.key()
        blob = json.dumps(
            {
                "pair": fields,
                "tokenizer_corpus": corpus_fingerprint(DEFAULT_CORPUS_BYTES),
                "train_corpus": corpus_fingerprint(self.corpus_bytes),
                "format": TRAIN_FORMAT_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def pair_spec(minutes: float = DEFAULT_MINUTES, seed: int = 0) -> PairSpec:
    """The default-sized pair with step counts that take about `minutes` where the rates above were measured."""
    _require("minutes", minutes > 0, "must be > 0")
    base = PairSpec()
    return replace(
        base,
        target=replace(base.target, seed=seed),
        draft=replace(base.draft, seed=seed),
        target_train=replace(base.target_train, steps=max(1, round(minutes * 2 / 3 * _TARGET_STEPS_PER_MIN))),
        draft_train=replace(base.draft_train, steps=max(1, round(minutes / 3 * _DRAFT_STEPS_PER_MIN))),
        seed=seed,
    )


DEFAULT_PAIR = pair_spec()


# --- training --------------------------------------------------------------


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens_per_s: float
    # Mean next-token loss over the first and last 10 steps (the CE part only
    # for a distilled model, so the numbers compare with the target's).
    loss_start: float
    loss_end: float


def train(
    model: PreTrainedModel, windows: torch.Tensor, cfg: TrainConfig, seed: int, label: str,
    progress: bool, teacher: PreTrainedModel | None = None,
) -> TrainResult:
    """Train `model` in place on `windows` for `cfg.steps` steps; print progress to stderr if asked."""
    if cfg.distill_weight > 0 and teacher is None:
        raise ValueError("distill_weight: > 0 needs a teacher model")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: decaying them only hurts
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cfg.lr_factor)
    meter = _Meter(label, cfg.steps, cfg.batch_size * (windows.shape[1] - 1), progress)
    ce_losses: list[float] = []
    model.train()
    for idx in batch_order(len(windows), cfg.batch_size, cfg.steps, seed):
        loss, ce = _loss(model, windows[idx], teacher, cfg.distill_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        ce_losses.append(ce)
        meter.step(ce, float(sched.get_last_lr()[0]))
    model.eval()
    seconds = meter.elapsed()
    return TrainResult(
        steps=cfg.steps, seconds=round(seconds, 1), tokens_per_s=round(meter.tokens / seconds),
        loss_start=round(_mean(ce_losses[:10]), 4), loss_end=round(_mean(ce_losses[-10:]), 4),
    )


def _loss(
    model: PreTrainedModel, batch: torch.Tensor, teacher: PreTrainedModel | None, distill_weight: float
) -> tuple[torch.Tensor, float]:
    """(loss to minimise, its next-token CE part as a float) for one batch [B, T + 1]."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits.flatten(0, 1)  # [B*T, V]
    ce = F.cross_entropy(logits, labels.flatten())
    if distill_weight == 0 or teacher is None:
        return ce, ce.item()
    with torch.no_grad():
        teacher_logp = teacher(input_ids=inputs).logits.flatten(0, 1).log_softmax(-1)
    # batchmean over the B*T rows: the mean per-position KL(teacher ‖ model).
    kl = F.kl_div(logits.log_softmax(-1), teacher_logp, log_target=True, reduction="batchmean")
    return (1 - distill_weight) * ce + distill_weight * kl, ce.item()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class _Meter:
    """Progress lines on stderr: at the first and last step and every `every_s` seconds."""

    def __init__(self, label: str, steps: int, tokens_per_step: int, enabled: bool, every_s: float = 10.0) -> None:
        self.label, self.steps, self.tokens_per_step = label, steps, tokens_per_step
        self.enabled, self.every_s = enabled, every_s
        self.start = self.last = time.perf_counter()
        self.done, self.tokens = 0, 0
        self.window: list[float] = []  # losses since the last line

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def step(self, loss: float, lr: float) -> None:
        self.done += 1
        self.tokens += self.tokens_per_step
        self.window.append(loss)
        now = time.perf_counter()
        if self.enabled and (self.done in (1, self.steps) or now - self.last >= self.every_s):
            print(self.line(_mean(self.window), lr, now - self.start), file=sys.stderr, flush=True)
            self.window, self.last = [], now

    def line(self, loss: float, lr: float, elapsed: float) -> str:
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = elapsed / self.done * (self.steps - self.done)
        return (f"{self.label}: step {self.done}/{self.steps}  loss {loss:.3f}  lr {lr:.2e}  "
                f"{rate:,.0f} tok/s  {_clock(elapsed)} elapsed  ETA {_clock(eta)}")


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


# --- building --------------------------------------------------------------


def _copy_matching(dst: PreTrainedModel, src: PreTrainedModel) -> list[str]:
    """Copy every tensor of `src` whose name and shape `dst` also has; return their names."""
    src_state = src.state_dict()
    copied = []
    with torch.no_grad():
        for name, param in dst.state_dict().items():
            if name in src_state and src_state[name].shape == param.shape:
                param.copy_(src_state[name])
                copied.append(name)
    return copied


@contextmanager
def _threads(n: int) -> Iterator[None]:
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _model_report(model: PreTrainedModel, result: TrainResult, heldout: torch.Tensor) -> dict[str, Any]:
    loss = heldout_loss(model, heldout)
    return {"params": int(model.num_parameters()), **asdict(result),
            "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 2)}


def _train_into(tmp: Path, spec: PairSpec, progress: bool, threads: int) -> dict[str, Any]:
    """Train the pair, write target/, draft/ and quality.json into `tmp`; return the report."""
    start = time.perf_counter()
    tok = tiny_tokenizer.train_tokenizer(spec.target.vocab_size, progress=progress)
    data = corpus_windows(tok, spec.corpus_bytes, spec.seq_len, spec.heldout_every, spec.skip_dirs)
    # Spread over the whole held-out stream: its first windows are a file or two.
    heldout = data.heldout[torch.linspace(0, len(data.heldout) - 1, spec.eval_windows).long().unique()]  # type: ignore[no-untyped-call]
    _log(progress, f"corpus: {data.train.numel():,} train tokens in {len(data.train):,} windows of {spec.seq_len}, "
                   f"{len(data.heldout):,} held-out windows; {threads} threads")
    with _threads(threads):
        target = init_model(spec.target, tok)
        target_result = train(target, data.train, spec.target_train, spec.seed, "target", progress)
        draft = init_model(spec.draft, tok)
        copied = _copy_matching(draft, target)
        _log(progress, f"draft: {len(copied)} tensors copied from the target")
        draft_result = train(draft, data.train, spec.draft_train, spec.seed + 1, "draft", progress, teacher=target)
        _log(progress, "measuring quality on held-out text…")
        report: dict[str, Any] = {
            "key": spec.key(),
            "machine": {"cpu": _cpu_name(), "threads": threads, "torch": torch.__version__},
            "target": _model_report(target, target_result, heldout),
            "draft": {**_model_report(draft, draft_result, heldout), "tensors_from_target": len(copied)},
            "pair": pair_quality(draft, target, heldout),
            "spec": asdict(spec),
        }
    report["seconds_total"] = float(round(time.perf_counter() - start, 1))
    save_model_dir(target, tok, tmp / "target", progress=False)
    save_model_dir(draft, tok, tmp / "draft", progress=False)
    (tmp / "quality.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def make_tiny_pair(
    out_dir: str | Path, spec: PairSpec = DEFAULT_PAIR, progress: bool = True, replace: bool = True,
    threads: int | None = None,
) -> Path:
    """Train the pair for `spec` and write `out_dir/{target,draft}` (HF-format) and `out_dir/quality.json`.

    Built next to `out_dir` and renamed into place, like `make_tiny_model`:
    readers never see a partial pair. An existing `out_dir` is replaced, or
    kept as is when `replace=False`. `threads` (default: every core this
    process may use) is torch's thread count while training; it changes the
    time taken, not the weights (as far as we have seen). Returns `out_dir`.
    """
    threads = len(os.sched_getaffinity(0)) if threads is None else threads
    _require("threads", threads > 0, "must be > 0")
    out, report, published = build_dir(out_dir, lambda tmp: _train_into(tmp, spec, progress, threads), replace)
    if progress:
        _log(True, f"{'wrote' if published else 'kept existing'} {out}")
        _log(True, json.dumps({k: report[k] for k in ("target", "draft", "pair", "seconds_total")}, indent=2))
    return out


def pair_dir(spec: PairSpec = DEFAULT_PAIR, progress: bool = True, threads: int | None = None) -> Path:
    """Path of the trained pair for `spec` in the cache, trained on first use.

    `cache_dir()/models/tiny-pair-<spec.key()>`. Training takes minutes, so
    concurrent first users take a lock and the later ones wait for the first
    to publish, rather than each training its own copy.
    """
    out = cache_dir() / "models" / f"tiny-pair-{spec.key()}"
    # build_dir's rename is the last step, so a directory that exists is complete.
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        if not _try_lock(lock):
            _log(progress, f"waiting for another process to finish training {out}…")
            deadline = time.monotonic() + TRAIN_LOCK_WAIT_S  # a trainer that hangs must not hang us
            while not _try_lock(lock):
                if time.monotonic() > deadline:
                    raise ValueError(f"another process has been training {out} for over {TRAIN_LOCK_WAIT_S:.0f} s; "
                                     f"remove {lock.name} if none is")
                time.sleep(0.5)
        if out.is_dir():
            return out
        # Only the lock holder builds this pair, so any private build dir left
        # next to it is from a process that was killed mid-training.
        for stale in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return make_tiny_pair(out, spec, progress=progress, replace=False, threads=threads)


def _try_lock(lock: Any) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def default_pair_dir(progress: bool = True) -> Path:
    """The cached pair for `DEFAULT_PAIR` (about `DEFAULT_MINUTES` to train on first use)."""
    return pair_dir(DEFAULT_PAIR, progress)
