"""Latency-model forms compared on the same timings: fit on a profile's samples, score on the
held-out test set measured with it (``laser profile --evaluate --json``).

    laser profile --evaluate --threads T -o prof.json --json rep.json
    python benchmarks/latency_refit.py prof.json rep.json [prof2.json rep2.json ...]

For each (profile, report) pair it prints the accuracy (1 - |pred - actual| / actual) of

* ``stored``: the model in the profile file, as fitted when it was measured (the code of then);
* every form of :data:`FORMS`, fitted now by this code on the same samples.

Training samples and test cases are the same measurements for every column, so a difference
between columns is the model's, not the machine's noise (a busy machine makes both columns
worse alike). The report's ``measurement`` line says how disturbed the timings were.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laser.latency import FittedLatencyModel  # noqa: E402
from laser.latency.fitting import FORMS, fit  # noqa: E402
from laser.profiler import PROFILE_WIDTHS, score  # noqa: E402


def models(doc: dict) -> dict:
    """``{"stored": model of the file, form: model refitted in that form}``."""
    stored = FittedLatencyModel.from_dict(doc)
    out = {"stored": stored}
    for form in FORMS:
        out[form] = fit(stored.samples, num_layers=stored.num_layers, metadata=stored.metadata,
                        widths=PROFILE_WIDTHS, form=form)
    return out


def rows(rep: dict) -> list[tuple[str, dict]]:
    """(label, summary) of the report's lines, in ``format_report``'s order."""
    out = [(f"module {m}", s) for m, s in rep["per_module"].items()]
    out.append(("layer step: all", rep["per_layer_step"]))
    out += [(f"layer step: {k}", s) for k, s in rep["per_layer_step"]["by_kind"].items()]
    if rep.get("per_layer_step_in_pass"):
        out.append(("layer step: decode, in pass", rep["per_layer_step_in_pass"]))
    out.append(("iteration: all", rep["per_iteration"]))
    out += [(f"iteration: {k}", s) for k, s in rep["per_iteration"]["by_kind"].items()]
    sd = rep.get("per_small_decode_iteration")
    if sd and sd.get("n"):
        out.append(("small decode it.: all", sd))
        out += [(f"small decode it.: b {k}", s) for k, s in sd["by_batch"].items() if s["n"]]
    return out


def compare(profile_path: str, report_path: str) -> str:
    doc = json.loads(Path(profile_path).read_text())
    report = json.loads(Path(report_path).read_text())
    scored = {name: score(copy.deepcopy(report), lm) for name, lm in models(doc).items()}
    names = list(scored)
    su, ms = report["setup"], report["measurement"]
    lines = [f"{profile_path} / {report_path}: {su.get('model_name')} {su['dtype']}, {su['threads']} threads, "
             f"{su.get('executor', 'eager')} executor, {su['hardware']}",
             f"  timings: {100 * ms['clean_fraction']:.0f}% clean, {100 * ms.get('disturbed_fraction', 0):.0f}% "
             f"disturbed (reference calls up to {100 * ms.get('max_reference_drift', 0):.0f}% over their best), "
             f"{100 * ms['settled_fraction']:.0f}% of cases settled",
             "  mean accuracy (bias: mean pred/actual - 1)",
             f"  {'':<26}" + "".join(f"{n:>20}" for n in names) + f"{'n':>5}"]
    per = {n: rows(r) for n, r in scored.items()}
    for k, (label, s0) in enumerate(per[names[0]]):
        cells = []
        for n in names:
            s = per[n][k][1]
            cells.append("n/a" if s["mean_accuracy"] is None else
                         f"{100 * s['mean_accuracy']:5.1f}% ({100 * s['mean_bias']:+5.1f}%)")
        lines.append(f"  {label:<26}" + "".join(f"{c:>20}" for c in cells) + f"{s0['n']:>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="profile.json report.json [profile2.json report2.json ...]")
    args = ap.parse_args(argv)
    if len(args.files) % 2:
        ap.error("give files in (profile, report) pairs")
    for p, r in zip(args.files[::2], args.files[1::2]):
        print(compare(p, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
