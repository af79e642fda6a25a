"""What tokenizing costs on the gateway's event loop against a hop to the tokenizer pool
(cluster/tokenizer_pool.py `INLINE_CHARS`; cluster/gateway.py `TEMPLATE_CHARS_PER_MESSAGE`).

For prompts of several lengths: CPU per job of `tokenizer.encode` run inline, and of the same job
through `TokenizerPool.run` on a thread (inline disabled), awaited from a uvloop loop. Then a chat
template rendered and encoded for chats of 1 to 512 one-character messages: a cost that grows with
the messages, not with their text.

    python bench/experiments/tokenize_inline.py [--model tiny] [--jobs 2000]
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import cpu_name  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="whose tokenizer (and chat template)")
    p.add_argument("--jobs", type=int, default=2000)
    a = p.parse_args()
    import uvloop
    from transformers import AutoTokenizer

    from pdserve.cluster.tokenizer_pool import TokenizerPool
    from pdserve.workers.model.resolve import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(a.model, progress=True)))
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; model {a.model}; {a.jobs} jobs a row\n")
    print("| prompt characters | inline, us of CPU a job | through the pool, us of CPU a job |")
    print("|---:|---:|---:|")
    for n in (11, 256, 512, 1024, 4096):
        s = text[:n]
        t = time.process_time()
        for _ in range(a.jobs):
            tok.encode(s)
        inline = (time.process_time() - t) / a.jobs * 1e6
        pool = TokenizerPool(2, inline_chars=0)

        async def hop() -> None:
            for _ in range(a.jobs):
                await pool.run(n, lambda: tok.encode(s))  # noqa: B023 - awaited within the iteration

        t = time.process_time()
        uvloop.run(hop())
        pooled = (time.process_time() - t) / a.jobs * 1e6
        pool.shutdown()
        print(f"| {n} | {inline:.1f} | {pooled:.1f} |")
    if tok.chat_template is None:
        return
    print("\n| chat messages (one character each) | rendered characters | template + encode, us of CPU |")
    print("|---:|---:|---:|")
    for m in (1, 8, 64, 512):
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(m | 1)]
        jobs = max(10, a.jobs // m)
        t = time.process_time()
        for _ in range(jobs):
            rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            tok.encode(rendered, add_special_tokens=False)
        print(f"| {len(msgs)} | {len(rendered)} | {(time.process_time() - t) / jobs * 1e6:.0f} |")


if __name__ == "__main__":
    main()
