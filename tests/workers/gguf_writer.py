"""Small llama-architecture GGUF files as llama.cpp's converter writes them, around a BPE
tokenizer trained here (on the Python standard library's sources) with the pre-tokenizer of
the kind of model imitated: SmolLM's (digits one by one, then GPT-2's), Llama 3's, GPT-2's."""
from __future__ import annotations

import glob
import json
import sysconfig
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus() -> list[str]:
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:60]
    return [Path(f).read_text(errors="ignore") for f in files] + ["Paris 1234 2024-11-05 3.14159 x=  10\n"] * 50


def train(style: str, vocab_size: int = 1500) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if style == "smollm":  # SmolLM/SmolLM2/StarCoder tokenizer.json: digits one by one, then GPT-2's byte level
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif style == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if style == "llama3":
        bos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                           special_tokens=[("<|endoftext|>", bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write(tok: Tokenizer, out: Path, pre: str, *, bos: str = "<|im_start|>", eos: str = "<|im_end|>",
          add_bos: bool = False, extra: dict[str, int] | None = None, hidden: int = 64, heads: int = 4,
          kv: int = 2) -> Path:
    """A one-layer llama GGUF at `out` with `tok` as its vocabulary and `pre` as tokenizer.ggml.pre."""
    data = json.loads(tok.to_str())
    vocab = dict(data["model"]["vocab"])
    for a in data["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {a["id"] for a in data["added_tokens"]}
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    w.add_bos_token_id(vocab[bos])
    w.add_eos_token_id(vocab[eos])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    for k, v in (extra or {}).items():
        w.add_uint32(k, v)
    rng = np.random.default_rng(0)
    hd = hidden // heads
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (heads * hd, hidden), "blk.0.attn_k.weight": (kv * hd, hidden),
              "blk.0.attn_v.weight": (kv * hd, hidden), "blk.0.attn_output.weight": (hidden, heads * hd),
              "blk.0.ffn_gate.weight": (2 * hidden, hidden), "blk.0.ffn_up.weight": (2 * hidden, hidden),
              "blk.0.ffn_down.weight": (hidden, 2 * hidden)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_original(tok: Tokenizer, bos: str = "<|im_start|>", eos: str = "<|im_end|>") -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=TEMPLATE)
