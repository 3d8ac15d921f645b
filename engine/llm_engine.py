"""The synchronous engine core: add requests, step the batch, collect outputs, abort."""
from __future__ import annotations

import itertools
import logging
import operator
import os
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import transformers

from adapters_registry import ModelInfo

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, TokenTexts
from .gc_heap import collector_paused
from .kv_cache import BlockAllocator, allocate_kv_caches, bytes_per_block
from .lora_request import LoRARequest
from .model import LlamaForCausalLM
from .model_loader import (
    encode_prompt,
    iter_safetensors,
    load_hf_config,
    load_tokenizer,
    resolve_model_dir,
)
from .model_runner import ModelRunner
from .flat_logprobs import FlatLogprobs, LogprobRecord
from .outputs import CompletionOutput, PositionLogprobs, RequestOutput
from .logprobs import PromptLogprobs, compute_logprobs
from .sampler import PendingTokens, SampledToken, Sampler, is_plain_greedy, make_generator
from .sampling_params import SamplingParams, bad_words_token_ids
from .sampling_row import SamplingRow
from .scheduler import ScheduledSequence, Scheduler
from .sequence import IN_FLIGHT_TOKEN, Request, Sequence, SequenceStatus
from .step_input import DeviceTokens, host_to_device
from .warmup import warm_up_decode_attention, warm_up_eager_steps, warm_up_greedy

if TYPE_CHECKING:
    from .lora_manager import LoRAResidency

logger = logging.getLogger("loraserve.engine")

# the class a checkpoint of each model type is, for configs that do not say (GGUF conversions)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class InFlightStep:
    """A step launched but whose tokens (drawn on the device) the host has not read (async scheduling)."""

    seqs: list[Sequence]  # one per sampled row, in order
    tokens: PendingTokens | None  # None when it samples for no sequence (prompt chunks only)
    rows: dict[int, int]  # seq_id -> its row in tokens
    prompt_logprobs: list[PromptLogprobs]  # read back with the tokens


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    lora_slots_used: int
    lora_slots_total: int
    num_preemptions: int
    lora_slot_loads: int  # counters since start: adapters copied into slots, and read from disk
    lora_disk_reads: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    return torch.device(device)


def limit_host_threads(device: torch.device) -> None:
    """On a GPU the host's torch work is bookkeeping and adapter reads. With one intra-op thread each,
    the threads reading adapters do not crowd out the one launching the GPU work (vLLM's workers run
    with OMP_NUM_THREADS=1 for the same reason). An OMP_NUM_THREADS the user set wins."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU, float32 on the CPU (where half precision is slow and inexact)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        started = time.perf_counter()
        self.config = config
        self.device = resolve_device(config.device)
        limit_host_threads(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir, self.model_name = resolve_model_dir(config.model, config.revision)
        self.hf_config = load_hf_config(model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' decoded tokens
        limit = self.hf_config.max_position_embeddings
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's "
                             f"max_position_embeddings ({limit})")
        self.model = self._build_model(model_dir)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("model %s loaded in %.1f s: %.2f GiB of weights in %s on %s", self.model_name,
                    time.perf_counter() - started, weights / 2**30, str(self.dtype).removeprefix("torch."),
                    self.device)
        self.block_size = config.block_size
        # adapter slots are allocated before the KV cache is sized from what memory is left
        self.lora_manager = self._build_lora_manager() if config.enable_lora else None
        num_blocks = self._num_kv_blocks()
        attn = self.model.layers[0].self_attn  # this rank's KV heads under tensor parallelism
        # one block more than the allocator hands out: a scratch block for CUDA-graph padding rows
        kv_caches = allocate_kv_caches(self.hf_config.num_hidden_layers, num_blocks + 1, self.block_size,
                                       attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.block_size, sum(t.nbytes for kv in kv_caches for t in kv) / 2**30)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(
            self.allocator, self.block_size, config.max_num_seqs,
            config.max_num_batched_tokens or max(4096, min(self.max_model_len, 8192)),
            adapter_slots=self.lora_manager, admission_order=config.admission_order,
            suspend_margin=config.suspend_margin,
        )
        self.runner = ModelRunner(self.model, kv_caches, self.block_size, self.device,
                                  lora_slot_ranks=None if self.lora_manager is None else self.lora_manager.slot_ranks)
        if self.device.type == "cuda" and not config.enforce_eager and config.tensor_parallel_size == 1:
            piecewise = config.cudagraph_mode == "full_and_piecewise"
            capture_started = time.perf_counter()
            with collector_paused():
                self.runner.enable_cuda_graphs(
                    config.max_num_seqs, self.max_model_len, scratch_block=num_blocks,
                    max_num_batched_tokens=self.scheduler.max_num_batched_tokens if piecewise else None)
            logger.info("CUDA graphs captured in %.1f s: %d decode buckets, %d mixed-step buckets",
                        time.perf_counter() - capture_started, len(self.runner.graphs.buckets),
                        len(self.runner.piecewise.buckets) if self.runner.piecewise else 0)
        if self.device.type == "cuda" and config.tensor_parallel_size == 1:
            warm_up_eager_steps(self.runner, max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
                                max_model_len=self.max_model_len, scratch_block=num_blocks,
                                lora_slot=0 if config.enable_lora else None)
            warm_up_decode_attention(self.runner, max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                     scratch_block=num_blocks)
        # the overlap needs the host to run ahead of the device: CUDA graphs, one process (a test may
        # take the same path with eager steps)
        self.async_scheduling = config.async_scheduling and config.tensor_parallel_size == 1 and (
            self.runner.graphs is not None or config.async_scheduling_eager)
        self._in_flight: InFlightStep | None = None
        self.eos_token_ids = self._eos_token_ids(model_dir)
        self.sampler = Sampler(self.eos_token_ids, self.hf_config.vocab_size)
        if self.device.type == "cuda":
            warm_up_greedy(self.sampler, self.dtype, self.device, self.scheduler.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self._errors: dict[str, BaseException] = {}
        self._pending_detokenization: list[tuple[Sequence, int]] = []
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        torch.manual_seed(config.seed)
        if self.lora_manager is not None:  # its reader processes started with it, and imported meanwhile
            self.lora_manager.wait_for_reader()
        logger.info("engine ready in %.1f s", time.perf_counter() - started)

    def _build_model(self, model_dir) -> LlamaForCausalLM:
        if self.config.tensor_parallel_size > 1:
            from .parallel import launch_tensor_parallel

            return launch_tensor_parallel(self.config, self.hf_config, model_dir, dtype=self.dtype,
                                          device=self.device, max_model_len=self.max_model_len)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.hf_config, self.max_model_len)
        finally:
            torch.set_default_dtype(previous)
        if self.config.load_format == "dummy":
            model.init_dummy_weights(self.config.seed)
        else:
            model.load_weights(iter_safetensors(model_dir))
        return model.eval()

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        attn = self.model.layers[0].self_attn
        per_block = bytes_per_block(self.hf_config.num_hidden_layers, attn.num_kv_heads, attn.head_dim,
                                    self.block_size, self.dtype)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // self.block_size)
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization)) - (2 << 30)  # graphs, activations
        else:
            budget = 1 << 30
        return max(1, min(wanted, budget // per_block - 1))

    def _build_lora_manager(self):
        from .lora_manager import LoRAManager

        hooks = self.model.lora_hooks(self.model_info) if self.config.tensor_parallel_size > 1 else {}
        return LoRAManager(self.model, self.model_info, max_loras=self.config.max_loras,
                           max_lora_rank=self.config.max_lora_rank, max_cpu_loras=self.config.max_cpu_loras,
                           device=self.device, dtype=self.dtype,
                           allow_pickle=self.config.allow_pickle_adapters,
                           read_in_process=self._adapter_reads_in_process(), **hooks)

    def _adapter_reads_in_process(self) -> bool | None:
        """On a GPU the engine thread is mostly kernel launches, which reader threads slow down through the
        GIL: there reads go to child processes (`adapter_reader="auto"`) when shared memory has room for the
        host pool (None: the manager checks). On the CPU threads cost less."""
        reader = self.config.adapter_reader
        if reader == "auto":
            return None if self.device.type == "cuda" and self.config.tensor_parallel_size == 1 else False
        return reader == "process"

    @cached_property
    def model_info(self):
        """What adapters are validated against (built once: the model's shapes never change)."""
        architectures = getattr(self.hf_config, "architectures", None) or [ARCHITECTURES[self.hf_config.model_type]]
        return ModelInfo(architecture=architectures[0], model_type=self.hf_config.model_type,
                         name_or_path=self.model_name, module_shapes=self.model.module_shapes(),
                         max_lora_rank=self.config.max_lora_rank)

    def _eos_token_ids(self, model_dir) -> set[int]:
        """The tokenizer's, config.json's and generation_config.json's end-of-sequence ids (as vLLM stops at the
        last's too: chat models often list their end-of-turn token there only)."""
        try:
            generation_eos = transformers.GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:  # no generation_config.json
            generation_eos = None
        ids = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.hf_config, "eos_token_id", None), generation_eos):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(value)
        return ids

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None, request_id: str | None = None,
                    stop_at_context_end: bool = False, prompt_text: str | None = None,
                    bad_word_ids: list[list[int]] | None = None) -> str:
        """stop_at_context_end: a prompt whose max_tokens reach past the context window stops at its end (vLLM's
        offline engine) rather than being refused (its OpenAI server). prompt_text: the text token ids were
        rendered from (a chat template's), reported as the outputs' prompt. bad_word_ids: params.bad_words
        tokenized by the caller (`bad_words_token_ids`), off the engine thread."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(next(self._request_ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        text = prompt if isinstance(prompt, str) else prompt_text
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        context_room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:  # as many as the context window, and the KV cache, hold
            cache_room = self.allocator.num_blocks * self.block_size - len(token_ids)
            params = _with_max_tokens(params, max(min(context_room, cache_room), 1))
        elif stop_at_context_end and 0 < context_room < params.max_tokens:
            params = _with_max_tokens(params, context_room)
        self._check_prompt(token_ids, params)
        bad_words = bad_word_ids if bad_word_ids is not None else bad_words_token_ids(params.bad_words, self.tokenizer)
        self.sampler.validate(params, bad_words)
        if lora_request is not None:
            if self.lora_manager is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} was requested but LoRA is not "
                                 f"enabled; start the engine with enable_lora=True")
            self.lora_manager.ensure_loaded([lora_request])
        request = Request(request_id, text, token_ids, params, lora_request, bad_words_token_ids=bad_words)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = _logprob_record(params, [None])
        for index in range(params.n):
            generator = make_generator(params.seed, index, self.device) if params.seed is not None else None
            seq = Sequence(next(self._seq_ids), request, index, list(token_ids),
                           IncrementalDetokenizer(self.tokenizer, token_ids, params), generator)
            seq.logprobs = _logprob_record(params) if params.logprobs is not None else None
            request.sequences.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty")
        vocab = self.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {vocab})")
        wanted = len(token_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(token_ids)} in the prompt, {params.max_tokens or 1} in the completion). "
                f"Please reduce the length of the prompt or max_tokens."
            )
        blocks = -(-wanted // self.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"The request needs {blocks} KV cache blocks but the cache has only "
                             f"{self.allocator.num_blocks}")

    def add_lora(self, lora_request: LoRARequest, adapter=None) -> None:
        """Register an adapter (with its weights, if already loaded). An id unloaded while requests for it are
        still queued or running is refused until they end: they would run with the new adapter's weights."""
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled; start the engine with enable_lora=True")
        int_id = lora_request.lora_int_id
        if int_id in self.lora_manager.removed and self._adapter_in_use(int_id):
            raise ValueError(f"lora_int_id {int_id} was unloaded, and requests still use its old weights; add the "
                             f"adapter under another id")
        self.lora_manager.add(lora_request, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        """Unload an adapter: new requests for it fail; those already queued or running finish with it."""
        if self.lora_manager is not None:
            self.lora_manager.remove(lora_int_id)

    def lora_status(self) -> dict[int, LoRAResidency]:
        """Each adapter's residency (`LoRAManager.status`), unloaded ones listed while any unfinished request,
        queued ones too, uses them."""
        if self.lora_manager is None:
            return {}
        return self.lora_manager.status(in_use={request.lora_int_id for request in self.requests.values()})

    def _release_unloaded_adapter(self, request: Request) -> None:
        """An unloaded adapter's last request ended: its slot and host copy (or a read still landing) go now."""
        int_id = request.lora_int_id
        if int_id and int_id in self.lora_manager.removed and not self._adapter_in_use(int_id):
            self.lora_manager.release(int_id)

    def _adapter_in_use(self, lora_int_id: int) -> bool:
        """Whether a request not yet finished (queued or running) is for this adapter."""
        return any(request.lora_int_id == lora_int_id for request in self.requests.values())

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._release_unloaded_adapter(request)
        for seq in request.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                seq.drop_in_flight_token()  # its step's token is dropped when read back
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs, or a step's tokens are still to be read back."""
        return bool(self.requests) or self._in_flight is not None

    def take_errors(self) -> dict[str, BaseException]:
        """Requests the engine had to give up on since the last call (their adapter's weights could not
        be read), with why; they are already aborted, and every other request carries on."""
        errors, self._errors = self._errors, {}
        return errors

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.request_id in self.requests:
            self.abort(request.request_id)
            self._errors[request.request_id] = error

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass. Detokenizing the previous step's tokens (and matching stop strings) and
        building their outputs run while the GPU computes this one, so a sequence ended by a stop
        string is seen one step late (its extra token is dropped) and streamed text lags the tokens
        by one step.

        Async scheduling: a step is left in flight (its tokens drawn on the device, whatever the sampling
        parameters, and its prompt logprobs computed there); the next step is scheduled and launched first, its
        decode rows' input ids (and the last output token its penalties and bad words look at) taken on the
        device from the in-flight tokens, and only then are the in-flight tokens read back and appended. The
        outputs are the same, one step later; a sequence that ended in the step read back had one more token
        computed, which is dropped. A sequence ending by a token (EOS, a stop token) in the step in flight is not
        known to end when the next step is scheduled: that step computes a row for it, and the room it leaves is
        admitted into a step later than a synchronous engine would (as vLLM's async scheduling does); one ending
        by its length makes room at once. When the next step cannot be scheduled before the tokens are read (a
        preemption is due), the step in flight is drained first."""
        if self._in_flight is not None:
            return self._step_after_in_flight()
        plan = self.scheduler.schedule()
        for seq, error in plan.failed:
            self._fail(seq.request, error)
        if plan.empty:
            if self.lora_manager:
                self.lora_manager.wait_for_reads(timeout=0.1)
            return [self._output(request) for request in self._finish_detokenization().values()]
        scheduled = _decodes_first(plan.scheduled)
        if self._may_leave_in_flight(scheduled):
            return self._launch_in_flight(scheduled, None)
        result = self.runner.execute(scheduled, self._adapter_slots(scheduled))
        return list(self._complete(scheduled, result, {}).values())

    def _complete(self, scheduled: list[ScheduledSequence], result,
                  outputs: dict[str, RequestOutput]) -> dict[str, RequestOutput]:
        """A synchronous step after its forward's launch: prompt logprobs, the previous step's detokenization,
        sampling. outputs: those built already this step (newer ones replace them)."""
        for prompt_logprobs in self._prompt_logprobs(scheduled, result):
            prompt_logprobs.attach(self.token_texts.fill)
        sampling = [i for i, item in enumerate(scheduled) if item.samples]
        logits = None
        if sampling:
            rows = [result.starts[i] + scheduled[i].num_new_tokens - 1 for i in sampling]
            logits = self.model.compute_logits(_take_rows(result.hidden, rows))
        outputs.update((request_id, self._output(request))
                       for request_id, request in self._finish_detokenization().items())
        sampled = self._sample(logits, [scheduled[i].seq for i in sampling]) if sampling else []
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        self._append_sampled([scheduled[i].seq for i in sampling], sampled, outputs)
        return outputs

    def _may_leave_in_flight(self, scheduled: list[ScheduledSequence]) -> bool:
        """A step may stay in flight when the next can be scheduled before its tokens are read: it covers every
        running sequence. An eager step qualifies too: a long prompt's launch takes less time than its work."""
        return self.async_scheduling and len(scheduled) == len(self.scheduler.running)

    def drain(self) -> list[RequestOutput]:
        """Read back the step in flight, if any, and return its outputs: afterwards every sequence's
        token_ids are real tokens (for code that builds a step by hand, like a profiler)."""
        previous, self._in_flight = self._in_flight, None
        return list(self._read_back(previous).values()) if previous is not None else []

    def _step_after_in_flight(self) -> list[RequestOutput]:
        plan = None
        if self.async_scheduling:  # may be switched off live
            scheduler = self.scheduler
            ending = [seq for seq in scheduler.running if self._ends_at_length(seq)]
            if not scheduler.waiting or not ending:  # a decode of the same sequences, unless room opens
                plan = scheduler.schedule_decode()
            if plan is None and scheduler.running_fit():
                for seq in ending:
                    scheduler.retire(seq)
                plan = scheduler.schedule()
        if plan is None:  # drain, and schedule afresh next step
            return self.drain()
        for seq, error in plan.failed:
            self._fail(seq.request, error)
        previous, self._in_flight = self._in_flight, None
        if plan.empty:
            return list(self._read_back(previous).values())
        scheduled = _decodes_first(plan.scheduled)
        if self._may_leave_in_flight(scheduled):
            return self._launch_in_flight(scheduled, previous)
        # launched before `previous` is read, then sampled here once it is
        result = self.runner.execute(scheduled, self._adapter_slots(scheduled), _device_tokens(scheduled, previous))
        return list(self._complete(scheduled, result, self._read_back(previous)).values())

    def _ends_at_length(self, seq: Sequence) -> bool:
        """True when the sequence's last token (a placeholder when in flight) reaches max_tokens or the context."""
        length = len(seq.token_ids)
        return length - seq.num_prompt_tokens >= seq.request.params.max_tokens or length >= self.max_model_len

    def _launch_in_flight(self, scheduled: list[ScheduledSequence],
                          previous: InFlightStep | None) -> list[RequestOutput]:
        """Launch a step whose tokens are drawn on the device, decode rows first (their inputs from `previous`'s
        tokens on the device), then read `previous` back while the device computes it; the step stays in flight."""
        result = self.runner.execute(scheduled, self._adapter_slots(scheduled), _device_tokens(scheduled, previous))
        prompt_logprobs = self._prompt_logprobs(scheduled, result, previous.prompt_logprobs if previous else ())
        sampling = [(start + item.num_new_tokens - 1, item.seq)
                    for start, item in zip(result.starts, scheduled) if item.samples]
        seqs = [seq for _, seq in sampling]
        tokens = None
        if sampling:
            rows = [row for row, _ in sampling]
            tokens = self._sample_pending(self.model.compute_logits(_take_rows(result.hidden, rows)), seqs, previous)
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        self._in_flight = InFlightStep(seqs, tokens, {seq.seq_id: row for row, seq in enumerate(seqs)},
                                       prompt_logprobs)
        outputs = self._read_back(previous)
        for seq in seqs:  # after the outputs: they never show a placeholder
            if seq.status is not SequenceStatus.FINISHED:
                seq.token_ids.append(IN_FLIGHT_TOKEN)
        return list(outputs.values())

    def _read_back(self, step: InFlightStep | None) -> dict[str, RequestOutput]:
        """What a synchronous step does after its forward, for the step in flight: record its prompt logprobs,
        detokenize the tokens appended before, then wait for its tokens and append them (none for a sequence that
        ended)."""
        seqs = step.seqs if step is not None else []
        for prompt_logprobs in step.prompt_logprobs if step is not None else ():
            prompt_logprobs.attach(self.token_texts.fill)
        for seq in seqs:
            seq.drop_in_flight_token()
        outputs = {request_id: self._output(request)
                   for request_id, request in self._finish_detokenization().items()}
        if seqs:
            self._append_sampled(seqs, step.tokens.result(), outputs)
        return outputs

    def _append_sampled(self, seqs: list[Sequence], sampled: list[SampledToken],
                        outputs: dict[str, RequestOutput]) -> None:
        for seq, token in zip(seqs, sampled):
            if seq.status is SequenceStatus.FINISHED:  # ended by a stop string found above, or earlier
                continue
            if self._append_token(seq, token):
                self._pending_detokenization.append((seq, token.token_id))
            else:  # one output per request and step: this newer one replaces any built above
                outputs[seq.request.request_id] = self._output(seq.request)

    def _finish_detokenization(self) -> dict[str, Request]:
        """Detokenize the tokens the last step appended; end sequences whose stop string matched."""
        touched: dict[str, Request] = {}
        for seq, token_id in self._pending_detokenization:
            if seq.status is SequenceStatus.FINISHED:
                continue
            matched = seq.detokenizer.append(token_id)
            if matched is not None:
                self._finish(seq, "stop", matched)
            touched[seq.request.request_id] = seq.request
        self._pending_detokenization.clear()
        return touched

    def _adapter_slots(self, scheduled: list[ScheduledSequence]) -> list[int]:
        """The LoRA slot of each scheduled sequence (-1: base), looked up once per adapter in the batch."""
        if not self.lora_manager:
            return [-1] * len(scheduled)
        slot_of: dict[int, int] = {}  # adapter int id (0: base) -> slot
        slots = []
        for item in scheduled:
            lora = item.seq.request.lora_request
            key = lora.lora_int_id if lora is not None else 0
            slot = slot_of.get(key)
            if slot is None:
                slot = slot_of[key] = self.lora_manager.slot_for(lora)
            slots.append(slot)
        self.lora_manager.wait_for_loads()
        return slots

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """A batch asking for nothing but greedy tokens skips the sampler's per-row work (same tokens)."""
        if _all_plain_greedy(seqs):
            return self.sampler.greedy(logits)
        return self.sampler(logits, [self._sampling_row(seq) for seq in seqs])

    def _sample_pending(self, logits: torch.Tensor, seqs: list[Sequence],
                        previous: InFlightStep | None) -> PendingTokens:
        """_sample's tokens left on the device; the sequences `previous` sampled for find their last token among
        its tokens on the device."""
        if _all_plain_greedy(seqs):
            return self.sampler.greedy_pending(logits)
        in_flight = previous.rows if previous is not None and previous.tokens is not None else {}
        return self.sampler.pending(logits, [self._sampling_row(seq, in_flight.get(seq.seq_id, -1)) for seq in seqs],
                                    previous.tokens.token_ids if in_flight else None)

    def _sampling_row(self, seq: Sequence, in_flight_row: int = -1) -> SamplingRow:
        request = seq.request
        return SamplingRow(request.params, request.prompt_token_array, seq.output_token_ids, seq.generator,
                           request.bad_words_token_ids, in_flight_row)

    def _prompt_logprobs(self, scheduled: list[ScheduledSequence], result,
                         pending: list[PromptLogprobs] = ()) -> list[PromptLogprobs]:
        """The prompt logprobs of this step's prompt positions whose requests ask for them, computed on the device.
        pending: those of the step in flight, not yet in their records; counted as recorded, should a sequence
        recompute positions they cover (a preemption drains the step in flight first, so none does now)."""
        computed = []
        for i, item in enumerate(scheduled):
            seq, request = item.seq, item.seq.request
            record = request.prompt_logprobs
            if record is None or seq.index != 0:
                continue
            recorded = len(record) + sum(len(p.targets) for p in pending if p.record is record)
            start = seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            first = max(start, recorded - 1)  # a preempted sequence recomputes positions already recorded
            if end <= first:
                continue
            offset = result.starts[i] + first - start
            logprobs = compute_logprobs(self.model.compute_logits(result.hidden[offset:offset + end - first]))
            computed.append(PromptLogprobs(record, logprobs, seq.token_ids[first + 1:end + 1],
                                           request.params.prompt_logprobs))
        return computed

    def _append_token(self, seq: Sequence, token) -> bool:
        """Record a sampled token; True when the sequence goes on and its detokenization is deferred."""
        params = seq.request.params
        seq.token_ids.append(token.token_id)
        seq.cumulative_logprob += token.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self.token_texts.fill(token.top_logprobs))
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        stop_token = num_output >= params.min_tokens and (
            (token.token_id in self.eos_token_ids and not params.ignore_eos)
            or token.token_id in params.stop_token_ids
        )
        at_length = num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len
        if not stop_token and not at_length:
            return True
        if stop_token:
            if params.include_stop_str_in_output:
                seq.detokenizer.append(token.token_id)
            stop_reason = token.token_id if token.token_id in params.stop_token_ids else None
            self._finish(seq, "stop", stop_reason)
        else:
            matched = seq.detokenizer.append(token.token_id)
            self._finish(seq, "stop" if matched is not None else "length", matched)
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _output(self, request: Request) -> RequestOutput:
        finished = request.finished
        if finished and self.requests.pop(request.request_id, None) is not None:
            self._release_unloaded_adapter(request)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=[_completion(seq) for seq in request.sequences], finished=finished,
            prompt_logprobs=request.prompt_logprobs.copy() if request.prompt_logprobs is not None else None,
            lora_name=request.lora_request.lora_name if request.lora_request else None,
        )

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (a single-process engine has nothing to stop)."""
        if self.config.tensor_parallel_size > 1:
            self.model.close()

    def stats(self) -> EngineStats:
        manager = self.lora_manager
        used, total = manager.slot_usage() if manager else (0, 0)
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.allocator.num_used, kv_blocks_total=self.allocator.num_blocks,
            lora_slots_used=used, lora_slots_total=total, num_preemptions=self.scheduler.num_preemptions,
            lora_slot_loads=manager.slot_loads if manager else 0, lora_disk_reads=manager.disk_reads if manager else 0,
        )


def _logprob_record(params: SamplingParams, positions: list[PositionLogprobs | None] = ()) -> LogprobRecord:
    return FlatLogprobs(positions) if params.flat_logprobs else list(positions)


def _completion(seq: Sequence) -> CompletionOutput:
    """A snapshot of one sequence: its token and logprob lists are copies."""
    if seq.status is SequenceStatus.FINISHED and not isinstance(seq.stop_reason, str):
        text = seq.detokenizer.flush()
    else:
        text = seq.detokenizer.output_text
    return CompletionOutput(
        index=seq.index, text=text, token_ids=seq.output_token_ids, cumulative_logprob=seq.cumulative_logprob,
        logprobs=seq.logprobs.copy() if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
    )


def _decodes_first(scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
    """The step's sequences with one new token first (they share one batched decode attention), in order."""
    return sorted(scheduled, key=lambda item: item.num_new_tokens != 1)


def _all_plain_greedy(seqs: list[Sequence]) -> bool:
    """True when every sequence's token is its raw argmax with only its raw logprob reported (`is_plain_greedy`;
    a placeholder for a token in flight counts as an output token)."""
    return all(is_plain_greedy(seq.request.params, len(seq.token_ids) - seq.num_prompt_tokens) for seq in seqs)


def _device_tokens(scheduled: list[ScheduledSequence], previous: InFlightStep | None) -> DeviceTokens | None:
    """Where the step's sequences sampled by `previous` find their input id among its tokens on the device."""
    if previous is None or previous.tokens is None:
        return None
    return DeviceTokens(previous.tokens.token_ids, [previous.rows.get(item.seq.seq_id, -1) for item in scheduled])


def _take_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows] for increasing rows, without waiting for the forward to finish (as indexing a GPU
    tensor by a list does): a view when they are the leading rows (every decode step), else an index
    sent from page-locked memory."""
    if rows[-1] == len(rows) - 1:
        return hidden[:len(rows)]
    return hidden[host_to_device(rows, hidden.device)]


def _token_ids(prompt: list[int]) -> list[int]:
    try:
        return [operator.index(token) for token in prompt]
    except TypeError:
        raise ValueError("A prompt of token ids must hold integers only") from None


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return replace(params, max_tokens=max_tokens)
