"""Byte-level BPE tokenizer for the tiny test models, trained on the stdlib corpus.

Byte-level (GPT-2 / Llama 3 / Qwen2 style) so that any text, in any script,
round-trips exactly: every byte has a token, merges only shorten sequences.
Training is quick, but tests call it many times, so the trained
`tokenizer.json` is cached under `cache_dir()/tokenizers/`, keyed by
(vocab size, corpus fingerprint, FORMAT_VERSION).

Determinism: `tokenizers`' BpeTrainer (0.23) produced byte-identical
tokenizer.json across processes (different hash seeds) and across 1, 2, 4 and
16 rayon threads (RAYON_RS_NUM_CPUS), because word counts are summed
(order-free) and merge ties are broken by the pair itself. So we do not force
single-threaded training; `tests/workers/test_tiny_model.py` checks it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from .corpus import DEFAULT_CORPUS_BYTES, cache_dir, corpus_fingerprint, iter_corpus

# Bump when anything below changes what a trained tokenizer looks like
# (specials, normalisation, trainer settings): it invalidates cached files.
FORMAT_VERSION = 1

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Trainer order fixes their ids: 0..4, ahead of the 256-byte alphabet.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

# ChatML. No BOS in the template: the tokenizer does not add one either
# (Qwen2 style), so a chat prompt is exactly what this string renders.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: "hello" and " hello" stay different tokens and
    # decoding never invents a leading space, so encode→decode is exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Only affects offsets; trim_offsets=False keeps offsets covering the
    # spaces that byte-level tokens carry, matching the raw text.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _cache_path(vocab_size: int, corpus_bytes: int) -> Path:
    key = f"v{FORMAT_VERSION}-vocab{vocab_size}-{corpus_fingerprint(corpus_bytes)[:16]}"
    return cache_dir() / "tokenizers" / f"bpe-{key}.json"


def _write_atomic(path: Path, text: str) -> None:
    # Temp file in the same directory + os.replace: concurrent trainers (e.g.
    # pytest-xdist workers) each write a complete file and the last one wins;
    # a reader never sees half a tokenizer.json.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train_tokenizer(
    vocab_size: int = 4096,
    corpus_bytes: int = DEFAULT_CORPUS_BYTES,
    progress: bool = False,
    use_cache: bool = True,
) -> Tokenizer:
    """Train (or load from cache) a byte-level BPE tokenizer on the stdlib corpus.

    `vocab_size` counts everything: the 5 special tokens, the 256 byte
    symbols and the merges. The result is deterministic: the same arguments
    on the same Python install give a byte-identical `tokenizer.json`.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size: must be >= {MIN_VOCAB_SIZE} (specials + 256 bytes), got {vocab_size}")
    path = _cache_path(vocab_size, corpus_bytes)
    if use_cache and path.is_file():
        return Tokenizer.from_file(str(path))
    if progress:
        _log(f"training tokenizer… (vocab {vocab_size}, {corpus_bytes} corpus bytes)")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=progress,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so text with bytes the corpus never
        # contained still encodes (no unknown token exists in byte-level BPE).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(iter_corpus(corpus_bytes), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        # The corpus ran out of pairs to merge: a silently smaller vocab would
        # desynchronise config.vocab_size expectations downstream.
        raise ValueError(
            f"vocab_size: corpus of {corpus_bytes} bytes only supports {tok.get_vocab_size()} tokens, "
            f"asked {vocab_size}"
        )
    if use_cache:
        _write_atomic(path, tok.to_str())
    return tok


def wrap_tokenizer(tok: Tokenizer, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Wrap a trained tokenizer as a transformers fast tokenizer with specials + ChatML template."""
    kwargs: dict[str, object] = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Registered as special so decode(skip_special_tokens=True) drops them.
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens, by name: bos, eos, im_start, im_end, pad."""
    ids: dict[str, int] = {}
    for name, text in zip(("bos", "eos", "im_start", "im_end", "pad"), SPECIAL_TOKENS):
        token_id = tok.token_to_id(text)
        if token_id is None:
            raise ValueError(f"tokenizer: special token {text!r} is missing")
        ids[name] = token_id
    return ids


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int | None = None) -> list[Path]:
    """Write the HF tokenizer files (tokenizer.json, tokenizer_config.json, ...) into `out_dir`.

    The chat template goes into tokenizer_config.json (not the separate
    chat_template.jinja transformers 5 writes by default), where every
    serving stack looks for it. Returns the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = wrap_tokenizer(tok, model_max_length=model_max_length)
    written = fast.save_pretrained(str(out), save_jinja_files=False)
    return [Path(p) for p in written if Path(p).is_file()]
