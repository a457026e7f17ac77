"""Engine and scheduler: request -> drafter proposes -> target verifies -> accept/rollback -> stats."""

from specstand.engine.engine import Engine, EngineConfig, ExactnessError
from specstand.engine.request import GenerationResult, Request, StepEvent
from specstand.engine.stats import DecodeStats, EngineTimes

__all__ = ["DecodeStats", "Engine", "EngineConfig", "EngineTimes", "ExactnessError", "GenerationResult", "Request",
           "StepEvent"]
