"""Check exported drafters with the `speculators` package's own config classes.

speculators 0.9.0 pins transformers <= 5.19 and pulls torchvision/torchaudio, so it is not installed in
specstand's environment. This script reads its wheel and its pure-Python dependencies from folders:

    pip download speculators==0.9.0 --no-deps -d /tmp/spec && unzip /tmp/spec/*.whl -d /tmp/spec/x
    pip install --target /tmp/specdeps loguru pydantic-settings datasets
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
    from speculators import SpeculatorModelConfig

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
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
