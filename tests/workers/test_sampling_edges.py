"""Sampling parameters past the happy path: what vLLM documents (its sampler's order of
operations) and what a wrong value must give (a ValueError naming the field, never a
TypeError nor a silent reading). Each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.workers.sampling_params import RequestOutputKind


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [None]),  # was a TypeError from int(None)
    ("stop_token_ids", 5),  # was a TypeError: 'int' object is not iterable
    ("stop_token_ids", [1.7]),  # was silently token 1
    ("stop_token_ids", [True]),  # was silently token 1
    ("stop_token_ids", "12"),  # was silently the tokens 1 and 2
    ("stop", 5),  # was a TypeError
    ("logit_bias", {5.5: 1.0}),  # was silently token 5
    ("logit_bias", {True: 1.0}),  # was silently token 1
    ("ignore_eos", "no"),  # was taken as true: EOS ignored
    ("include_stop_str_in_output", "no"),
    ("skip_special_tokens", None),
    ("detokenize", "false"),
    ("speculative", "no"),
    ("output_kind", "delta"),  # was kept, and matched no kind
    # Found by fuzzing the API:
    ("temperature", 10**400),  # OverflowError (float() of it), not a ValueError
    ("top_p", 10**400),  # OverflowError from math.isfinite
    ("presence_penalty", -(10**400)),
    ("logit_bias", {"5_0": 1.0}),  # int() took it: token 50
    ("logit_bias", {"\uff15": 1.0}),  # a full-width 5: token 5
    ("logit_bias", {" 5 ": 1.0}),
    ("max_tokens", np.bool_(True)),  # numpy's bool is no more an integer than Python's
    ("n", np.float64(2.0)),
    ("temperature", np.float32("nan")),
])
def test_a_wrong_type_is_a_valueerror_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_right_types_still_pass() -> None:
    kw: dict[str, object] = dict(stop_token_ids=(np.int64(7), 9), stop=("a", "b"),
                                 logit_bias={"5": 1.0, np.int32(6): -2}, ignore_eos=True,
                                 output_kind=RequestOutputKind.DELTA)
    sp = SamplingParams(**kw)  # type: ignore[arg-type]  # numpy ids, tuples, JSON's string keys
    assert sp.stop_token_ids == [7, 9] and type(sp.stop_token_ids[0]) is int
    assert sp.stop == ["a", "b"] and sp.logit_bias == {5: 1.0, 6: -2.0}


def test_numpy_scalars_are_taken_as_pythons() -> None:
    """What arithmetic on numpy arrays gives (a length budget, a temperature schedule) was
    "must be an integer" for the scalar fields while token id lists took numpy's integers."""
    sp = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), min_tokens=np.uint8(1), top_k=np.int64(4),
                        seed=np.int64(3), logprobs=np.int16(2), temperature=np.float32(0.5),
                        top_p=np.float16(0.5), repetition_penalty=np.float32(1.25))  # type: ignore[arg-type]
    assert (sp.n, sp.max_tokens, sp.min_tokens, sp.top_k, sp.seed, sp.logprobs) == (2, 5, 1, 4, 3, 2)
    assert (sp.temperature, sp.top_p, sp.repetition_penalty) == (0.5, 0.5, 1.25)
    assert all(type(getattr(sp, f)) is int for f in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs"))
    assert all(type(getattr(sp, f)) is float for f in ("temperature", "top_p", "repetition_penalty"))


def test_stop_strings_without_detokenize_are_refused_as_vllm_does() -> None:
    # A stop string is matched in the output's text: with detokenize=False none is made, and the
    # request returned the text it had asked not to be made. vLLM refuses the pair.
    with pytest.raises(ValueError, match="^stop: .*detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(stop_token_ids=[5], detokenize=False).stop == []
