"""The line printed per notebook as it finishes, with the reason for every lost point."""

from __future__ import annotations


def _late(late):
    hours = late["seconds_late"] / 3600
    when = f"{hours:.1f} h" if hours >= 1 else f"{late['seconds_late'] / 60:.0f} min"
    return f"; late by {when}: {late['raw']:g} raw, {late['penalty']:g} off"


def report(echo, done, total, job, r):
    score = "?" if r["score"] is None else f"{r['score']:g}"
    line = (f"[{done:>{len(str(total))}}/{total}] {job.student} / {job.lesson}: {score} of {r['max_score']:g} "
            f"points ({r['seconds']:.0f} s{', graded alone' if job.alone else ''})")
    if r.get("late"):
        line += _late(r["late"])
    if r["strays"]:
        line += f"; killed {len(r['strays'])} leftover process(es): {', '.join(r['strays'])}"
    echo(line)
    for name, (s, m) in r["cells"].items():
        if (s or 0) < m:
            echo(f"    {name} {s or 0:g}/{m:g}: {r['reasons'].get(name, '(no reason recorded)')}")
    if "(feedback)" in r["reasons"]:
        echo(f"    {r['reasons']['(feedback)']}")
