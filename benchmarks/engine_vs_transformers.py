"""CPU throughput: loraserve's engine against `transformers.generate` on the embedded default.

    python benchmarks/engine_vs_transformers.py [--prompts 16] [--max-tokens 64]

Both decode greedily the same chat prompts for exactly --max-tokens tokens (EOS ignored), in one
batch, in float32, after one warm-up run each.
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

from engine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "What is 17 times 23?", "Name three primary colours.", "How do vaccines work?",
    "Give me a tip for learning Python.", "What is the tallest mountain?", "Translate 'good morning' to Spanish.",
    "Why is the sky blue?", "What does a CPU do?", "Describe a cat in one sentence.",
    "What is the boiling point of water?", "Suggest a name for a pet fish.", "What is gravity?",
    "How many continents are there?",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    llm = LLM(device="cpu", dtype="float32", max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"]
               for q in (QUESTIONS * 4)[:args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    ours = time.perf_counter() - start

    model_dir = llm.engine.config.model
    from engine.model_loader import resolve_model_dir

    directory, _ = resolve_model_dir(model_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    generate = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        ref.generate(**{k: v[:2] for k, v in batch.items()}, **generate)
        start = time.perf_counter()
        ref.generate(**batch, **generate)
    theirs = time.perf_counter() - start

    tokens = args.prompts * args.max_tokens
    print("| engine | tokens | seconds | tok/s |\n|---|---|---|---|")
    print(f"| loraserve | {tokens} | {ours:.2f} | {tokens / ours:.1f} |")
    print(f"| transformers.generate | {tokens} | {theirs:.2f} | {tokens / theirs:.1f} |")
    print(f"\nloraserve / transformers throughput: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
