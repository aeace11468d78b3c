"""The results of a benchmark: groups of timed contenders, their ratios and the targets checked on them, saved as
``benchmarks/results/<name>.json`` (with the machine and library versions), ``<name>.md`` (Markdown tables) and
``<name>.png`` (a bar chart of the ratios).

``python benchmarks/_report.py results/*.json`` re-renders the tables and charts from the JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from _harness import Settings, Timing
from _machine import REDUCED, machine, machine_line

CLOCKS = {
    "wall": "wall time (time.perf_counter)",
    "cpu": "process CPU time (time.process_time; the wall-clock ratio is in the *wall ratio* column)",
}
# extra_columns (row.extra key, header, format) that several scripts show
FORMAT_COLUMN = ("format", "format", "")  # the memory format a contender's backbone ran in
ABS_DIFF_COLUMN = ("max_abs_diff", "max abs diff", ".1e")  # its outputs against the reference's
REL_DIFF_COLUMN = ("max_rel_diff", "max rel diff", ".1e")


# --------------------------------------------------------------------------------------------------
# groups, ratios and targets


@dataclass
class Row:
    """One contender in one group: its timing summary and its ratio to the group's baseline."""

    name: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    ratio: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    """Contenders timed together (one case, mode, batch and precision), with their baseline."""

    case: str
    params: dict[str, Any]
    baseline: str
    rounds: int
    calls_per_sample: int
    rows: list[Row]

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def has(self, name: str) -> bool:
        return any(r.name == name for r in self.rows)

    @property
    def label(self) -> str:
        """``case: k=v, ...``: the group a target was checked in."""
        return f"{self.case}: {format_params(self.params)}"


def make_group(
    case: str, params: dict[str, Any], timing: Timing, baseline: str, extras: dict[str, dict] | None = None
) -> Group:
    """Summarize ``timing`` as rows with ratios to ``baseline`` (ratio > 1: slower than the baseline)."""
    base = timing.median(baseline)
    other = "wall" if timing.clock == "cpu" else "cpu"
    other_base = statistics.median(timing.other[baseline]) if timing.other else None
    rows = []
    for name in timing.samples:
        q1, q3 = timing.quartiles(name)
        median = timing.median(name)
        extra = dict((extras or {}).get(name, {}))
        if other_base:
            other_median = statistics.median(timing.other[name])
            extra[f"{other}_median_ms"] = other_median * 1e3
            extra[f"{other}_ratio"] = other_median / other_base
        rows.append(Row(name, median * 1e3, q1 * 1e3, q3 * 1e3, median / base, extra))
    return Group(case, params, baseline, timing.rounds, timing.calls_per_sample, rows)


def ratio(group: Group, a: str, b: str) -> float:
    """median(a) / median(b) within one group (same run, same rounds)."""
    return group.row(a).median_ms / group.row(b).median_ms


@dataclass
class Target:
    """A claim checked against ratios measured in this run."""

    claim: str
    group: str
    measured: float
    limit: float
    kind: str  # "<=": measured must not exceed limit; ">=": must reach it
    unit: str = "x"  # "x" for ratios, "" for counts

    @property
    def met(self) -> bool:
        return self.measured <= self.limit if self.kind == "<=" else self.measured >= self.limit


BF16_SPEEDUP = 1.5  # issue 23: precision="bf16" against float32 (extraction, the PerceptualLoss step, a dump)


def with_precision(name: str, precision: str) -> str:
    """The row of contender ``name`` run in ``precision``: ``FeatureExtractor (auto), precision='bf16'``."""
    return f"{name}, precision={precision!r}"


def precision_targets(g: Group, auto: str, contiguous: str, slack: float, speedup: bool) -> list[Target]:
    """In each reduced precision of the group: ``auto`` at most ``slack`` times ``contiguous``'s time; with
    ``speedup``, ``auto`` in bf16 at least ``BF16_SPEEDUP`` times faster than in float32."""
    found = []
    for precision in REDUCED:
        ours, theirs = with_precision(auto, precision), with_precision(contiguous, precision)
        if not g.has(ours):
            continue
        found.append(Target(f"{ours} / {theirs}", g.label, ratio(g, ours, theirs), slack, "<="))
        if precision == "bf16" and speedup:
            found.append(Target(f"{auto} / {ours} (bf16 speed-up)", g.label, ratio(g, auto, ours), BF16_SPEEDUP, ">="))
    return found


# --------------------------------------------------------------------------------------------------
# Markdown and charts


def format_params(params: dict[str, Any]) -> str:
    """``k=v, k=v``: a group's parameters in table headings, chart legends and target labels."""
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def summary(groups: Sequence[Group]) -> list[str]:
    """Per case, one line per group and one column per contender: the ratios at a glance."""
    cases: dict[str, list[Group]] = {}
    for g in groups:
        cases.setdefault(g.case, []).append(g)
    lines = []
    for case, gs in cases.items():
        names = list(dict.fromkeys(r.name for g in gs for r in g.rows))
        lines += [
            f"**{case}**: ratio to *{gs[0].baseline}* (lower is faster)",
            "",
            "| " + " | ".join(["params", *names]) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for g in gs:
            ratios = {r.name: f"{r.ratio:.2f}" for r in g.rows}
            lines.append(f"| {format_params(g.params)} | " + " | ".join(ratios.get(n, "–") for n in names) + " |")
        lines.append("")
    return lines


def markdown(
    title: str,
    cfg: Settings,
    info: dict[str, Any],
    groups: Sequence[Group],
    targets: Sequence[Target],
    notes: Sequence[str] = (),
    extra_columns: Sequence[tuple[str, str, str]] = (),
) -> str:
    """A Markdown report: command, machine, target verdicts, then one table per group.

    ``extra_columns``: (row.extra key, column header, format spec) appended to every table.
    """
    if cfg.clock == "cpu":
        extra_columns = [("wall_ratio", "wall ratio", ".3f"), *extra_columns]
    lines = [
        f"## {title}",
        "",
        f"Command: `{cfg.command}`  ",
        f"Machine: {machine_line(info)}  ",
        f"Clock: {CLOCKS[cfg.clock]}; load average at the end: {info.get('load_average_at_end')}",
        "",
    ]
    if cfg.quick:
        lines += ["**Quick mode**: tiny sizes, two rounds; these numbers check the script, not speed.", ""]
    if targets:
        lines += ["| target | group | measured | limit | met |", "|---|---|---:|---:|:---:|"]
        for t in targets:
            measured = f"{t.measured:.3f}x" if t.unit == "x" else f"{t.measured:g}"
            lines.append(
                f"| {t.claim} | {t.group} | {measured} | {t.kind} {t.limit:g}{t.unit} | "
                f"{'yes' if t.met else '**no**'} |"
            )
        lines.append("")
    lines += summary(groups)
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    for g in groups:
        lines += [
            f"### {g.case} ({format_params(g.params)})",
            "",
            f"{g.rounds} interleaved rounds, {g.calls_per_sample} call(s) per sample; ratio = median / "
            f"median of *{g.baseline}*.",
            "",
        ]
        header = "| contender | median ms | IQR ms | ratio |" + "".join(f" {h} |" for _, h, _ in extra_columns)
        lines += [header, "|---|---:|---:|---:|" + "---:|" * len(extra_columns)]
        for r in g.rows:
            cells = "".join(f" {_cell(r.extra.get(k), spec)} |" for k, _, spec in extra_columns)
            lines.append(f"| {r.name} | {r.median_ms:.2f} | {r.p25_ms:.2f}–{r.p75_ms:.2f} | {r.ratio:.3f} |{cells}")
        lines.append("")
    return "\n".join(lines)


def chart(
    path: Path,
    title: str,
    groups: Sequence[Group],
    subtitle: str = "",
    xlabel: str = "time / baseline (lower is faster)",
) -> None:
    """One panel per case; per contender one bar per variant (mode, batch, size, precision); saved small."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases: dict[str, list[Group]] = {}
    for g in groups:
        cases.setdefault(g.case, []).append(g)
    variants = list(dict.fromkeys(format_params(g.params) for g in groups))
    colors = plt.get_cmap("tab10")
    heights = []
    for gs in cases.values():
        names = list(dict.fromkeys(r.name for g in gs for r in g.rows))
        heights.append(0.5 + len(names) * (0.12 * len(gs) + 0.12))
    fig, axes = plt.subplots(
        len(cases), 1, figsize=(8, sum(heights) + 1.2), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, (case, gs) in zip(axes[:, 0], cases.items()):
        names = list(dict.fromkeys(r.name for g in gs for r in g.rows))
        bar = 0.8 / len(gs)
        for k, g in enumerate(gs):
            ratios = {r.name: r.ratio for r in g.rows}
            ys = [
                len(names) - 1 - i + (len(gs) - 1 - k - (len(gs) - 1) / 2) * bar
                for i, n in enumerate(names)
                if n in ratios
            ]
            vals = [ratios[n] for n in names if n in ratios]
            ax.barh(ys, vals, height=bar * 0.9, color=colors(variants.index(format_params(g.params)) % 10))
            for y, v in zip(ys, vals):
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=5.5)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names[::-1], fontsize=7)
        ax.axvline(1.0, color="black", lw=0.7)
        ax.set_title(case, fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(0, max(r.ratio for g in gs for r in g.rows) * 1.15)
    axes[-1, 0].set_xlabel(xlabel, fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i % 10)) for i in range(len(variants))]
    fig.legend(handles, variants, loc="lower center", ncol=2, fontsize=6, frameon=False)
    fig.suptitle(title, fontsize=9)
    if subtitle:
        fig.text(0.5, 0.955, "\n".join(textwrap.wrap(subtitle, 140)), ha="center", va="top", fontsize=5.5)
    rows = (len(variants) + 1) // 2
    fig.tight_layout(rect=(0, 0.012 + 0.1 * rows / (sum(heights) + 1.2), 1, 0.94))
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# files: save, publish, render


def save(
    name: str,
    title: str,
    cfg: Settings,
    groups: Sequence[Group],
    targets: Sequence[Target],
    config: dict[str, Any],
    notes: Sequence[str] = (),
    extra_columns: Sequence[tuple[str, str, str]] = (),
    partial: bool = False,
) -> dict[str, Any]:
    """Write ``<name><tag>.json``, ``.md`` and ``.png`` under ``cfg.out``; return the JSON payload.

    ``partial``: the run is still going (scripts save after every group, so a run cut short by a
    time limit keeps what it measured); no chart then.
    """
    info = machine(cfg.device)
    payload = {
        "benchmark": name,
        "title": title,
        "command": cfg.command,
        "quick": cfg.quick,
        "partial": partial,
        "machine": info,
        "config": config,
        "notes": list(notes),
        "clock": cfg.clock,
        "extra_columns": [list(c) for c in extra_columns],
        "targets": [{**t.__dict__, "met": t.met} for t in targets],
        "groups": [
            {
                "case": g.case,
                "params": g.params,
                "baseline": g.baseline,
                "rounds": g.rounds,
                "calls_per_sample": g.calls_per_sample,
                "rows": [
                    {
                        "name": r.name,
                        "median_ms": r.median_ms,
                        "p25_ms": r.p25_ms,
                        "p75_ms": r.p75_ms,
                        "ratio": r.ratio,
                        **r.extra,
                    }
                    for r in g.rows
                ],
            }
            for g in groups
        ],
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    stem = cfg.out / f"{name}{cfg.tag}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(title, cfg, info, groups, targets, notes, extra_columns)
    if partial:
        text = text.replace("\n\n", "\n\n**Partial results**: the run had not finished when this was written.\n\n", 1)
    stem.with_suffix(".md").write_text(text + "\n")
    if cfg.plot and groups and not partial:
        chart(stem.with_suffix(".png"), title, groups, subtitle=f"{machine_line(info)}; clock: {cfg.clock}")
    return payload


def publish(cfg: Settings, payload: dict[str, Any]) -> dict[str, Any]:
    """Print the Markdown report of the results :func:`save` just wrote (stdout carries the report, progress goes
    to stderr) and return their JSON ``payload``: every script's last step."""
    print((cfg.out / f"{payload['benchmark']}{cfg.tag}.md").read_text())
    return payload


def no_notes(groups: Sequence[Group]) -> list[str]:
    """No notes drawn from the groups (the default of :attr:`Results.overview`)."""
    return []


@dataclass
class Results:
    """The groups of a run that saves after every group, so that a run cut short by a time limit keeps them.

    ``targets`` and ``overview`` (notes after ``notes``) are recomputed from the groups at every save.
    """

    name: str
    title: str
    cfg: Settings
    config: dict[str, Any]
    targets: Callable[[list[Group]], list[Target]]
    notes: Sequence[str]
    extra_columns: Sequence[tuple[str, str, str]]
    overview: Callable[[list[Group]], list[str]] = no_notes
    groups: list[Group] = field(default_factory=list)

    def add(self, group: Group) -> None:
        """Keep ``group`` and save every group so far as partial results."""
        self.groups.append(group)
        self.write(partial=True)

    def finish(self) -> dict[str, Any]:
        """Save the complete results and print their report; return the JSON payload."""
        return publish(self.cfg, self.write(partial=False))

    def write(self, *, partial: bool) -> dict[str, Any]:
        """Save the groups so far (see :func:`save`)."""
        notes = [*self.notes, *self.overview(self.groups)]
        targets = self.targets(self.groups)
        return save(
            self.name, self.title, self.cfg, self.groups, targets, self.config, notes, self.extra_columns, partial
        )


def render(json_path: Path, *, plot: bool = True) -> None:
    """Rewrite the ``.md`` (and ``.png``) next to a results ``.json`` from its contents."""
    data = json.loads(Path(json_path).read_text())
    groups = [
        Group(
            g["case"],
            g["params"],
            g["baseline"],
            g["rounds"],
            g["calls_per_sample"],
            [
                Row(
                    r["name"],
                    r["median_ms"],
                    r["p25_ms"],
                    r["p75_ms"],
                    r["ratio"],
                    {k: v for k, v in r.items() if k not in ("name", "median_ms", "p25_ms", "p75_ms", "ratio")},
                )
                for r in g["rows"]
            ],
        )
        for g in data["groups"]
    ]
    targets = [
        Target(t["claim"], t["group"], t["measured"], t["limit"], t["kind"], t.get("unit", "x"))
        for t in data["targets"]
    ]
    clock = data.get("clock", "wall")
    cfg = Settings(
        torch.device(data["machine"]["device"]),
        data["quick"],
        0.0,
        0,
        0,
        0,
        Path(json_path).parent,
        "",
        plot,
        data["command"],
        data["machine"]["torch_threads"],
        clock,
    )
    text = markdown(
        data["title"],
        cfg,
        data["machine"],
        groups,
        targets,
        data["notes"],
        [tuple(c) for c in data.get("extra_columns", [])],
    )
    if data.get("partial"):
        text = text.replace("\n\n", "\n\n**Partial results**: the run had not finished when this was written.\n\n", 1)
    Path(json_path).with_suffix(".md").write_text(text + "\n")
    if plot and groups:
        chart(
            Path(json_path).with_suffix(".png"),
            data["title"],
            groups,
            subtitle=f"{machine_line(data['machine'])}; clock: {clock}",
        )


if __name__ == "__main__":  # python benchmarks/_report.py results/*.json: re-render tables and charts
    for arg in sys.argv[1:]:
        render(Path(arg))
