"""Which sampling parameter costs the decode step its time in (a), and where the host's time goes (one-off)."""
import argparse, cProfile, io, json, pstats, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving as S

shape = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
device = "cuda" if shape == "llama3-8b" else "cpu"
n, out_len = (256, 128) if device == "cuda" else (16, 8)
args = argparse.Namespace(adapter_reader="auto", admission_order="balanced", suspend_margin=S.EngineConfig.suspend_margin,
                          cudagraph_mode="full_and_piecewise", device=device, prompt_len=512 if device == "cuda" else 64,
                          output_len=out_len, max_num_seqs=128, max_batched_tokens=8192, freeze_heap=False)
model_dir = S.make_model_dir(Path("/tmp/loraserve-bench"), shape)
engine = S.build_engine(model_dir, args)
vocab = S.SHAPES[shape]["vocab_size"]
batch = S.prompts(n, args.prompt_len, vocab)
S.warm_up(engine, batch, [None], args)
base = dict(temperature=0.8, top_p=0.95)
variants = dict(top_p=base, rep=dict(base, repetition_penalty=1.1), freq=dict(base, frequency_penalty=0.3),
                pres=dict(base, presence_penalty=0.3), logprobs=dict(base, logprobs=1),
                full=dict(S.PENALTIES_AND_LOGPROBS))
res = {}
for name, sampling in variants.items():
    r = S.offline(engine, batch, [None] * n, out_len, **sampling)
    res[name] = {k: r[k] for k in ("tok_per_s", "median_decode_step_ms", "gc_seconds", "gc_oldest_seconds")}
    print(name, res[name], flush=True)
for name in ("full",):
    prof = cProfile.Profile()
    prof.enable()
    S.offline(engine, batch[:128], [None] * 128, out_len, **variants[name])
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(name, s.getvalue()[:7000])
