"""TGI-style serving: adapters from LORA_ADAPTERS, requests to /generate and /generate_stream with adapter_id.

    LORA_ADAPTERS=pirate=examples/demo_adapters/pirate,sql=examples/demo_adapters/sql \\
        .venv/bin/loraserve serve --port 8000 --max-loras 2
    .venv/bin/python examples/tgi_generate.py

(`make serve` reads config.yaml, which serves the same two adapters.) No `adapter_id` means the base model.
"""
from __future__ import annotations

import argparse
import json
import os

import httpx

PROMPT = "<|im_start|>user\nWhere is the treasure?<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--adapter", default="pirate")
    args = parser.parse_args()
    key = os.environ.get("LORASERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    with httpx.Client(base_url=args.url, headers=headers, timeout=120) as client:
        for adapter_id in (None, args.adapter):
            parameters = {"max_new_tokens": 40, **({"adapter_id": adapter_id} if adapter_id else {})}
            response = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
            response.raise_for_status()
            print(f"--- /generate adapter_id={adapter_id}\n{response.json()['generated_text']}\n")

        print(f"--- /generate_stream adapter_id={args.adapter}")
        body = {"inputs": PROMPT, "parameters": {"adapter_id": args.adapter, "max_new_tokens": 40}}
        with client.stream("POST", "/generate_stream", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[len("data:"):])
                    print(event["token"]["text"], end="", flush=True)
                    if event["details"]:
                        print(f"\n[{event['details']['generated_tokens']} tokens, {event['details']['finish_reason']}]")


if __name__ == "__main__":
    main()
