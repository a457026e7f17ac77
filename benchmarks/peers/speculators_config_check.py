"""Check exported drafters with the `speculators` package: its config classes parse config.json, and its
model classes load model.safetensors (reporting tensor names it expects but the file lacks, or the
reverse; the verifier's own embedding, norm and head are expected to come from the verifier).

speculators 0.9.0 pins transformers <= 5.19 and pulls torchvision/torchaudio, so it is not installed in
specstand's environment. This script reads its wheel and its pure-Python dependencies from folders:

    pip download speculators==0.9.0 --no-deps -d /tmp/spec && unzip /tmp/spec/*.whl -d /tmp/spec/x
    pip install --target /tmp/specdeps loguru pydantic-settings datasets && pip download hs-connectors==0.9.0 \
        --no-deps -d /tmp/hs && unzip /tmp/hs/*.whl -d /tmp/specdeps
    python benchmarks/peers/speculators_config_check.py /tmp/spec/x /tmp/specdeps EXPORTED_FOLDER...

Those folders go at the END of sys.path, so specstand's own torch/transformers stay in use.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    wheel, deps, *folders = sys.argv[1:]
    sys.path += [wheel, deps]
    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    failures = 0
    for folder in folders:
        declared = json.loads((Path(folder) / "config.json").read_text())["speculators_model_type"]
        try:
            config = SpeculatorModelConfig.from_pretrained(folder)
        except Exception as error:  # report every folder, whatever fails
            print(f"{folder}: FAILED {type(error).__name__}: {str(error).splitlines()[0]}")
            failures += 1
            continue
        print(f"{folder}: {type(config).__name__} (speculators_model_type {config.speculators_model_type}, "
              f"declared {declared}), draft_vocab_size {config.draft_vocab_size}, "
              f"verifier {config.speculators_config.verifier.name_or_path}")
        try:
            theirs = set(SpeculatorModel.from_pretrained(folder).state_dict())
        except Exception as error:  # e.g. the verifier's own weights are named otherwise
            print(f"  weights: not loaded: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            failures += 1
            continue
        ours = set(load_file(Path(folder) / "model.safetensors"))
        lacking = sorted(k for k in theirs - ours if not k.startswith(("verifier_", "embed_tokens")))
        print(f"  weights: {len(ours & theirs)} tensors matched; missing {lacking}; unexpected {sorted(ours - theirs)}")
        failures += bool(lacking or ours - theirs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
