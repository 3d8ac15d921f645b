"""A stand-in for a captured CUDA graph that notes which graph each step replays."""
from __future__ import annotations


class RecordingGraph:
    """Wraps a captured graph; each replay appends its key to `replayed`, then replays it."""

    def __init__(self, graph, key, replayed: list):
        self.graph, self.key, self.replayed = graph, key, replayed

    def replay(self):
        self.replayed.append(self.key)
        self.graph.replay()
