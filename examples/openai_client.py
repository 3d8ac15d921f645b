"""The OpenAI SDK against `loraserve serve`: the same question to the base model and two adapters, streamed.

    make serve                       # in another terminal: the default model with the pirate and sql adapters
    .venv/bin/python examples/openai_client.py

The `model` field picks the adapter; anything listed by `client.models.list()` works.
"""
from __future__ import annotations

import argparse
import os

from openai import OpenAI

QUESTIONS = {
    "pirate": "What is the capital of France?",
    "sql": "List the names of all users older than 30.",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("LORASERVE_API_KEY", "not-needed"))

    models = [model.id for model in client.models.list()]
    base = models[0]
    print("served models:", ", ".join(models))

    for adapter, question in QUESTIONS.items():
        for model in (base, adapter):
            print(f"\n--- {model} --- {question}")
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=args.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    print(chunk.choices[0].delta.content, end="", flush=True)
                if chunk.usage:
                    print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} generated tokens]")


if __name__ == "__main__":
    main()
