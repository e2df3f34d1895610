"""`fsdp_graph.predict`, the documented path of `fsdp_graph/compile/predict.py`: a step's graphs
captured on a fake process group at any world size, with parameters this process never holds."""

from .compile.predict import StepPrediction, capture_graphs, fake_world, predict_step

__all__ = ["StepPrediction", "capture_graphs", "fake_world", "predict_step"]
