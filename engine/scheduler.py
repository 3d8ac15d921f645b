"""Continuous batching under three budgets: sequences, tokens per step, KV blocks — plus adapter slots.

Running sequences go first (decode one token, or the next chunk of a long prompt); when KV blocks
run out the newest running sequence is preempted (its blocks freed, to be recomputed later). Then
waiting sequences are admitted in arrival order; one whose adapter cannot get a slot is skipped
so others can run. Once it has been skipped `max_skips` times, one resident adapter (the one with
the fewest running sequences) gets no new sequences until the starving one takes its slot: that
slot drains while the other adapters keep their traffic, and no request starves.

`admission_order="balanced"` considers the waiting sequences adapter by adapter instead, picking the
adapters that fill the slots and the batch together. On the H200's workload (d) it ran 797-800 steps instead
of 909-910, at 4724-4847 tok/s against 4393-4628 (BENCHMARKS.md, eighteenth session); with two other seeds'
Zipf picks, 784 and 795 steps where it had run 909 and 914 before its reads ahead followed its order
(nineteenth session). The offline `LLM` admits so by default; the engine and the server keep arrival order,
which online clients see as fairness. Given a `suspend_margin`, balanced admission also suspends: with every slot
busy, an adapter whose sequences are near their end yields its slot to a waiting adapter with far more work left,
and its sequences keep their KV blocks to resume later (`_suspension`; `EngineConfig.suspend_margin`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .kv_cache import BlockAllocator
from .lora_request import LoRARequest
from .sequence import Sequence, SequenceStatus

ADMISSION_ORDERS = ("fcfs", "balanced")


def _steps_left(seq: Sequence) -> int:
    """Steps the sequence still needs at most: its tokens to generate, plus one if its prompt is not computed."""
    generated = len(seq.token_ids) - seq.num_prompt_tokens
    return seq.request.params.max_tokens - generated + (seq.num_computed_tokens < seq.num_prompt_tokens)


def check_admission_order(order: str) -> None:
    if order not in ADMISSION_ORDERS:
        raise ValueError(f"admission_order must be one of {', '.join(ADMISSION_ORDERS)}; got {order!r}")


class AdapterSlots(Protocol):
    num_slots: int

    def collect_reads(self) -> None: ...
    def is_ready(self, lora_request: LoRARequest, pinnable: bool) -> bool: ...
    def take_read_error(self, lora_request: LoRARequest) -> BaseException | None: ...
    def can_pin(self, lora_request: LoRARequest) -> bool: ...
    def is_resident(self, lora_request: LoRARequest) -> bool: ...
    def takeable_slots(self) -> int: ...
    def drain_candidate(self) -> int | None: ...
    def pin(self, lora_request: LoRARequest) -> None: ...
    def unpin(self, lora_request: LoRARequest) -> None: ...


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


@dataclass
class Suspension:
    victims: list[Sequence]  # the running sequences of the adapter that yields its slot
    taker: int  # the waiting adapter (int id) the slot goes to


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)  # their adapter could not be read

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, adapter_slots: AdapterSlots | None = None, max_skips: int = 8,
                 admission_order: str = "fcfs", suspend_margin: int | None = None):
        """admission_order: the order waiting sequences are considered in (starving ones always first):
        "fcfs", arrival; "balanced", each adapter's sequences together, adapters picked to fill the slots
        and the batch at once (`_balanced_ranks`). suspend_margin (balanced only): see `_suspension`."""
        check_admission_order(admission_order)
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.adapter_slots = adapter_slots
        self.max_skips = max_skips
        self.admission_order = admission_order
        self.suspend_margin = suspend_margin if admission_order == "balanced" else None
        self.num_suspensions = 0
        self.waiting: deque[Sequence] = deque()
        self.draining: int | None = None  # adapter int id getting no new sequences, for a starving one
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Free everything a sequence holds (finished or aborted), wherever it is."""
        if seq.status is SequenceStatus.ENDING:
            pass  # retired: it holds nothing
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.allocator.free(seq.block_table)  # a suspended sequence's
        seq.status = SequenceStatus.FINISHED

    def retire(self, seq: Sequence) -> None:
        """A running sequence whose last token a step in flight samples (it reaches its length) frees its
        KV blocks and adapter pin now, so the next step, scheduled before that token is read, may admit into
        its room as a synchronous engine would. The next step runs after the one in flight on the device, so
        it may reuse the blocks and the slot. It is finished when its token is read back."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.ENDING

    def running_fit(self) -> bool:
        """True when every running sequence's uncomputed tokens fit in free KV blocks: schedule() then
        preempts none."""
        return sum(self._blocks_needed(seq, seq.num_uncomputed_tokens) for seq in self.running) \
            <= self.allocator.num_free

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        if self.adapter_slots is not None and seq.request.lora_request is not None:
            self.adapter_slots.unpin(seq.request.lora_request)

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _grow(self, seq: Sequence, num_blocks: int) -> None:
        for _ in range(num_blocks):
            seq.block_table.append(self.allocator.allocate())

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        output.preempted.append(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        suspension = self._suspension()
        if suspension is not None:
            self._suspend(suspension.victims)
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self._blocks_needed(seq, num_new)
            if needed:  # most decode steps need no new block
                if not self._make_room(seq, needed, scheduled_ids, output):
                    continue
                self._grow(seq, needed)
            output.scheduled.append(ScheduledSequence(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        if not output.preempted:
            self._admit(output, budget, first=suspension.taker if suspension is not None else None)
        return output

    def schedule_decode(self) -> SchedulerOutput | None:
        """Every running sequence one token on, when that is exactly what schedule() would do: none can
        be admitted (nothing waits, the batch is full, or `admission_blocked`), every running sequence is
        decoding, the token budget holds them all and the blocks they grow into are free (no preemption).
        None, with nothing changed, otherwise.

        Async scheduling calls it to launch a step before the previous one's tokens are read back.
        """
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens or \
                (self.waiting and len(running) < self.max_num_seqs and not self.admission_blocked()):
            return None
        growing = []  # a decode token needs at most one new block
        for seq in running:
            if seq.num_uncomputed_tokens != 1:
                return None
            if self._blocks_needed(seq, 1):
                growing.append(seq)
        if len(growing) > self.allocator.num_free:
            return None
        for seq in growing:
            self._grow(seq, 1)
        output = SchedulerOutput(scheduled=[ScheduledSequence(seq, 1) for seq in running])
        # admits none here: counts the waiting sequences' skips, reads adapters ahead and fails those whose
        # read failed, as schedule()'s pass would
        self._admit(output, self.max_num_batched_tokens - len(running))
        return output

    def admission_blocked(self) -> bool:
        """True when no waiting sequence could be admitted now, whatever the batch's room: each needs an
        adapter that holds no slot, and no slot can be taken (every one holds an adapter running sequences
        use). Workload (d)'s many adapters on few slots spend most decode steps like this."""
        slots = self.adapter_slots
        if slots is None or slots.takeable_slots():
            return False
        return all(seq.request.lora_request is not None and not slots.is_resident(seq.request.lora_request)
                   for seq in self.waiting) and self._suspension() is None

    # ---- suspension: an adapter yields its slot to one with longer work left --------------------
    def _suspension(self) -> Suspension | None:
        """The running sequences to suspend so that a waiting adapter takes their slot, if any.

        With every slot busy, the waiting adapter with the most work left (steps its longest sequence needs)
        takes the slot of the running adapter with the least, when that is `suspend_margin` steps less and
        has no more sequences. The suspended sequences keep their KV blocks and wait like any other, to
        resume where they stopped. An adapter holds its slot for as long as its longest sequence runs, so
        without this, many adapters on few slots end in a last wave that holds only a few of them
        (workload (d): 173 adapters on 32 slots need 6 waves of 129 steps, the last with 13 adapters);
        `benchmarks/zipf_schedule.py` takes 733 steps instead of 794 with it, and the H200 718 instead of 776.
        A suspension that is due unblocks admission (`admission_blocked`), so the next step schedules afresh, over
        the step in flight unless a preemption is due."""
        slots = self.adapter_slots
        if self.suspend_margin is None or slots is None or not self.waiting or slots.takeable_slots():
            return None
        work: dict[int, int] = {}
        count: dict[int, int] = {}
        lora_of: dict[int, LoRARequest] = {}
        for seq in self.waiting:
            lora = seq.request.lora_request
            if lora is None or slots.is_resident(lora):
                return None  # admitted without a slot of their own: let them in first
            int_id = lora.lora_int_id
            work[int_id] = max(work.get(int_id, 0), _steps_left(seq))
            count[int_id] = count.get(int_id, 0) + 1
            lora_of[int_id] = lora
        pick = max(work, key=lambda int_id: (work[int_id], count[int_id]))
        running: dict[int, list[Sequence]] = {}
        for seq in self.running:
            if seq.request.lora_request is not None:
                running.setdefault(seq.lora_int_id, []).append(seq)
        # only decoding sequences yield: one computing its prompt, or computing again what a preemption dropped,
        # would lose that work if its KV went while it waits
        victims = [seqs for seqs in running.values() if len(seqs) <= count[pick]
                   and all(seq.num_uncomputed_tokens <= 1 for seq in seqs)]
        if not victims:
            return None
        victim = min(victims, key=lambda seqs: max(map(_steps_left, seqs)))
        if work[pick] - max(map(_steps_left, victim)) < self.suspend_margin:
            return None
        # the KV cache holds max_num_seqs whole sequences: the suspended ones count; and the taker's tokens must fit
        # in free blocks, or admitting it would drop the KV the suspended ones keep
        holding = len(self.running) + sum(1 for seq in self.waiting if seq.block_table)
        taker_blocks = sum(self._blocks_needed(seq, seq.num_uncomputed_tokens) for seq in self.waiting
                           if seq.lora_int_id == pick)
        if holding + count[pick] > self.max_num_seqs or taker_blocks > self.allocator.num_free \
                or not slots.is_ready(lora_of[pick], False):
            return None
        return Suspension(victim, pick)

    def _suspend(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.running.remove(seq)
            self.adapter_slots.unpin(seq.request.lora_request)
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)
        self.num_suspensions += 1

    def _drop_suspended_kv(self, needed: int, keep: Sequence | None = None) -> bool:
        """Frees suspended sequences' KV blocks (but `keep`'s), the latest suspended first, until `needed` blocks
        are free: they compute it again when they resume. True when `needed` blocks are free."""
        for suspended in reversed(self.waiting):
            if needed <= self.allocator.num_free:
                return True
            if suspended.block_table and suspended is not keep:
                self.allocator.free(suspended.block_table)
                suspended.num_computed_tokens = 0
                self.num_preemptions += 1
        return needed <= self.allocator.num_free

    def _free_suspended_kv_for(self, seq: Sequence, needed: int) -> bool:
        """Admitting `seq` needs `needed` blocks: suspended sequences' KV goes for it when that makes enough room
        (else nothing frees it while nothing runs, and the engine stalls). True when `needed` blocks are free."""
        held = sum(len(other.block_table) for other in self.waiting if other is not seq)
        return self.allocator.num_free + held >= needed and self._drop_suspended_kv(needed, keep=seq)

    def _make_room(self, seq: Sequence, needed: int, scheduled_ids: set[int], output: SchedulerOutput) -> bool:
        """Drops suspended sequences' KV, then preempts the newest running sequences not yet scheduled,
        until `needed` blocks are free; False when that took `seq` itself."""
        if self._drop_suspended_kv(needed):
            return True
        while needed > self.allocator.num_free:
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None)
            self._preempt(victim, output)
            if victim is seq:
                return False
        return True

    def _admit(self, output: SchedulerOutput, budget: int, first: int | None = None) -> None:
        """first: the adapter whose sequences go first (a suspension's taker, so the slot goes to it)."""
        slots = self.adapter_slots
        if slots is not None:
            slots.collect_reads()  # once per pass: a read landing mid-pass could be evicted before its turn
        if self.draining is not None and not any(seq.skipped_steps > self.max_skips for seq in self.waiting):
            self.draining = None  # the starving sequence left (aborted, failed) before its adapter got the slot
        if budget == 0 or len(self.running) >= self.max_num_seqs:
            return  # before ordering the waiting sequences for nothing
        if self._admit_waiting(output, budget, first) and self.draining is None:
            # after the pass: an adapter that took a slot in it first admits all its sequences waiting
            self.draining = slots.drain_candidate()

    def _admit_waiting(self, output: SchedulerOutput, budget: int, first: int | None) -> bool:
        """Admits what fits, in admission order; True when a starving sequence found no slot."""
        slots = self.adapter_slots
        starving = False
        read_errors: dict[int, BaseException] = {}
        for seq in self._in_admission_order(first):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                return starving
            lora = seq.request.lora_request if slots is not None else None
            if lora is not None:
                pinnable = slots.can_pin(lora)
                ready = slots.is_ready(lora, pinnable)
                error = None if ready else read_errors.get(lora.lora_int_id) or slots.take_read_error(lora)
                if error is not None:
                    read_errors[lora.lora_int_id] = error
                    self.finish(seq)
                    output.failed.append((seq, error))
                    continue
                if not pinnable:
                    seq.skipped_steps += 1
                    starving |= seq.skipped_steps > self.max_skips
                    continue
                if not ready or lora.lora_int_id == self.draining:
                    continue  # not ready: its weights are being read from disk; others go first meanwhile
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self._blocks_needed(seq, num_new)
            if needed > self.allocator.num_free and not self._free_suspended_kv_for(seq, needed):
                return starving
            if lora is not None:
                slots.pin(lora)
                if seq.skipped_steps > self.max_skips:
                    self.draining = None
            self._grow(seq, needed)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            seq.skipped_steps = 0
            self.running.append(seq)
            output.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return starving

    def _in_admission_order(self, first: int | None) -> list[Sequence]:
        """The waiting sequences in the order `_admit` considers them: the `first` adapter's, then starving
        ones, then as `admission_order` says."""
        waiting = list(self.waiting)
        if self.admission_order == "fcfs" or self.adapter_slots is None:
            return waiting
        rank = self._balanced_ranks(waiting)
        return sorted(waiting, key=lambda seq: (seq.lora_int_id != first, seq.skipped_steps <= self.max_skips,
                                                rank[seq.lora_int_id]))

    def _balanced_ranks(self, waiting: list[Sequence]) -> dict[int, int]:
        """Adapter int id (0: base) -> its turn. First the base model and the adapters holding a slot (their
        sequences need no other), by first arrival. Then, one free slot at a time, the adapter with the
        most waiting sequences that leaves every other free slot its share of the batch (max_num_seqs /
        slots), else the one with the fewest; ties by first arrival. Each adapter's sequences then run
        together, so it holds its slot for one sequence's lifetime, and the batch stays as full as the
        slots allow. The adapters left over follow, most waiting sequences first, as the next free slots will
        pick them, so their reads ahead (made in this order) start first. Workload (d) in
        `benchmarks/zipf_schedule.py`: 794 steps instead of fcfs's 930 (807 with the leftovers by first arrival)."""
        slots = self.adapter_slots
        first_at: dict[int, int] = {}
        count: dict[int, int] = {}
        lora_of: dict[int, LoRARequest | None] = {}
        for position, seq in enumerate(waiting):
            int_id = seq.lora_int_id
            first_at.setdefault(int_id, position)
            count[int_id] = count.get(int_id, 0) + 1
            lora_of[int_id] = seq.request.lora_request
        room = self.max_num_seqs - len(self.running)
        order, others = [], []
        for int_id in first_at:  # dicts keep insertion order: first arrival
            lora = lora_of[int_id]
            if lora is None or slots.is_resident(lora):
                order.append(int_id)
                room -= count[int_id]
            else:
                others.append(int_id)
        share = self.max_num_seqs / slots.num_slots
        free = slots.takeable_slots()
        while others and free > 0:
            limit = room - (free - 1) * share
            fitting = [int_id for int_id in others if count[int_id] <= limit]
            if fitting:
                pick = max(fitting, key=lambda int_id: (count[int_id], -first_at[int_id]))
            else:
                pick = min(others, key=lambda int_id: (count[int_id], first_at[int_id]))
            others.remove(pick)
            order.append(pick)
            room -= count[pick]
            free -= 1
        others.sort(key=lambda int_id: (-count[int_id], first_at[int_id]))
        return {int_id: turn for turn, int_id in enumerate(order + others)}
