"""What every command family shares: the one-line error, the parser that raises it, logging to stderr."""

from __future__ import annotations

import argparse
import math
import sys

DTYPE_CHOICES = ["bf16", "fp32", "q8_0"]  # models/loading.py DTYPES
DTYPE_HELP = "weights: bf16, fp32, or q8_0 (bf16 model, linears as Q8_0 blocks: about half the bytes a pass reads)"
AUTO_DTYPE_HELP = (DTYPE_HELP + "; auto (the default): whichever of bf16 and the model's published Q8_0 blocks "
                   "measures cheaper on this CPU, said in one line at start")
API_KEY_ENV = "SPECSTAND_API_KEY"


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class CliParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(message)


def finite_float(text: str) -> float:
    """argparse's type for a float option: float() also reads "inf" and "nan", which no option means (an
    infinite --stagger hangs the bench; --prefix-cache-gb inf overflows)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
