"""HTTP edge of loraserve: OpenAI, vLLM and TGI routes over the engine, and the `loraserve` CLI."""
from .app import build_app
from .state import ServerSettings

__all__ = ["ServerSettings", "build_app"]
