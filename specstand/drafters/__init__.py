"""Drafters, one file per method, all behind `Drafter` (base.py).

Training-free: ngram.py, suffix.py, and schema.py (the text a request's tools and response format force,
else suffix drafts; it writes with the target's tokenizer, json_reader.py follows the answer's text and
json_parts.py holds what the reader reads from the request and the prompt).
Trained (their weights come from `specstand train`): eagle3.py and mtp.py (both token-by-token, core in
chain.py), dflash.py (one pass per block) and its variants dspark.py (Markov + confidence heads) and
dflash2.py (convolutions + candidate selector); trained.py loads them.
"""

from __future__ import annotations

from pathlib import Path

from specstand.drafters.base import Draft, Drafter, DraftingContext, HiddenRows, MethodSpec, SequenceView
from specstand.drafters.ngram import NgramConfig
from specstand.drafters.registry import REGISTRY, method_names, register
from specstand.drafters.schema import HFTextCodec, SchemaConfig, TextCodec
from specstand.drafters.suffix import SuffixConfig
from specstand.drafters.trained import DrafterLoadError, load_drafter, read_spec, shipped_drafter
from specstand.runner.transformer import DecoderModel


def make_drafter(method: str, target: DecoderModel | None = None, target_name: str = "",
                 drafter_path: Path | None = None, ngram: NgramConfig | None = None,
                 tokenizer: object | None = None) -> Drafter | None:
    """The drafter of `method` (None for "none"). Trained methods load `drafter_path`, or the drafter shipped
    for the preset `target_name`, around the target's embedding and head; `ngram` sets the n-gram drafter's
    sizes; `tokenizer` (the target's transformers tokenizer) is what schema drafting writes with."""
    if method == "none":
        return None
    spec = REGISTRY.get(method)
    if spec is None:
        raise ValueError(f"unknown method {method!r} (choose from {', '.join(method_names())})")
    if "tokenizer" in spec.needs and tokenizer is None:
        raise ValueError(f"method {method} needs the target's tokenizer")
    if spec.make is not None:
        return spec.make(DraftingContext(tokenizer, ngram))
    path = trained_drafter_path(method, target_name, drafter_path)
    if target is None:
        raise ValueError("a trained drafter needs its target model")
    found = read_spec(path)
    if found.method != method:
        raise DrafterLoadError(f"drafter {path} is a {found.method} drafter, not {method}")
    return load_drafter(path, target.weights.embed_tokens, target.weights.lm_head, target.kernel_path)


def trained_drafter_path(method: str, target_name: str, drafter_path: Path | None) -> Path:
    """The folder a trained `method` loads: `drafter_path`, else the drafter shipped for the preset
    `target_name`; DrafterLoadError where there is neither (the CLI asks before it loads the model)."""
    path = drafter_path or shipped_drafter(target_name, method)
    if path is None:
        raise DrafterLoadError(f"method {method} needs a trained drafter: no drafter is shipped for "
                               f"{target_name or 'this model'}; train one (`specstand train`) and pass --drafter")
    return path


def default_k(drafter: Drafter | None, k: int | None) -> int:
    """K when the user gives none: the drafter's own default (a block drafter's drafts per block, else 5)."""
    if k is not None:
        return k
    return drafter.default_k if drafter is not None else 5


__all__ = ["REGISTRY", "Draft", "Drafter", "DrafterLoadError", "DraftingContext", "HFTextCodec", "HiddenRows",
           "MethodSpec", "NgramConfig", "SchemaConfig", "SequenceView", "SuffixConfig", "TextCodec", "default_k",
           "make_drafter", "method_names", "register", "trained_drafter_path"]
