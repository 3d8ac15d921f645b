#!/usr/bin/env bash
# Load an adapter into a running server over REST, use it, and unload it (vLLM's endpoints).
#
#   make serve        # in another terminal; config.yaml turns on runtime updating for examples/demo_adapters
#   examples/hot_load_adapter.sh
#
# The path must lie under --lora-allowed-dirs (config.yaml: examples/demo_adapters).
set -euo pipefail

URL=${URL:-http://127.0.0.1:8000}
ADAPTER_PATH=${ADAPTER_PATH:-$(cd "$(dirname "$0")" && pwd)/demo_adapters/pirate}
AUTH=()
if [[ -n "${LORASERVE_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer $LORASERVE_API_KEY"); fi

echo "== load 'pirate-live' from $ADAPTER_PATH"
curl -sS "${AUTH[@]}" "$URL/v1/load_lora_adapter" -H 'Content-Type: application/json' \
  -d "{\"lora_name\": \"pirate-live\", \"lora_path\": \"$ADAPTER_PATH\"}"
echo

echo "== /v1/lora_adapters (rank, target modules, residency, running requests, load time)"
curl -sS "${AUTH[@]}" "$URL/v1/lora_adapters"
echo

echo "== chat with it"
curl -sS "${AUTH[@]}" "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "pirate-live", "messages": [{"role": "user", "content": "Where is the treasure?"}], "max_tokens": 48}'
echo

echo "== unload it: its slot and host copy are freed, and the name is gone"
curl -sS "${AUTH[@]}" "$URL/v1/unload_lora_adapter" -H 'Content-Type: application/json' -d '{"lora_name": "pirate-live"}'
echo
curl -sS -o /dev/null -w "a request for it now answers HTTP %{http_code}\n" "${AUTH[@]}" "$URL/v1/completions" \
  -H 'Content-Type: application/json' -d '{"model": "pirate-live", "prompt": "Ahoy"}'
