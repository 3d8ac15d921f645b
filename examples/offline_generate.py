"""Offline batch generation in vLLM's style, mixing the base model and two adapters in one batch.

    python examples/offline_generate.py
"""
from pathlib import Path

from engine import LLM, LoRARequest, SamplingParams

ADAPTERS = Path(__file__).parent / "demo_adapters"


def main() -> None:
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8)  # the embedded SmolLM2-135M-Instruct
    pirate = LoRARequest("pirate", 1, str(ADAPTERS / "pirate"))
    sql = LoRARequest("sql", 2, str(ADAPTERS / "sql"))
    questions = [
        "What is the capital of France?",
        "What is the capital of France?",
        "List the names of all employees older than 40.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=48)
    outputs = llm.chat(conversations, params, lora_request=[None, pirate, sql])
    for question, adapter, output in zip(questions, ["base", "pirate", "sql"], outputs):
        print(f"[{adapter}] {question}\n  -> {output.outputs[0].text!r}\n")


if __name__ == "__main__":
    main()
