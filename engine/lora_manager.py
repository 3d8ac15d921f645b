"""Adapter residency: `max_loras` device slots, an LRU host cache, and per-adapter pins.

A slot holds one adapter's A and B for every projection, zero-padded to `max_lora_rank`, as one row
of a device buffer (`SlotLayout`); the model's `LoRALinear`s read views of it by slot index. A slot
is pinned while a running sequence uses it; only unpinned slots are evicted (least recently used
first). Host copies use the same layout, in a pool of `max_cpu_loras` rows allocated (and page-locked
on CUDA) once, so serving never allocates pinned memory and a slot load is one asynchronous copy.
A request's adapter is only checked when the request arrives (config and weight-file header); its
weights are read into a host row on a background thread (or in child processes: `ProcessReader`) when
the scheduler first wants it, a few adapters ahead at most, and again later if its host copy was evicted.
"""
from __future__ import annotations

import itertools
import logging
import shutil
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from adapters_registry import LoadedAdapter, ModelInfo, check_adapter, load_adapter

from .adapter_reader import ProcessReader
from .lora_layout import SlotLayout, SlotRanks
from .lora_request import LoRARequest
from .model import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class LoRAResidency:
    slot: int | None  # device slot, or None when not resident
    in_cpu: bool  # a host copy is cached
    running: int  # running sequences using it
    unloaded: bool = False  # unloaded: listed only while requests still use it


class LoRAManager:
    READER_THREADS = 4  # reader threads, or processes with read_in_process
    MAX_READS_IN_FLIGHT = 8

    def __init__(self, model: LlamaForCausalLM, model_info: ModelInfo, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype, allow_pickle: bool = False,
                 adapter_transform: Callable[[LoadedAdapter], LoadedAdapter] | None = None,
                 on_slot_load: Callable[[LoRARequest, int], None] | None = None,
                 read_in_process: bool | None = False):
        """adapter_transform: applied to every adapter before it is cached (tensor parallelism: this rank's
        shard). on_slot_load: told of every slot load before it happens (tensor parallelism: the workers).
        read_in_process: background reads in child processes (`ProcessReader`) instead of threads; None:
        in processes if the shared memory they fill the host pool through has room for it, else threads."""
        if read_in_process and adapter_transform is not None:
            raise ValueError("adapters transformed per rank (tensor parallelism) are read on threads, not in a process")
        if adapter_transform is not None:
            read_in_process = False  # "if there is room" (None) too: the children would not apply the transform
        self.model_info = model_info
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.allow_pickle = allow_pickle
        self.adapter_transform = adapter_transform
        self.on_slot_load = on_slot_load
        self.num_slots = max_loras
        layers = model.lora_layers()
        self.layout = SlotLayout(layers, max_lora_rank)
        self._slots = torch.zeros(max_loras, self.layout.numel, dtype=dtype, device=device)
        self.layout.bind(self._slots, layers)
        # each slot's adapter rank: the kernels skip the zero padding past it
        self.slot_ranks = SlotRanks.zeros(max_loras, max_lora_rank, device)
        self.reads_in_process = read_in_process = _reads_in_process(
            read_in_process, max_cpu_loras * self.layout.numel * dtype.itemsize, max_cpu_loras)
        self._pool = _host_pool(self, max_cpu_loras, self.layout.numel, dtype, pinned=device.type == "cuda",
                                shared=read_in_process)
        self._free_rows = list(range(max_cpu_loras))
        self._row_ranks = [0] * max_cpu_loras  # the rank of the adapter each host row holds
        self.known: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, int] = OrderedDict()  # adapter id -> its row of the host pool, LRU first
        # host copies no slot has loaded since they were cached: reading ahead never evicts one of them
        self._unused: set[int] = set()
        self.slot_owner: list[int | None] = [None] * max_loras
        self.pins: Counter[int] = Counter()
        self._takeable: int | None = None  # takeable_slots(), until a slot's owner or pins change
        self.removed: set[int] = set()
        self._clock = itertools.count()
        self._slot_used_at = [0] * max_loras
        # host-to-device slot loads run on a side stream; the next forward waits on their events, and a
        # reader waits on a row's last copy before overwriting the row
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending_loads: list[torch.cuda.Event] = []
        self._row_copies: dict[int, torch.cuda.Event] = {}
        self._reader = self._process_reader = None
        if read_in_process:
            self._process_reader = ProcessReader(self._pool, self.layout, model_info, allow_pickle,
                                                 processes=self.READER_THREADS)
            weakref.finalize(self, self._process_reader.close)
        else:
            self._reader = ThreadPoolExecutor(max_workers=self.READER_THREADS, thread_name_prefix="lora-reader")
        # adapter id -> (read, the host row it fills, the adapter it reads)
        self._reads: dict[int, tuple[Future, int, LoRARequest | None]] = {}  # None: released, dropped on landing
        self.disk_reads = 0  # adapters read from disk, ever (a high rate: max_cpu_loras is too small)
        self.slot_loads = 0  # adapters copied into a device slot, ever (a high rate: max_loras is too small)
        self._failed_reads: dict[int, BaseException] = {}

    # ---- registration ---------------------------------------------------------------------
    def add(self, lora_request: LoRARequest, adapter: LoadedAdapter | None = None) -> None:
        """Make an adapter known (and cache its already-loaded weights, if given). An unloaded id may be added
        again once no request uses it (`LLMEngine.add_lora` checks)."""
        self._check_identity(lora_request)
        int_id = lora_request.lora_int_id
        if int_id in self.removed:
            self._free(int_id)  # a copy that lingers (a read that landed after the unload) is the old adapter's
            self.removed.discard(int_id)
        self.known[int_id] = lora_request
        if adapter is not None:
            row = self._reserve_row()
            self._wait_for_row(row)
            self._row_ranks[row] = self.layout.write(self._transform(adapter), self._pool[row])
            self._cache(lora_request.lora_int_id, row)
        else:
            self._host_row(lora_request)

    def ensure_loaded(self, lora_requests: Iterable[LoRARequest]) -> None:
        """Check adapters before requests for them are queued, so bad ones fail here (the first bad one in order
        raises). Only the config and the weight file's header are read: the weights follow when the scheduler
        wants them. With reader processes, several adapters are checked at once in them (an offline batch naming
        many adapters: workload (d)'s 173 took 0.27-0.44 s of the H200 host's time one by one)."""
        unknown: dict[int, LoRARequest] = {}  # to check, in order, up to the first adapter refused without a check
        refusal: ValueError | None = None
        for lora_request in lora_requests:
            if lora_request.lora_int_id in self.removed:
                refusal = ValueError(f"LoRA adapter {lora_request.lora_name!r} has been unloaded")
                break
            if self.known.get(lora_request.lora_int_id) != lora_request and \
                    unknown.get(lora_request.lora_int_id) != lora_request:
                try:
                    self._check_identity(lora_request, unknown)
                except ValueError as exc:
                    refusal = exc
                    break
                unknown[lora_request.lora_int_id] = lora_request
        checks = self._checks_in_processes(list(unknown.values())) if len(unknown) > 1 else {}
        for int_id, lora_request in unknown.items():
            check = checks.get(int_id)
            if check is None or check.exception() is not None:  # checked here again: the reader itself may have failed
                check_adapter(lora_request.lora_path, self.model_info, allow_pickle=self.allow_pickle)
            self._drop_host_copy(int_id)
            self.known[int_id] = lora_request
        if refusal is not None:
            raise refusal

    def _checks_in_processes(self, lora_requests: list[LoRARequest]) -> dict[int, Future]:
        """The adapters' checks started in the reader processes, by adapter id; none without them."""
        if self._process_reader is None:
            return {}
        return {lora.lora_int_id: self._process_reader.check(lora.lora_path) for lora in lora_requests}

    def remove(self, lora_int_id: int) -> None:
        """Unload: new requests fail now; the slot and host copy go once no running request uses it."""
        if lora_int_id not in self.known:
            return
        del self.known[lora_int_id]
        self.removed.add(lora_int_id)
        if self.pins[lora_int_id] == 0:
            self._free(lora_int_id)

    def release(self, lora_int_id: int) -> None:
        """An unloaded adapter no request needs any more: free its slot and host copy, and drop its read if one
        is still in flight."""
        self._free(lora_int_id)
        if lora_int_id in self._reads:
            future, row, _ = self._reads[lora_int_id]
            self._reads[lora_int_id] = (future, row, None)

    def _check_identity(self, lora_request: LoRARequest, also: dict[int, LoRARequest] | None = None) -> None:
        """An adapter id names one adapter: among those known, and `also` (a batch being checked)."""
        other = self.known.get(lora_request.lora_int_id) or (also or {}).get(lora_request.lora_int_id)
        if other is not None and (other.lora_name, other.lora_path) != (lora_request.lora_name,
                                                                        lora_request.lora_path):
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} already names adapter "
                             f"{other.lora_name!r} ({other.lora_path})")

    # ---- the scheduler's view (AdapterSlots) ----------------------------------------------
    def is_ready(self, lora_request: LoRARequest, pinnable: bool) -> bool:
        """True when the adapter can go into a slot without reading the disk. Otherwise its weights
        are read on a background thread, and the scheduler serves other requests meanwhile: ahead of
        time while the host cache has room, else only when a slot is free for it (`pinnable`). A read
        that failed is reported by `take_read_error`, not retried until that is called."""
        int_id = lora_request.lora_int_id
        if int_id in self.slot_owner or int_id in self.host:
            return True
        if int_id not in self._reads and int_id not in self._failed_reads and self._may_read(pinnable):
            self.disk_reads += 1
            row = self._reserve_row()
            self._reads[int_id] = (self._submit_read(lora_request, row), row, lora_request)
        return False

    def _submit_read(self, lora_request: LoRARequest, row: int) -> Future:
        if self._process_reader is None:  # the thread waits for the row itself, after the disk read
            return self._reader.submit(self._read, lora_request, row, self._row_copies.pop(row, None))
        self._wait_for_row(row)  # rows are reused least recently used first: long finished, in practice
        return self._process_reader.submit(lora_request.lora_path, row)

    def _wait_for_row(self, row: int) -> None:
        """Block until the slot load that last read host row `row` has finished, so it may be overwritten."""
        last_copy = self._row_copies.pop(row, None)
        if last_copy is not None:
            last_copy.synchronize()

    def take_read_error(self, lora_request: LoRARequest) -> BaseException | None:
        """Why the adapter's weights could not be read (the requests waiting for it fail with it);
        once taken, the next request for it reads them again."""
        return self._failed_reads.pop(lora_request.lora_int_id, None)

    def _may_read(self, pinnable: bool) -> bool:
        """Reads ahead take the host cache's free room, or the row of a copy a slot has loaded since it was
        cached (the slot holds its own), so an adapter read early is not evicted by the next one before it
        gets its slot; past that, reads in flight stay within the slots they could fill."""
        if len(self._reads) >= min(self.MAX_READS_IN_FLIGHT, self.max_cpu_loras):
            return False
        if len(self.host) + len(self._reads) < self.max_cpu_loras or len(self.host) > len(self._unused):
            return True
        return pinnable and len(self._reads) < self.takeable_slots()

    def wait_for_reader(self) -> None:
        """Block until reads can start at once: reader processes, started with the manager, have imported
        what they need. Raises if they cannot start."""
        if self._process_reader is not None:
            self._process_reader.wait_until_ready()

    def wait_for_reads(self, timeout: float | None) -> None:
        """Block until a background read finishes (or the timeout): for a step that has nothing to
        run but adapters on their way, rather than spinning against the reader threads."""
        if self._reads:
            wait([future for future, _, _ in self._reads.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def collect_reads(self) -> None:
        """Cache the reads that have finished (their adapters become ready), or record why they failed.
        The scheduler calls this once per pass, before asking about any adapter, so a read finishing
        mid-pass cannot be evicted by a later read-ahead in the same pass before its own turn came."""
        for int_id, (future, row, lora_request) in list(self._reads.items()):
            if future.done():
                del self._reads[int_id]
                if lora_request is None or self.known.get(int_id, lora_request) != lora_request:
                    self._free_rows.append(row)  # released, or the id was given to another adapter
                elif future.exception() is None:
                    self._row_ranks[row] = future.result()
                    self._cache(int_id, row)
                else:
                    self._free_rows.append(row)
                    self._failed_reads[int_id] = future.exception()

    def can_pin(self, lora_request: LoRARequest) -> bool:
        return self.is_resident(lora_request) or self.takeable_slots() > 0

    def takeable_slots(self) -> int:
        """Slots a new adapter could go into now: empty, or holding one no running sequence uses. Counted
        once after a slot's owner or pins change: an admission pass asks once per waiting sequence."""
        if self._takeable is None:
            self._takeable = sum(owner is None or self.pins[owner] == 0 for owner in self.slot_owner)
        return self._takeable

    def is_resident(self, lora_request: LoRARequest) -> bool:
        """True when the adapter holds a slot: more sequences for it need no other."""
        return lora_request.lora_int_id in self.slot_owner

    def drain_candidate(self) -> int | None:
        """The resident adapter with the fewest running sequences: its slot frees soonest if it gets
        no new ones."""
        owners = [owner for owner in self.slot_owner if owner is not None]
        return min(owners, key=lambda owner: self.pins[owner]) if owners else None

    def pin(self, lora_request: LoRARequest) -> None:
        int_id = lora_request.lora_int_id
        if int_id not in self.slot_owner:
            self._load_into_slot(lora_request, self._pick_slot())
        self.pins[int_id] += 1
        self._takeable = None
        self._slot_used_at[self.slot_owner.index(int_id)] = next(self._clock)

    def unpin(self, lora_request: LoRARequest) -> None:
        int_id = lora_request.lora_int_id
        self.pins[int_id] -= 1
        self._takeable = None
        if self.pins[int_id] == 0:
            del self.pins[int_id]
            if int_id in self.removed:
                self._free(int_id)

    def slot_for(self, lora_request: LoRARequest | None) -> int:
        if lora_request is None:
            return -1
        return self.slot_owner.index(lora_request.lora_int_id)

    # ---- reporting ------------------------------------------------------------------------
    def status(self, in_use: Iterable[int] = ()) -> dict[int, LoRAResidency]:
        """Known adapters, and unloaded ones while requests still use them (running ones, which pin them, and
        those of `in_use`: queued and preempted requests pin nothing): they must not vanish from what counts
        requests per adapter before their last one ends."""
        unloaded = {i for i in self.pins if i in self.removed} | (set(in_use) & self.removed)
        return {i: LoRAResidency(slot=self.slot_owner.index(i) if i in self.slot_owner else None,
                                 in_cpu=i in self.host, running=self.pins[i], unloaded=i in unloaded)
                for i in sorted(set(self.known) | unloaded)}

    def slot_usage(self) -> tuple[int, int]:
        return sum(owner is not None for owner in self.slot_owner), self.num_slots

    # ---- internals ------------------------------------------------------------------------
    def _pick_slot(self) -> int:
        free = [s for s, owner in enumerate(self.slot_owner) if owner is None]
        if free:
            return free[0]
        idle = [s for s, owner in enumerate(self.slot_owner) if self.pins[owner] == 0]
        return min(idle, key=lambda s: self._slot_used_at[s])

    def _reserve_row(self) -> int:
        """A host row to read an adapter into: a free one, else the row of the least recently used copy a slot
        has loaded (the slot keeps its own), else of the least recently used copy, else the first row a read in
        flight fills."""
        while not self._free_rows:
            if self.host:
                self._drop_host_copy(next((i for i in self.host if i not in self._unused), next(iter(self.host))))
            else:
                self.wait_for_reads(timeout=None)
                self.collect_reads()
        return self._free_rows.pop()

    def _host_row(self, lora_request: LoRARequest) -> int:
        """The adapter's host row, read from disk on this thread if it has none."""
        int_id = lora_request.lora_int_id
        row = self.host.get(int_id)
        if row is not None:
            self.host.move_to_end(int_id)
            return row
        self.disk_reads += 1
        row = self._reserve_row()
        try:
            self._row_ranks[row] = self._read(lora_request, row, self._row_copies.pop(row, None))
        except BaseException:
            self._free_rows.append(row)
            raise
        self._cache(int_id, row)
        return row

    def _read(self, lora_request: LoRARequest, row: int, last_copy: torch.cuda.Event | None) -> int:
        """Disk to host row: validate, load, shard (tensor parallelism) and lay out one adapter; its rank. The
        row is overwritten only once the slot load that last read it has finished."""
        adapter = self._transform(load_adapter(lora_request.lora_path, self.model_info,
                                               allow_pickle=self.allow_pickle, dtype=self.dtype))
        if last_copy is not None:
            last_copy.synchronize()
        return self.layout.write(adapter, self._pool[row])

    def _cache(self, int_id: int, row: int) -> None:
        self._drop_host_copy(int_id)
        self.host[int_id] = row
        self._unused.add(int_id)

    def _drop_host_copy(self, int_id: int) -> None:
        self._unused.discard(int_id)
        row = self.host.pop(int_id, None)
        if row is not None:
            self._free_rows.append(row)

    def wait_for_loads(self) -> None:
        """Make the compute stream wait (on the device, not the host) for slot loads in flight."""
        current = torch.cuda.current_stream(self.device) if self._pending_loads else None
        for event in self._pending_loads:
            current.wait_event(event)
        self._pending_loads.clear()

    def load_slot(self, lora_request: LoRARequest, slot: int) -> None:
        """Load an adapter into a slot chosen elsewhere: a tensor-parallel worker follows the engine's manager."""
        if self.known.get(lora_request.lora_int_id) != lora_request:
            self._drop_host_copy(lora_request.lora_int_id)
            self.known[lora_request.lora_int_id] = lora_request
        self._load_into_slot(lora_request, slot)

    def _transform(self, adapter: LoadedAdapter) -> LoadedAdapter:
        return adapter if self.adapter_transform is None else self.adapter_transform(adapter)

    def _load_into_slot(self, lora_request: LoRARequest, slot: int) -> None:
        self.slot_loads += 1
        if self.on_slot_load is not None:
            self.on_slot_load(lora_request, slot)
        row = self._host_row(lora_request)
        self._unused.discard(lora_request.lora_int_id)
        rank = self._row_ranks[row]
        if self._copy_stream is None:
            self._slots[slot].copy_(self._pool[row])
            self.slot_ranks.on_device[slot] = rank
        else:
            # the slot may still be read by work queued on the compute stream for its last owner
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._slots[slot].copy_(self._pool[row], non_blocking=True)
                # a kernel, with no host buffer that a later write could race
                self.slot_ranks.on_device[slot:slot + 1].fill_(rank)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._pending_loads.append(event)
            self._row_copies[row] = event
        self.slot_owner[slot] = lora_request.lora_int_id
        self.slot_ranks.on_host[slot] = rank
        self._takeable = None

    def _free(self, int_id: int) -> None:
        if int_id in self.slot_owner:
            self.slot_owner[self.slot_owner.index(int_id)] = None
            self._takeable = None
        self._drop_host_copy(int_id)


SHARED_MEMORY = "/dev/shm"  # where torch's shared CPU tensors live on Linux


def shared_memory_free() -> int:
    """Bytes free for shared CPU tensors (0 where there is no /dev/shm)."""
    try:
        return shutil.disk_usage(SHARED_MEMORY).free
    except OSError:
        return 0


def _reads_in_process(wanted: bool | None, pool_bytes: int, max_cpu_loras: int) -> bool:
    """Reader processes fill the host pool through shared memory, which must have room for it (and a tenth
    more, for whatever else shares it): without, None (the engine's "auto") settles for threads and says
    so, True is refused with what to change."""
    free = shared_memory_free()
    fits = pool_bytes <= 0.9 * free
    if wanted is None:
        if not fits:
            logger.warning("adapters are read on threads: the %.1f GiB host pool does not fit in the shared "
                           "memory (%s) reader processes would fill it through", pool_bytes / 2**30, SHARED_MEMORY)
        return fits
    if wanted and not fits:
        raise RuntimeError(f"the adapter host pool ({pool_bytes / 2**30:.1f} GiB for max_cpu_loras={max_cpu_loras}) "
                           f"does not fit in the free shared memory ({SHARED_MEMORY}: {free / 2**30:.1f} GiB, of "
                           f"which 90% may be used) that reader processes need; lower max_cpu_loras, give the "
                           f"container more (docker --shm-size), or read on threads")
    return wanted


def _host_pool(owner: object, rows: int, numel: int, dtype: torch.dtype, *, pinned: bool,
               shared: bool) -> torch.Tensor:
    """rows × numel host memory, in shared memory when `shared` (a reader process fills it), page-locked in
    place when `pinned` (cudaHostRegister, for as long as `owner` lives): the caching pinned allocator
    would round it up to a power of two."""
    pool = torch.empty(rows, numel, dtype=dtype)
    if shared:
        pool.share_memory_()
    if pinned:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(pool.data_ptr(), pool.nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"could not page-lock {pool.nbytes / 2**30:.1f} GiB for {rows} host adapter copies "
                               f"(cudaHostRegister error {int(error)}); lower max_cpu_loras")
        weakref.finalize(owner, cudart.cudaHostUnregister, pool.data_ptr())
    return pool
