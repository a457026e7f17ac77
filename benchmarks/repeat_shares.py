"""How each run of a bench drafted, run by run: whether a server's repeats are alike.

A report's medians mix repeats; a drafted method's server keeps adaptive verification's estimates across
runs (the bench resets its prompt cache and drafter memory only), so a server still learning in its first
run shows here as a first run that drafts less. Reads report.json's per-run /metrics deltas:

    python benchmarks/repeat_shares.py DIR/report.json [MORE/report.json ...]

prints, per target and user count, each run's share of target passes that verified a draft, tau over all
passes, the engine's "other" seconds (admission, verification, emission, and the drafter's own bookkeeping in
begin, extend and end) and wall seconds, in the order the runs ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specstand.bench.summary import drafting


def run_line(run: dict) -> str:
    figures = drafting(run["metrics_delta"])
    if figures["tau"] is None:
        return f"{run['wall_s']:.1f}s (no specstand metrics)"
    other = run["metrics_delta"].get("specstand:engine_seconds_total[phase=other]", float("nan"))
    return f"{figures['drafted_passes']:4.0%} tau {figures['tau']:.2f} other {other:.2f}s {run['wall_s']:.1f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    for path in parser.parse_args().reports:
        report = json.loads(path.read_text())
        print(f"{path}{'' if report['complete'] else ' (incomplete)'}")
        print("  target, users, warm: each run's passes that verified a draft, tau over all passes, "
              "the engine's other seconds, wall time")
        lines: dict[tuple, list[str]] = {}
        for run in report["runs"]:
            lines.setdefault((run["target"], run["users"], run.get("warm", "")), []).append(run_line(run))
        for (target, users, warm), runs in lines.items():
            print(f"  {target}, U={users}, {warm or '-'}: " + " | ".join(runs))


if __name__ == "__main__":
    main()
