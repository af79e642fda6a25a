"""Offline generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from tqdm import tqdm

from pdserve.workers import chat_input, generation_defaults
from pdserve.workers.chat_input import Message
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.inputs import check_template_kwargs, is_one_prompt, prompt_of
from pdserve.workers.outputs import CompletionOutput, RequestOutput, ranked
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams, sample_seed
from pdserve.workers.spec.vllm_config import speculative_settings

# vLLM's shapes: a str, {"prompt": str} (TextPrompt), {"prompt_token_ids": [...]} (TokensPrompt);
# and pdserve's bare list of token ids, which vLLM >= 0.10 refuses (workers/inputs.py).
Prompt = str | list[int] | dict[str, Any]
# A chat message as vLLM's `LLM.chat` takes it: {"role": ..., "content": ...} (OpenAI's shape).
# vLLM's engine arguments whose meaning always holds here: vLLM code passes them, pdserve takes
# them and changes nothing (no checkpoint code is ever run; prefill is always chunked).
VLLM_ALWAYS = {"trust_remote_code": (True, False), "enable_chunked_prefill": (True,)}


def engine_arguments(args: Mapping[str, object]) -> dict[str, object]:
    """`LLM(...)`'s keyword arguments as EngineConfig's: vLLM's that always hold here dropped, vLLM's
    `speculative_config` as the settings it makes (workers/spec/vllm_config.py), and
    a name that is no setting (a typo: max_num_seq) a ValueError naming it; pydantic's dataclass
    ignored such a name, and the engine ran without the setting."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, object] = {}
    if (spec := args.get("speculative_config")) is not None:
        if not isinstance(spec, (str, Mapping)):
            raise ValueError(f"speculative_config: a dict or its JSON, got {type(spec).__name__}")
        out.update(speculative_settings(spec))
    for name, value in args.items():
        if name == "speculative_config":
            continue
        if name in VLLM_ALWAYS and name not in fields:
            if value not in VLLM_ALWAYS[name]:
                raise ValueError(f"{name}: pdserve cannot take {value!r} (always {VLLM_ALWAYS[name][0]!r} here)")
            continue
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=1)
            raise ValueError(f"{name}: not an engine setting" + (f" (did you mean {close[0]}?)" if close else ""))
        out[name] = value
    return out


class LLM:
    """Batch generation over one engine. `model=None` uses the embedded tiny model
    (made once into the cache directory). Other keyword arguments are EngineConfig fields
    (a name that is none is a ValueError; vLLM's `trust_remote_code` is taken)."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        if model is None:
            from pdserve.workers.tiny.builder import default_model_dir

            model = str(default_model_dir(progress=bool(engine_args.get("progress", True))))
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_arguments(engine_args)))  # type: ignore[arg-type]
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    @property
    def tokenizer(self) -> Any:  # transformers' tokenizer (untyped)
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """vLLM's accessor of the same tokenizer: what vLLM code calls to build prompts and decode ids."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (`tensor_parallel_size` > 1)."""
        self.engine.close()

    def generate(
        self, prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        `prompts`: one prompt or a sequence of them, as vLLM's `LLM.generate` takes
        them (a str, {"prompt": str}, {"prompt_token_ids": [int, ...]}), or a list
        of token ids. `sampling_params`: one for every prompt, or one per prompt.
        All inputs are validated before any is queued: a bad one raises
        ValueError naming `prompts` or `sampling_params`, and nothing runs.
        """
        batch = [prompt_of(p) for p in ([prompts] if is_one_prompt(prompts) else list(prompts))]
        params = _broadcast_params(sampling_params if sampling_params is not None
                                   else self.get_default_sampling_params(), len(batch))
        children = []  # every sample's own parameters, made (and so checked: a child's seed) before any is queued
        for p, sp in zip(batch, params):
            self.engine.validate(p, sp)
            children.append([_child_params(sp, j) for j in range(sp.n)])
        order: dict[str, tuple[int, int]] = {}  # request id -> (prompt, sample)
        try:
            for i, (p, kids) in enumerate(zip(batch, children)):
                for j, child in enumerate(kids):
                    rid = f"{next(self._ids)}"
                    order[rid] = (i, j)
                    self.engine.add_request(rid, p, child)
            return self._run(order, params, use_tqdm)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: what this call queued leaves the engine with its blocks;
            # left there, the next call ran it too, and met outputs it did not know.
            self.engine.abort(list(order), output=False)
            raise

    def chat(
        self, messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered by the model's chat template (or `chat_template`), with
        `chat_template_kwargs` among its variables, and generated as `generate` does; each
        output's `prompt` is the rendered text."""
        chat_input.check_switches(chat_template, add_generation_prompt, continue_final_message)
        checked_tools = chat_input.check_tools(tools)
        extra = check_template_kwargs(chat_template_kwargs)
        texts = [self._chat_text(conv, chat_template, add_generation_prompt, continue_final_message, checked_tools,
                                 extra)
                 for conv in chat_input.conversations(messages)]
        # The template writes the special tokens it wants (a BOS): encoding its text with the
        # tokenizer's own too would double them (vLLM encodes it without them too).
        prompts = [{"prompt_token_ids": list(self.tokenizer.encode(t, add_special_tokens=False))} for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def _chat_text(self, conversation: list[dict[str, Any]], chat_template: str | None, add_generation_prompt: bool,
                   continue_final_message: bool, tools: list[dict[str, Any]] | None, extra: dict[str, Any]) -> str:
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("messages: this model has no chat template (a base model); pass chat_template, "
                             "or the text to generate()")
        try:
            return str(self.tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **extra))
        except TemplateSyntaxError as e:
            if chat_template is None:
                raise  # the model's own template is broken: not the caller's input
            raise ValueError(f"chat_template: not a valid template: {e}") from None
        except TemplateError as e:  # it refused them (`raise_exception`: roles that do not alternate, ...)
            raise ValueError(f"messages: the chat template refused them: {e}") from None
        except RecursionError:
            raise ValueError("messages: nested too deeply to render (tools, tool-call arguments)") from None
        except (TypeError, ValueError) as e:  # what the template does with the values failed (the server: a 400)
            raise ValueError(f"messages: the chat template could not render them (or the tools): "
                             f"{type(e).__name__}: {e}"[:500]) from None

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's own defaults
        (its generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens), as vLLM's LLM takes them; SamplingParams' defaults otherwise."""
        return SamplingParams(**generation_defaults.read(self.engine.model_dir))  # type: ignore[arg-type]

    def _run(self, order: dict[str, tuple[int, int]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        num_prompts = len(params)
        results: list[RequestOutput | None] = [None] * num_prompts
        samples: list[dict[int, CompletionOutput]] = [{} for _ in range(num_prompts)]
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm, file=sys.stderr)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished or out.request_id not in order:  # (not this call's: another caller's)
                    continue
                bar.update(1)
                i, j = order[out.request_id]
                _raise_if_refused(out, i)
                if results[i] is None:
                    results[i] = out
                samples[i][j] = out.outputs[0]
        bar.close()
        for r, got, sp in zip(results, samples, params):
            if r is not None:
                # Sample j (seeded sample_seed(seed, j)) is index j, as vLLM numbers them, whichever finished first.
                r.outputs = [self._vllm_logprobs(dataclasses.replace(got[j], index=j), sp) for j in sorted(got)]
                self._vllm_prompt_logprobs(r, sp)
        return [r for r in results if r is not None]

    def _vllm_logprobs(self, c: CompletionOutput, sp: SamplingParams) -> CompletionOutput:
        """`c` with its logprobs as vLLM's offline API has them (Logprob: rank, decoded token)."""
        if c.logprobs is not None and sp.logprobs is not None:
            n, decode = sp.logprobs, self._decode_one
            c.logprobs = [ranked(e, t, n, decode) for e, t in zip(c.logprobs, c.token_ids)]
        return c

    def _vllm_prompt_logprobs(self, r: RequestOutput, sp: SamplingParams) -> None:
        if r.prompt_logprobs is not None and sp.prompt_logprobs is not None:
            n, decode = sp.prompt_logprobs, self._decode_one
            r.prompt_logprobs = [None if e is None else ranked(e, t, n, decode)
                                 for e, t in zip(r.prompt_logprobs, r.prompt_token_ids)]

    def _decode_one(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id])
        return text


def _raise_if_refused(out: RequestOutput, prompt: int) -> None:
    """A request the engine failed alone for its own input (a grammar that dead-ends after its
    first tokens) as the ValueError the served API's 400 is: returned as an output, it read as
    one that had ended (finish_reason "abort", the error only in a field vLLM's RequestOutput
    does not have). `generate` then aborts the rest. (A row fault, the engine's, stays an output
    with `error` set.)"""
    if out.error is not None and out.error_refused:  # the message starts with the field's name
        raise ValueError(f"{out.error} (prompts[{prompt}])")


def _broadcast_params(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        sp = SamplingParams()
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if not isinstance(sp, Sequence) or not all(isinstance(p, SamplingParams) for p in sp):
        raise ValueError("sampling_params: a SamplingParams, or a list of them (one per prompt)")
    if len(sp) != n:  # vLLM: "The lengths of prompts and params must be the same."
        raise ValueError(f"sampling_params: got {len(sp)} for {n} prompts")
    return list(sp)


def _child_params(sp: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: final-only output, its own seed if the parent has one."""
    return dataclasses.replace(sp, n=1, seed=sample_seed(sp.seed, j), output_kind=RequestOutputKind.FINAL_ONLY)
