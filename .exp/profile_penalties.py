"""Where the penalties + logprobs sampler's time goes on the GPU (one-off profile)."""
import array, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sampling_row import SamplingRow
from engine.logits_processors import process_logits, _token_cells
from engine.logprobs import requested_logprobs, chosen_logprobs

V = 128256
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
def t(fn, reps=10):
    fn(); (torch.cuda.synchronize() if dev.type == "cuda" else None)
    ts = []
    for _ in range(reps):
        (torch.cuda.synchronize() if dev.type == "cuda" else None); s = time.perf_counter(); fn(); (torch.cuda.synchronize() if dev.type == "cuda" else None)
        ts.append(1e3 * (time.perf_counter() - s))
    return round(statistics.median(ts), 3)

for rows in (32, 128):
    logits = torch.randn(rows, V, device=dev).to(torch.bfloat16)
    raw = logits.float()
    ids = torch.randint(V, (rows, 576), generator=torch.Generator().manual_seed(1)).tolist()
    def mk(**kw):
        p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, **kw)
        return [SamplingRow(p, array.array('q', i[:512]), i[512:]) for i in ids]
    full = mk(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3, logprobs=1)
    rep = mk(repetition_penalty=1.1)
    freq = mk(frequency_penalty=0.3, presence_penalty=0.3)
    lp = mk(logprobs=1)
    plain = mk()
    s = Sampler(eos_token_ids=set(), vocab_size=V)
    tok = raw.argmax(-1)
    res = dict(rows=rows,
        pending_full=t(lambda: s.pending(logits, full).result()),
        call_plain=t(lambda: s(logits, plain)),
        call_full=t(lambda: s(logits, full)),
        call_rep=t(lambda: s(logits, rep)),
        call_freq=t(lambda: s(logits, freq)),
        call_logprobs=t(lambda: s(logits, lp)),
        process_full=t(lambda: process_logits(raw, full, set())),
        process_rep=t(lambda: process_logits(raw, rep, set())),
        process_freq=t(lambda: process_logits(raw, freq, set())),
        cells_out=t(lambda: _token_cells([(r.output_token_ids,) for r in full], full, torch.arange(rows, device=dev), V, None)),
        cells_seen=t(lambda: _token_cells([(r.prompt_token_ids, r.output_token_ids) for r in full], full, torch.arange(rows, device=dev), V, None)),
        requested=t(lambda: requested_logprobs(raw, tok, full)),
        chosen=t(lambda: chosen_logprobs(raw, tok)),
    )
    print(res, flush=True)

rows = 128
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        s(logits, full)
    (torch.cuda.synchronize() if dev.type == "cuda" else None)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))
