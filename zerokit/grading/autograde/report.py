"""The line printed per notebook as it finishes, with the reason for every lost point."""

from __future__ import annotations


def report(echo, done, total, job, r):
    score = "?" if r["score"] is None else f"{r['score']:g}"
    line = (f"[{done:>{len(str(total))}}/{total}] {job.student} / {job.lesson}: {score} of {r['max_score']:g} "
            f"points ({r['seconds']:.0f} s)")
    if r["strays"]:
        line += f"; killed {len(r['strays'])} leftover process(es): {', '.join(r['strays'])}"
    echo(line)
    for name, (s, m) in r["cells"].items():
        if (s or 0) < m:
            echo(f"    {name} {s or 0:g}/{m:g}: {r['reasons'].get(name, '(no reason recorded)')}")
    if "(feedback)" in r["reasons"]:
        echo(f"    {r['reasons']['(feedback)']}")
