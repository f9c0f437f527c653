"""OffloadController lives in prefetch/offload/controller.py, with its parts
beside it; this name stays for the code that imports it from here."""
from prefetch.offload.controller import OffloadController, check_predictor

__all__ = ["OffloadController", "check_predictor"]
