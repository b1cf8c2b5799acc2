"""``python -m ema_pg.workbench.claims``: one page of every claim of the paper we test, with our latest verdict.

Reads every verdict the reproductions committed (``reproductions/**``: the rows of each markdown table with a
verdict column, the last look of each claim of a sequential plan's ``looks.csv``, the estimator lab's
``verdicts.csv`` against the paper's Table 1, and the stability simulation's ``summary.json`` against Lemma 4.2)
and writes ``reproductions/CLAIMS.md``: per claim of the paper, the latest verdict with its interval, seeds, the
reproduction it comes from and the seeds a decision would take; the earlier verdicts of the same claim below it
as history; then every other verdict of ours. Nothing on the page is typed by hand: the test
(``tests/workbench/test_claims.py``) checks that every verdict row of every results file appears on it and that the
committed page is the one this command writes.

    python -m ema_pg.workbench.claims                       # writes reproductions/CLAIMS.md
    python -m ema_pg.workbench.claims --check               # exit 1 if the committed page is out of date
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from ..cli import PACKAGE_ROOT as ROOT
from ..cli import command_parser

REPRO = ROOT / "reproductions"
PAGE = REPRO / "CLAIMS.md"
#: the reproductions from oldest to newest: a claim's latest verdict is the newest one's (each a folder, or a tuple of
#: folders that ran side by side, each latest)
ORDER = ("fig4", "stability", "estimator_lab", "table2", "table2/ppo_mini", "fig5_methods", "fig6_k", "reference_updates",
         "table2/decide", "fig5_methods/decide", "fig6_k/decide", "tail_bias/decide", "beta0_collapse", "fig5_methods/decide_strong",
         "fig6_k/decide_strong", "tail_bias/decide_strong", "fig7_eta_direction/decide_strong", "fig8_tail/decide_strong",
         "fig9_iw_clip/decide_strong", "fig9_iw_clip/decide_strong_kl_scale", "table3", "table2/decide_reading",
         "async_anchor", "table2/decide_episode", ("table2/claims", "table2/claims_base660"), "reasoning_gym/suite",
         ("kl_ctrl", "kl_ctrl_amd"))
VERDICT_WORDS = ("stopped at the cap", "holds", "fails", "undecided", "higher", "lower", "continue", "(descriptive)",
                 "not as in the paper", "not the paper's direction")


@dataclass
class Verdict:
    """One verdict a results file states."""

    file: str  # relative to reproductions/
    key: str  # the row's id (P1, E2, ...) or its claim's text
    text: str  # the claim as the row words it
    verdict: str  # holds | fails | undecided | ... (VERDICT_WORDS)
    delta: str = ""  # the effect as the row gives it
    interval: str = ""
    seeds: str = ""
    to_decide: str = ""  # the seeds a decision would take, where the row says
    detectable: str = ""  # a sequential plan's: the effect its cap finds with 80% power, at the sd its looks found
    note: str = ""  # what the row's record lacks, said beside its source (a plan's cells without a base policy)

    @property
    def folder(self) -> str:
        return str(Path(self.file).parent)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _verdict_of(cell: str) -> str | None:
    low = re.sub(r"[*`]", "", cell).strip().lower()
    if re.match(r"^\w+ / \w+", low):  # a plan's template ("holds / fails / undecided"), not a verdict
        return None
    for w in VERDICT_WORDS:
        if low.startswith(w):
            return w.strip("()")
    return None


def table_verdicts(path: Path) -> list[Verdict]:
    """Every row of the markdown tables of ``path`` that has a verdict column (a header containing "verdict", or
    a column whose cells open with a bold verdict word)."""
    rel = str(path.relative_to(REPRO))
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("|") or i + 1 >= len(lines) or not re.match(r"^\|[\s:|-]+\|\s*$", lines[i + 1]):
            i += 1
            continue
        head = [h.lower() for h in _cells(lines[i])]
        j = i + 2
        body = []
        while j < len(lines) and lines[j].startswith("|"):
            body.append(_cells(lines[j]))
            j += 1
        i = j
        vcol = next((k for k, h in enumerate(head) if "verdict" in h), None)
        if vcol is None:  # a "claim | ours" table whose cells open with a bold verdict
            vcol = next((k for k in range(1, len(head)) if body and all(
                re.match(r"^\*\*\w", r[k]) and _verdict_of(r[k]) for r in body if len(r) > k and r[k].startswith("**"))
                and any(len(r) > k and r[k].startswith("**") and _verdict_of(r[k]) for r in body)), None)
        if vcol is None:
            continue
        find = lambda *names: next((k for k, h in enumerate(head) if any(n in h for n in names)), None)
        idc = head.index("id") if "id" in head else None
        tc = find("claim", "comparison", "scheme", "method") or 0
        ic = find("95% ci", "ci of", "bootstrap ci", "interval")
        dc = find("δ mean", "ours", "δ =", "δ vs", "mean δ") if ic != find("δ [95% ci]") or ic is None else None
        sc = next((k for k, h in enumerate(head) if h == "seeds"), None)
        nc = find("seeds for", "seeds to")
        for r in body:
            if len(r) <= vcol or not (v := _verdict_of(r[vcol])):
                continue
            text = r[tc] if tc < len(r) else ""
            key = r[idc] if idc is not None and idc < len(r) else text
            interval = r[ic] if ic is not None and ic < len(r) else ""
            m = re.search(r"\[[^\]]+\]", interval)
            seeds = r[sc] if sc is not None and sc < len(r) else ""
            if not seeds:
                m2 = re.search(r"on (\d+)/(\d+)|\((\d+)/(\d+) seeds\)", " ".join(r))
                seeds = (m2.group(2) or m2.group(4)) if m2 else ""
            out.append(Verdict(rel, key, text, v, r[dc] if dc is not None and dc < len(r) and dc != vcol else "",
                               m.group(0) if m else interval, seeds, r[nc] if nc is not None and nc < len(r) else ""))
    return out


def look_verdicts(path: Path) -> list[Verdict]:
    """The last look of each claim of a sequential plan (``looks.csv``)."""
    import pandas as pd

    from .results import format_seeds, seeds_for, seeds_for_t
    from .studies.decide import load_plan, outlooks
    from .studies.sequential import detectable

    looks = pd.read_csv(path)
    rel = str(path.relative_to(REPRO))
    plan = load_plan(path.parent / "plan.yaml")
    ahead = outlooks(plan.design, looks)
    note = ""
    if (path.parent / "cells.csv").is_file():
        cells = pd.read_csv(path.parent / "cells.csv", dtype=str, keep_default_na=False)
        if "base" not in cells or (cells["base"] == "").any():
            n = len(cells) if "base" not in cells else int((cells["base"] == "").sum())
            note = (f"{n} of its {len(cells)} cells carry no base policy or machine: recorded before cells did, "
                    "their base is not checked")
    out = []
    for cid, g in looks.groupby("claim", sort=False):
        r = g.iloc[-1]
        to_decide = ""
        if (o := ahead.get(str(cid), {}).get("predictive")) is not None:
            to_decide = (f"next look at {o['next_look']}; by the cap ({o['cap']}): holds {o['holds']:.0%}, fails "
                         f"{o['fails']:.0%} (predictive, [sequential.md]({Path(rel).parent / 'sequential.md'}))")
        elif r["verdict"] == "stopped at the cap":
            to_decide = (f"{format_seeds(seeds_for(r['mean_diff'], r['sd_diff']))} (noncentral t: "
                         f"{format_seeds(seeds_for_t(r['mean_diff'], r['sd_diff']))}; a fixed design, if the effect "
                         f"and sd were what the {int(r['seeds'])} seeds show; 80% power, two-sided 5%)")
        out.append(Verdict(rel, str(cid), str(r["text"]), str(r["verdict"]), f"{r['mean_diff']:+.4f}",
                           f"[{r['lo']:+.4f}, {r['hi']:+.4f}]", str(int(r["seeds"])), to_decide,
                           f"{detectable(plan.design) * r['sd_diff']:.4f} (sd {r['sd_diff']:.4f})", note))
    return out


#: the paper's Table 1, as the paper states it: is the value unbiased, and the expected gradient is the gradient of
#: what (the reverse KL, the forward KL, or zero), per registry entry; the Top-k rows as printed (Alg 1 / Alg 2,
#: kl.tail=paper)
TABLE1 = {"exact_reverse": (True, "reverse"), "k1": (True, "zero"), "k2": (False, "reverse"), "k3": (True, "forward"),
          "k3pp": (True, "reverse"), "k4": (True, "reverse"), "topk_reverse[paper]": (True, "reverse"),
          "exact_forward": (True, "forward"), "k5": (True, "forward"), "topk_forward[paper]": (True, "forward")}


def table1_verdicts(path: Path) -> list[Verdict]:
    """Table 1's estimator properties against the lab's exact enumeration, on-policy (the table's setting): the value
    unbiased or not as stated, and the expected gradient equal to the stated KL's gradient (or to zero) exactly."""
    import pandas as pd

    lab = pd.read_csv(path).set_index("entry")
    rel = str(path.relative_to(REPRO))
    out = []
    for entry, (value_ok, grad_of) in TABLE1.items():
        r = lab.loc[entry]
        holds = (r["value_on"] == "unbiased") == value_ok and str(r["follows_on"]) == grad_of
        said = f"value {'unbiased' if value_ok else 'biased'}, E[gradient] = " + (
            "0" if grad_of == "zero" else f"the {grad_of} KL's gradient")
        got = f"value {r['value_on']}, E[gradient] follows {r['follows_on']}"
        out.append(Verdict(rel, f"Table 1: {entry}", f"{entry}: {said}", "holds" if holds else "fails", got,
                           "exact (enumeration)", "", ""))
    return out


def stability_verdict(path: Path) -> list[Verdict]:
    s = json.loads(path.read_text())
    cells = int(s["cells"])
    agree = round(float(s["agreement"]) * cells)
    rel = str(path.relative_to(REPRO))
    v = "holds" if agree / cells > 0.999 else "fails"  # the one disagreement sits on the boundary x = 1 + eta
    return [Verdict(rel, "Lemma 4.2", "the lag's regimes (non-oscillatory / oscillatory / unstable) are where the "
                    "lemma puts them", v, f"{agree} of {cells} cells agree", "simulated", "", "")]


def all_verdicts(root: Path = REPRO) -> list[Verdict]:
    out = []
    for f in sorted(root.rglob("*.md")):
        if f in (root / "README.md", root / "CLAIMS.md"):
            continue
        out += table_verdicts(f)
    for f in sorted(root.rglob("looks.csv")):
        out += look_verdicts(f)
    if (root / "estimator_lab" / "verdicts.csv").is_file():
        out += table1_verdicts(root / "estimator_lab" / "verdicts.csv")
    if (root / "stability" / "summary.json").is_file():
        out += stability_verdict(root / "stability" / "summary.json")
    return out


@dataclass(frozen=True)
class PaperClaim:
    id: str
    where: str  # in the paper
    statement: str
    match: str  # a regular expression on a verdict row's key or text


#: the paper's claims we test, each matched to the verdict rows that test it (one home for the mapping)
PAPER_CLAIMS = (
    PaperClaim("T2-1", "Table 2, §6", "EMA anchor > GRPO (average EM)", r"^(P1$|EMA anchor > GRPO)"),
    PaperClaim("T2-1rg", "Table 2, §6; asked on tasks nobody here wrote", "EMA anchor > GRPO, on reasoning-gym's suite",
               r"^(P1$|EMA anchor > GRPO)"),
    PaperClaim("T2-2", "Table 2, §6", "Top-k forward KL > K3, both with the EMA anchor", r"^(P2$|Top-k forward > K3)"),
    PaperClaim("T2-3", "Table 2, §6", "Top-k reverse KL > K3, both with the EMA anchor", r"^(P3$|Top-k reverse > K3)"),
    PaperClaim("T2-3rg", "Table 2, §6; asked on tasks nobody here wrote", "Top-k reverse > K3, both with the EMA "
               "anchor, on reasoning-gym's suite", r"^(P3$|Top-k reverse > K3)"),
    PaperClaim("T2-4", "Table 2, §6", "token-level KL beats sequence-level KL: GRPO > WARP", r"^(P4$|GRPO > WARP)"),
    PaperClaim("T2-5", "Table 2, §6", "RL raises multi-hop EM (Top-k reverse > before RL)", r"^(P5$|RL raises multi-hop EM: Top-k)"),
    PaperClaim("T2-6", "Table 2, §6", "RL raises multi-hop EM (GRPO > before RL)", r"^(P6$|RL raises multi-hop EM: GRPO)"),
    PaperClaim("T2-7", "Table 2, §6", "Top-k reverse > GRPO on multi-hop QA", r"^(P7$|Top-k reverse > GRPO on multi-hop)"),
    PaperClaim("T2-8", "Table 2, §6", "Top-k reverse > GRPO on general QA", r"^(P8$|Top-k reverse > GRPO on general)"),
    PaperClaim("T2-9", "Table 2, §6", "the relative gain over GRPO is larger on multi-hop than on general QA",
               r"^(P9$|relative gain|\(descriptive\) Top-k reverse's gain)"),
    PaperClaim("T3-1", "Table 3, §6", "EMA-PG > GRPO in Pass@1 on the math track", r"^C3$"),
    PaperClaim("F3-1", "Fig 3, §6", "EMA-PG >= GRPO in Pass@16 (no loss of exploration)", r"^C4$|Pass@16"),
    PaperClaim("F4", "Fig 4, App. G", "Top-k KL's gradient beats sampled-only and truncated KL (bias-variance)",
               r"^Top-k beats|^Truncated KL has"),
    PaperClaim("F5", "Fig 5, §6", "EMA anchor and Top-k KL raise EM over GRPO on the demo task", r"^F[123]$"),
    PaperClaim("F6", "Fig 6, §6", "a larger k helps (k = 32 > k = 0)", r"^K[12]$|k ?32 . k ?0"),
    PaperClaim("F7", "Fig 7, §6", "the recommended EMA rate beats the fixed anchor (eta 0.9 > 1.0)", r"^E[12]$"),
    PaperClaim("F8", "Fig 8, §6", "the tail term with its off-policy correction beats truncated KL", r"^G[1-4]$"),
    PaperClaim("F9a", "Fig 9 (left), §6", "the importance-weight clip range of the Top-k tail", r"^C[12]$"),
    PaperClaim("F9b", "Fig 9 (right), §6", "group vs global advantage normalization make no noticeable difference",
               r"^(N[12]|G[12]|S[12])$"),
    PaperClaim("L4.2", "Lemma 4.2, §4", "the stability condition of the EMA anchor", r"^Lemma 4\.2$"),
    PaperClaim("T1", "Table 1, §3", "each estimator's value and gradient bias as Table 1 states it", r"^Table 1:"),
    PaperClaim("S6-beta0", "§6", "beta = 0 collapses where beta > 0 with the EMA anchor does not", r"^S[12]$"),
)


def _order(v: Verdict) -> int:
    """Where a verdict's reproduction stands in :data:`ORDER` (-1: not listed, the oldest); a tuple there holds
    reproductions that ran side by side (two plans from two base policies), none superseding the other."""
    return next((i for i, e in enumerate(ORDER) if v.folder in ((e,) if isinstance(e, str) else e)), -1)


#: which of a reproduction's files speaks for a verdict it states in several (a report's table over its README's copy)
PREFERENCE = ("looks.csv", "results.md", "summary.json", "verdicts.csv", ".md", "discussion.md", "README.md")


def _preference(v: Verdict) -> int:
    name = Path(v.file).name
    return next((i for i, p in enumerate(PREFERENCE) if name == p), PREFERENCE.index(".md"))


def same_statement(v: Verdict) -> tuple:
    """Rows of one reproduction that state one verdict: the same claim id, or the same verdict on the same interval
    (a report's table and its discussion's summary of it)."""
    interval = re.sub(r"\s+", "", v.interval.replace("−", "-"))
    if interval.startswith("["):
        return (v.folder, v.verdict, interval)
    return (v.folder, re.sub(r"\W+", " ", v.key).strip().lower())


def dedupe(verdicts: list[Verdict]) -> list[Verdict]:
    """One row per statement (:func:`same_statement`): the most authoritative file's (:data:`PREFERENCE`), and of a
    file's rows the one that gives the effect."""
    best: dict[tuple, Verdict] = {}
    for v in verdicts:
        k = same_statement(v)
        if k not in best or (_preference(v), not v.delta) < (_preference(best[k]), not best[k].delta):
            best[k] = v
    return [v for v in verdicts if best[same_statement(v)] is v]


def assign(verdicts: list[Verdict]) -> tuple[dict[str, list[Verdict]], list[Verdict]]:
    """(per paper claim: its verdict rows, oldest first), and the rows that test none of the paper's claims; one row
    per reproduction and claim (:func:`dedupe`)."""
    per, rest = {c.id: [] for c in PAPER_CLAIMS}, []
    for v in dedupe(verdicts):
        c = next((c for c in PAPER_CLAIMS if _matches(c, v)), None)
        (per[c.id] if c else rest).append(v)
    for k in per:
        per[k].sort(key=lambda v: (_order(v), v.file))
    return per, rest


def _matches(c: PaperClaim, v: Verdict) -> bool:
    if c.id.startswith("F") and c.id not in ("F3-1", "F4"):  # figure ids (E1, K1, ...) are reused across folders
        fig = {"F5": "fig5_methods", "F6": "fig6_k", "F7": "fig7_eta_direction", "F8": "fig8_tail", "F9a": "fig9_iw_clip",
               "F9b": "fig9_iw_clip"}
        if not v.file.startswith(fig[c.id]):
            return False
    if c.id == "S6-beta0" and not v.file.startswith("beta0_collapse"):
        return False
    if c.id.startswith("T3") or c.id == "F3-1":
        if not v.file.startswith("table3"):
            return False
    if c.id.startswith("T2") and not v.file.startswith("reasoning_gym" if c.id.endswith("rg") else "table2"):
        return False  # the search world's and reasoning-gym's verdicts of one claim stand beside each other
    return bool(re.search(c.match, v.key) or re.search(c.match, v.text))


def _words(text: str) -> set[str]:
    """A statement's words, without its punctuation: a row that says no more than its claim is not repeated."""
    return set(re.findall(r"[^\s(),:;]+", text))


def _cell(v: Verdict) -> str:
    return f"**{v.verdict}**"


def _link(v: Verdict) -> str:
    return f"[{v.file}]({v.file})" + (f" ({v.note})" if v.note else "")


def _side_by_side() -> str:
    """The sentence that says which reproductions ran side by side (a tuple in :data:`ORDER`), if any."""
    groups = [" and ".join(f"`{f}`" for f in e) for e in ORDER if not isinstance(e, str)]
    return (f" Reproductions that ran side by side ({'; '.join(groups)}) asked the same claims under different "
            "conditions, as their READMEs say: each gives a latest verdict, a row of its own, and their seeds are "
            "never pooled.") if groups else ""


def render(verdicts: list[Verdict]) -> str:
    per, rest = assign(verdicts)
    n = len(verdicts)
    lines = ["# The paper's claims, as they stand here", "",
             "Written by `python -m ema_pg.workbench.claims` from the verdicts the reproductions committed "
             f"({n} verdict rows in all; where a reproduction states a verdict in two files, its report's speaks); "
             "never edited by hand. For each claim of the paper we test: our latest verdict, its "
             "effect and interval, the seeds it rests on, where it comes from, and the seeds a decision would take "
             "(where the reproduction says); earlier verdicts of the same claim are kept below it as history. "
             "**holds** / **fails**: the 95% interval of the paired difference lies above / below 0; **undecided**: "
             "it contains 0; a sequential plan's claim is **stopped at the cap** when no boundary was crossed by its last "
             "look, and **continue** while its looks go on; its **detectable at the cap** is the effect its design "
             "finds with 80% power by its cap at the sd of the paired differences its looks found, so \"stopped at "
             "the cap\" reads as \"smaller than that, if anything\"." + _side_by_side(), "",
             "| claim (paper) | latest verdict | effect | interval | seeds | from | seeds to decide | detectable at the cap |",
             "|---|---|---|---|---|---|---|---|"]
    for c in PAPER_CLAIMS:
        rows = per[c.id]
        if not rows:
            lines.append(f"| {c.statement} ({c.where}) | not tested | | | | | | |")
            continue
        latest = max(map(_order, rows))
        for v in [v for v in rows if _order(v) == latest]:
            label = f"{c.statement}: {v.text}" if _words(v.text) - _words(c.statement) else c.statement
            lines.append(f"| {label} ({c.where}) | {_cell(v)} | {v.delta} | {v.interval} | {v.seeds} | {_link(v)} "
                         f"| {v.to_decide} | {v.detectable} |")
    lines += ["", "## History: the earlier verdicts of each claim", "",
              "| claim (paper) | verdict | effect | interval | seeds | from | detectable at the cap |",
              "|---|---|---|---|---|---|---|"]
    for c in PAPER_CLAIMS:
        rows = per[c.id]
        if not rows:
            continue
        latest = max(map(_order, rows))
        for v in rows:
            if _order(v) != latest:
                lines.append(f"| {c.id}: {v.text} | {_cell(v)} | {v.delta} | {v.interval} | {v.seeds} | {_link(v)} "
                             f"| {v.detectable} |")
    if devs := plan_deviations():
        lines += ["", "## Deviations from the registered plans", "",
                  "Each sequential plan's changes made on purpose, as its `sequential.md` lists them (recorded before "
                  "the look each applies from; `docs/workbench.md`, \"A plan is a contract\"):", "", *devs]
    lines += ["", "## Our own claims and the comparisons beside the paper's", "",
              "| claim | verdict | effect | interval | seeds | from | detectable at the cap |",
              "|---|---|---|---|---|---|---|"]
    for v in sorted(rest, key=lambda v: (_order(v), v.file)):
        key = f"{v.key}: {v.text}" if v.key != v.text else v.text
        lines.append(f"| {key} | {_cell(v)} | {v.delta} | {v.interval} | {v.seeds} | {_link(v)} | {v.detectable} |")
    return "\n".join(lines) + "\n"


def plan_deviations() -> list[str]:
    """Every sequential plan's deviations (:func:`ema_pg.workbench.studies.contract.deviation_lines`), each under its plan."""
    from .studies.contract import deviation_lines
    from .studies.decide import load_plan, state

    out = []
    for f in sorted(REPRO.glob("**/plan.yaml")):
        plan = load_plan(f)
        out += [f"- [{f.parent.relative_to(REPRO)}]({f.parent.relative_to(REPRO)}/sequential.md) " + ln[2:]
                for ln in deviation_lines(plan, state(plan)[1])]
    return out


def main(argv=None) -> int:
    from ..engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("--out", type=Path, default=PAGE)
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what would be written")
    a = ap.parse_args(argv)
    text = render(all_verdicts())
    if a.check:
        same = a.out.is_file() and a.out.read_text() == text
        print(f"{a.out}: {'up to date' if same else 'out of date: run python -m ema_pg.workbench.claims'}")
        return 0 if same else 1
    from ..engine.files import atomic_write

    atomic_write(a.out, text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
