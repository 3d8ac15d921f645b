"""Stand-ins for captured CUDA graphs that note which graph each step replays."""
from __future__ import annotations


class RecordingGraph:
    """Wraps a captured graph; each replay appends its key to `replayed`, then replays it."""

    def __init__(self, graph, key, replayed: list):
        self.graph, self.key, self.replayed = graph, key, replayed

    def replay(self):
        self.replayed.append(self.key)
        self.graph.replay()


def record_replays(llm) -> list:
    """Wrap every decode graph of `llm`'s engine: the list then receives the key of each graph replayed."""
    replayed: list = []
    graphs = llm.engine.runner.graphs.graphs
    for key, graph in list(graphs.items()):
        graphs[key] = RecordingGraph(graph, key, replayed)
    return replayed
