"""Request fields → the engine's SamplingParams; the engine's ValueError (naming the field) becomes a 400."""
from __future__ import annotations

from engine import SamplingParams

from .errors import bad_request
from .protocol import SamplingFields


def sampling_params(
    body: SamplingFields, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty or 1.0,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=body.logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def check_logprobs(requested: int | None, limit: int, param: str) -> None:
    if requested is not None and requested > limit:
        raise bad_request(f"{param} must be at most {limit}, got {requested}.", param)
