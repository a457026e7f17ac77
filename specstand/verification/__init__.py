"""Verification of a draft by one target pass: greedy and lossless rejection sampling."""

from specstand.verification.sampling import SamplingParams, target_probs
from specstand.verification.verify import Verdict, verify, verify_greedy, verify_sampled

__all__ = ["SamplingParams", "Verdict", "target_probs", "verify", "verify_greedy", "verify_sampled"]
