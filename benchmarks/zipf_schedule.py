"""Workload (d)'s schedule on the CPU, without a model: how many steps, at what batch, and an estimated GPU time.

    python benchmarks/zipf_schedule.py                                      # the default admission order
    python benchmarks/zipf_schedule.py --admission-order fcfs balanced     # orders side by side

It drives the real `Scheduler` and the real `LoRAManager` through (d)'s request mix (512 requests of
512 prompt + 128 output tokens, greedy, ignore_eos, all queued at t=0; 1000 adapters, Zipf(1.1) picks as in
`benchmarks/serving.py`; max_loras=32, max_cpu_loras=128, max_num_seqs=128, max_num_batched_tokens=8192)
and makes the scheduler and manager calls `LLMEngine.step` makes, async scheduling included: every step left in
flight, the next one scheduled over it (`schedule_decode`, or sequences ending by length retired and `schedule`).

What is not real: the manager's model is one 1×1 LoRA linear (slots and host rows hold nothing that
matters), and its disk reads are futures that finish `--read-steps` steps after they were submitted
(1: ready for the next step's admission). An adapter read takes about 80 ms on the H200 host, one
prefill step 210 ms and ten decode steps; the default, 10, gives the step counts of the H200's runs (before
reads ahead could take the rows of copies slots had loaded: fcfs 946 and 951 steps against 950 here, balanced
831 and 861 against 831). The KV cache has the blocks the engine gives (d) on the H200 (128 sequences × 704 tokens), so
nothing is preempted. GPU time is a cost model of the H200 steps: 5.3 ms + 0.037 ms per decode row +
0.026 ms per prompt token (a fit of BENCHMARKS.md's decode steps at batch 16–128 with 64 adapters, and
~210 ms per 8192-token prefill step); a drain or idle step costs nothing.

The counts are the serving benchmark's timeline counts: a step is decode-only when every running
sequence had its prompt computed before it and the number waiting did not change; the mean batch is the
number running after each step, over all steps.

Results (seed 0, read delay 10): fcfs 928 steps, 872 decode-only, mean running 70.6, 14.08 s estimated
(the H200 measured 909 and 910 steps); balanced 794 steps, 729, 82.6, 13.37 s (-5.0%; the H200: 776 and 777 since
admissions run over the step in flight, 797-800 before; its adapter reads take wall time, not steps, and its
first steps wait for them). No order can do much better: an adapter holds its slot for at least 129 steps (its
prefill and 128 decodes), and 173 adapters in 32 slots put 6 of them in one slot, so at least 774 steps; the
decode rows cost the same in any order, and the prompt tokens' 6.8 s too, so the rest is 5.3 ms per step.
Unless adapters yield their slots mid-way, as balanced admission's suspension does by default
(EngineConfig.suspend_margin, 32 steps; the figures above are with `--suspend-margin off`): 733 steps (52
suspensions), 13.05 s; the engine itself on the CPU (`serving.py --shape small --device cpu`,
async scheduling forced) 716 steps and 54 suspensions, as here with reads of one step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters_registry import ModelInfo
from benchmarks.serving import suspend_margin_arg, zipf_choice
from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator
from engine.lora_manager import LoRAManager
from engine.lora_request import LoRARequest
from engine.model import LoRALinear
from engine.sampling_params import SamplingParams
from engine.scheduler import ADMISSION_ORDERS, ScheduledSequence, Scheduler
from engine.sequence import IN_FLIGHT_TOKEN, Request, Sequence, SequenceStatus

DECODE_BASE_MS, DECODE_ROW_MS, PREFILL_TOKEN_MS = 5.3, 0.037, 0.026
MAX_MODEL_LEN = 512 + 128 + 64  # serving.py's max_model_len for (d)
BLOCK_SIZE = 16
ADAPTER_RANK = 1  # the manager's slots are rank 1 (`_OneLinear`)


@dataclass
class Workload:
    num_requests: int = 512
    prompt_len: int = 512
    output_len: int = 128
    num_adapters: int = 1000
    zipf_a: float = 1.1
    seed: int = 0
    max_loras: int = 32
    max_cpu_loras: int = 128
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    suspend_margin: int | None = EngineConfig.suspend_margin


@dataclass
class Result:
    admission_order: str
    steps: int
    decode_only_steps: int
    admitting_steps: int
    idle_steps: int
    forward_steps: int
    mean_running: float
    mean_decode_batch: float  # over the decode-only steps that ran a forward
    estimated_gpu_s: float
    estimated_decode_only_s: float  # of which in decode-only steps
    schedule_ms_per_step: float  # host time in schedule() and schedule_decode(), on this machine
    slot_loads: int
    suspensions: int
    disk_reads: int
    distinct_adapters: int


class _OneLinear(torch.nn.Module):
    """All the manager asks of a model: its LoRA linears (one, 1×1: the slots' contents do not matter here)."""

    def __init__(self):
        super().__init__()
        self.o_proj = LoRALinear(1, [1], bias=False, names=["o_proj"], consumer="add_rms_norm")

    def lora_layers(self) -> dict[str, LoRALinear]:
        return {"model.layers.0.self_attn.o_proj": self.o_proj}


class StepReadManager(LoRAManager):
    """The real manager, its disk reads replaced by futures that finish `read_steps` steps after submission."""

    def __init__(self, workload: Workload, read_steps: int):
        info = ModelInfo(architecture="LlamaForCausalLM", model_type="llama", name_or_path=None,
                         module_shapes={"model.layers.0.self_attn.o_proj": (1, 1)}, max_lora_rank=1)
        super().__init__(_OneLinear(), info, max_loras=workload.max_loras, max_lora_rank=1,
                         max_cpu_loras=workload.max_cpu_loras, device=torch.device("cpu"), dtype=torch.float32,
                         read_in_process=False)
        self.read_steps = read_steps
        self.step = 0
        self._due: list[tuple[int, Future]] = []

    def _submit_read(self, lora_request: LoRARequest, row: int) -> Future:
        future: Future = Future()
        self._due.append((self.step + self.read_steps, future))
        return future

    def _read(self, lora_request: LoRARequest, row: int, last_copy) -> int:
        """A synchronous read (a host copy evicted before its slot load): instant; the adapter's rank."""
        return ADAPTER_RANK

    def advance(self) -> None:
        """One step later: finish the reads now due."""
        self.step += 1
        for due, future in list(self._due):
            if due <= self.step:
                future.set_result(ADAPTER_RANK)  # a read's result: the adapter's rank
                self._due.remove((due, future))


@dataclass
class _InFlight:
    seqs: list[Sequence]


class Simulation:
    """`LLMEngine.step` without the model: the same scheduler calls, tokens appended as 0s."""

    def __init__(self, workload: Workload, admission_order: str, read_steps: int, async_scheduling: bool):
        self.workload = workload
        self.manager = StepReadManager(workload, read_steps)
        num_blocks = workload.max_num_seqs * -(-MAX_MODEL_LEN // BLOCK_SIZE)
        self.scheduler = Scheduler(BlockAllocator(num_blocks), BLOCK_SIZE, workload.max_num_seqs,
                                   workload.max_num_batched_tokens, adapter_slots=self.manager,
                                   admission_order=admission_order, suspend_margin=workload.suspend_margin)
        self.async_scheduling = async_scheduling
        self.in_flight: _InFlight | None = None
        self.params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
        picks = zipf_choice(workload.num_requests, workload.num_adapters, workload.seed, workload.zipf_a)
        self.distinct_adapters = len(set(picks))
        for i, pick in enumerate(picks):
            lora = LoRARequest(f"adapter-{pick}", pick + 1, f"/adapters/{pick}")
            self.manager.known[lora.lora_int_id] = lora  # what ensure_loaded leaves (its check reads the disk)
            request = Request(str(i), None, [0] * workload.prompt_len, self.params, lora)
            seq = Sequence(i, request, 0, [0] * workload.prompt_len, None, None)
            request.sequences.append(seq)
            self.scheduler.add(seq)

    # ---- one engine step: returns (GPU ms, whether a forward ran) ---------------------------------
    def step(self) -> tuple[float, bool]:
        self.manager.advance()
        if self.in_flight is not None:
            return self._step_after_in_flight()
        plan = self.scheduler.schedule()
        if plan.failed:
            raise RuntimeError(f"adapter reads cannot fail here: {plan.failed}")
        if plan.empty:
            return 0.0, False
        self._run(plan.scheduled, None)
        return self._cost(plan.scheduled), True

    def _cost(self, scheduled: list[ScheduledSequence]) -> float:
        decodes = sum(item.num_new_tokens == 1 and item.samples for item in scheduled)
        prompt_tokens = sum(item.num_new_tokens for item in scheduled) - decodes
        return DECODE_BASE_MS + DECODE_ROW_MS * decodes + PREFILL_TOKEN_MS * prompt_tokens

    def _step_after_in_flight(self) -> tuple[float, bool]:
        """`LLMEngine._step_after_in_flight`: a decode of the same sequences, or (every sequence here ends by its
        length alone) those whose last token is in flight retired and a fresh schedule over the step in flight."""
        scheduler = self.scheduler
        plan = None
        if not scheduler.waiting or self._batch_stays_full():
            plan = scheduler.schedule_decode()
        if plan is None and scheduler.running_fit():
            for seq in [seq for seq in scheduler.running if self._ends_at_length(seq)]:
                scheduler.retire(seq)
            plan = scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        if plan is None or plan.empty:  # the tokens read back, no forward
            self._read_back(previous)
            return 0.0, False
        self._run(plan.scheduled, previous)
        return self._cost(plan.scheduled), True

    def _batch_stays_full(self) -> bool:
        return not any(map(self._ends_at_length, self.scheduler.running))

    def _ends_at_length(self, seq: Sequence) -> bool:
        return len(seq.token_ids) - seq.num_prompt_tokens >= self.workload.output_len

    def _run(self, scheduled: list[ScheduledSequence], previous: _InFlight | None) -> None:
        """Launch a step, then read `previous` back; the step stays in flight when it covers every running
        sequence (`LLMEngine._may_leave_in_flight`: every one here is plain greedy and ends by its length), else
        its tokens are appended at once."""
        sampling = [item.seq for item in scheduled if item.samples]
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        stays = self.async_scheduling and len(scheduled) == len(self.scheduler.running)
        if stays:
            self.in_flight = _InFlight(sampling)
        if previous is not None:
            self._read_back(previous)
        for seq in sampling:
            if not stays:
                self._append_token(seq)
            elif seq.status is not SequenceStatus.FINISHED:
                seq.token_ids.append(IN_FLIGHT_TOKEN)

    def _read_back(self, step: _InFlight) -> None:
        for seq in step.seqs:
            seq.drop_in_flight_token()
            if seq.status is not SequenceStatus.FINISHED:
                self._append_token(seq)

    def _append_token(self, seq: Sequence) -> None:
        seq.token_ids.append(0)
        if len(seq.token_ids) - seq.num_prompt_tokens >= self.workload.output_len:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)

    def unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting) or self.in_flight is not None

    # ---- the serving benchmark's counts ---------------------------------------------------------
    def run(self) -> Result:
        scheduler = self.scheduler
        steps = decode_only = idle = forwards = 0
        running_after, decode_batches, gpu_ms, decode_ms = [], [], 0.0, 0.0
        schedule_s = _time_schedule_calls(scheduler)
        while self.unfinished():
            prefilled = all(s.num_computed_tokens >= s.num_prompt_tokens for s in scheduler.running)
            waiting_before = len(scheduler.waiting)
            ms, forward = self.step()
            steps += 1
            gpu_ms += ms
            forwards += forward
            running_after.append(len(scheduler.running))
            idle += len(scheduler.running) == 0
            if prefilled and len(scheduler.waiting) == waiting_before:
                decode_only += 1
                decode_ms += ms
                if forward:
                    decode_batches.append(round((ms - DECODE_BASE_MS) / DECODE_ROW_MS))
            if steps > 100_000:
                raise RuntimeError("the simulation does not finish")
        return Result(admission_order=scheduler.admission_order, steps=steps, decode_only_steps=decode_only,
                      admitting_steps=steps - decode_only, idle_steps=idle, forward_steps=forwards,
                      mean_running=statistics.mean(running_after), mean_decode_batch=statistics.mean(decode_batches),
                      estimated_gpu_s=gpu_ms / 1e3, estimated_decode_only_s=decode_ms / 1e3,
                      schedule_ms_per_step=1e3 * schedule_s[0] / steps, slot_loads=self.manager.slot_loads,
                      suspensions=scheduler.num_suspensions,
                      disk_reads=self.manager.disk_reads, distinct_adapters=self.distinct_adapters)


def _time_schedule_calls(scheduler: Scheduler) -> list[float]:
    """Wrap the scheduler's two entry points; the returned one-element list accumulates their seconds."""
    spent = [0.0]

    def timed(function):
        def run():
            t = time.perf_counter()
            try:
                return function()
            finally:
                spent[0] += time.perf_counter() - t
        return run

    scheduler.schedule = timed(scheduler.schedule)
    scheduler.schedule_decode = timed(scheduler.schedule_decode)
    return spent


def simulate(admission_order: str = "fcfs", read_steps: int = 10, async_scheduling: bool = True,
             workload: Workload | None = None) -> Result:
    return Simulation(workload or Workload(), admission_order, read_steps, async_scheduling).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admission-order", nargs="*", choices=ADMISSION_ORDERS, default=[ADMISSION_ORDERS[0]])
    parser.add_argument("--read-steps", type=int, nargs="*", default=[10],
                        help="steps an adapter read takes (1: ready for the next step)")
    parser.add_argument("--sync", action="store_true", help="synchronous steps (no async scheduling)")
    parser.add_argument("--seed", type=int, default=0, help="the Zipf picks' seed (serving.py's is 0)")
    parser.add_argument("--suspend-margin", type=suspend_margin_arg, default=EngineConfig.suspend_margin,
                        help="balanced admission's suspension margin in steps, or 'off'")
    args = parser.parse_args()
    print("H200 (d), eighteenth session: fcfs 909 and 910 steps, balanced 797 and 800")
    for read_steps in args.read_steps:
        for order in args.admission_order:
            t = time.perf_counter()
            result = simulate(order, read_steps, not args.sync, Workload(seed=args.seed,
                                                                         suspend_margin=args.suspend_margin))
            fields = ", ".join(f"{key}={round(value, 3) if isinstance(value, float) else value}"
                               for key, value in asdict(result).items())
            print(f"read_steps={read_steps} {fields} ({time.perf_counter() - t:.1f}s)")


if __name__ == "__main__":
    main()
