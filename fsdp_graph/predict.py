"""`fsdp_graph.predict`, the documented path of `fsdp_graph/compile/predict.py`: a step's graphs
captured on a fake process group at any world size, with parameters this process never holds."""

from .compile.predict import capture_graphs, fake_world

__all__ = ["capture_graphs", "fake_world"]
