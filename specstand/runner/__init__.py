"""The target model runner: weights, forward pass, KV cache with O(1) rollback."""

from specstand.runner.kv_cache import KVCache
from specstand.runner.runner import PassInput, PassOutput, TargetRunner
from specstand.runner.target import TargetModel

__all__ = ["KVCache", "PassInput", "PassOutput", "TargetModel", "TargetRunner"]
