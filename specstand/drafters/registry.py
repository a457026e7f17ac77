"""Every drafting method, once: each module declares its MethodSpec (base.py) and is listed here.

Adding a method is one file (a Drafter and its METHOD) and one line below; the CLI's help and checks,
vLLM's --speculative-config names, the stand, training and export read what they need from here.
"""

from __future__ import annotations

from specstand.drafters import dflash, dflash2, dspark, eagle3, mtp, ngram, schema, suffix
from specstand.drafters.base import MethodSpec

REGISTRY: dict[str, MethodSpec] = {spec.name: spec for spec in (
    ngram.METHOD,
    suffix.METHOD,
    schema.METHOD,
    eagle3.METHOD,
    mtp.METHOD,
    dflash.METHOD,
    dspark.METHOD,
    dflash2.METHOD,
)}


def register(spec: MethodSpec) -> None:
    """Add a method from outside the package (a plugin, a test's toy drafter)."""
    if spec.name in REGISTRY or spec.name == "none":
        raise ValueError(f"method {spec.name!r} is registered already")
    if (spec.make is None) == (spec.trained is None):
        raise ValueError(f"method {spec.name!r} needs either a factory or trained parts")
    REGISTRY[spec.name] = spec


def method_names() -> tuple[str, ...]:
    """Every method name, "none" (plain decoding) first."""
    return ("none", *REGISTRY)


def trained_methods() -> tuple[str, ...]:
    return tuple(name for name, spec in REGISTRY.items() if spec.trained is not None)


def training_free_methods() -> tuple[str, ...]:
    """Methods that draft without a drafter folder, "none" first (what can speed up answering training data)."""
    return ("none", *(name for name, spec in REGISTRY.items() if spec.trained is None))


def is_block_method(name: str) -> bool:
    return name in REGISTRY and REGISTRY[name].block


def vllm_methods() -> dict[str, str]:
    """vLLM's --speculative-config method names -> ours."""
    return {vllm: name for name, spec in REGISTRY.items() for vllm in spec.vllm_names}


def method_help() -> str:
    return "; ".join(f"{name}: {spec.summary}" for name, spec in REGISTRY.items())
