"""The offline entry point, in vLLM's shape: `LLM(...).generate(prompts, params, lora_request=...)`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .lora_request import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class _PromptInput:
    """One prompt as the engine takes it, and its text when the prompt is token ids rendered from one."""

    prompt: Prompt
    text: str | None = None


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None, seed: int = 0,
                 tensor_parallel_size: int = 1, admission_order: str = "balanced", **engine_kwargs):
        """admission_order: "balanced" by default, unlike the engine and the server (arrival order): a batch
        handed to `generate` arrives at once and comes back in its own order, so admitting it adapter by
        adapter costs no one a place in a queue, and with more adapters than slots it takes fewer steps
        (BENCHMARKS.md, workload (d))."""
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, seed=seed, tensor_parallel_size=tensor_parallel_size,
            admission_order=admission_order, **engine_kwargs,
        ))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | dict | Sequence[Prompt | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params", SamplingParams)
        loras = _per_prompt(lora_request, len(prompts), "lora_request", LoRARequest)
        _check_lora_ids(loras)
        return self._run(prompts, params, loras, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """As vLLM's: each conversation rendered by the chat template, which writes its own special tokens;
        the outputs' prompt is the rendered text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    def _run(self, prompts: list[_PromptInput], params: list[SamplingParams], loras: list[LoRARequest | None],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        if engine.lora_manager is not None:
            engine.lora_manager.ensure_loaded(lora for lora in loras if lora is not None)
        ids = []
        try:
            for prompt, param, lora in zip(prompts, params, loras):
                ids.append(engine.add_request(prompt.prompt, param, lora, stop_at_context_end=True,
                                              prompt_text=prompt.text))
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                errors = engine.take_errors()
                if errors:
                    for request_id in ids:
                        engine.abort(request_id)
                    raise next(iter(errors.values()))
        engine.drain()  # a step left in flight (async scheduling) only computed tokens that are dropped
        return [finished[request_id] for request_id in ids]


def _as_prompt_list(prompts) -> list[_PromptInput]:
    """vLLM's prompt forms, one or a list: text, token ids, or a dict with `prompt` or `prompt_token_ids`."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    else:
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
    return [_prompt(prompt) for prompt in prompts]


def _prompt(prompt) -> _PromptInput:
    """A dict with both keys is token ids and the text they came from, as vLLM's chat passes them."""
    if not isinstance(prompt, dict):
        return _PromptInput(prompt)
    if "prompt_token_ids" in prompt:
        return _PromptInput(list(prompt["prompt_token_ids"]), prompt.get("prompt"))
    if "prompt" in prompt:
        return _PromptInput(prompt["prompt"])
    raise ValueError(f"A prompt dict needs a 'prompt' or a 'prompt_token_ids' key; this one has {sorted(prompt)}")


def _per_prompt(value, count: int, name: str, kind: type) -> list:
    if value is None or isinstance(value, kind):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"The lengths of prompts ({count}) and {name} ({len(values)}) must be the same.")
    return values


def _check_lora_ids(loras: list[LoRARequest | None]) -> None:
    seen: dict[int, LoRARequest] = {}
    for lora in loras:
        if lora is None:
            continue
        other = seen.setdefault(lora.lora_int_id, lora)
        if (other.lora_name, other.lora_path) != (lora.lora_name, lora.lora_path):
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} is used by two different adapters: "
                f"{other.lora_name!r} ({other.lora_path}) and {lora.lora_name!r} ({lora.lora_path})"
            )
