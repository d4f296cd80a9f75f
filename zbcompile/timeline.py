"""Pictures of a simulated schedule: an ASCII timeline for terminals and an SVG like the papers' figures.

Both draw one row per rank with time running left to right, so bubbles show as gaps:

    rank 0 |F0  F1  F2  F3  B0  W0  F4  B1  W1 ...
    rank 1 |....F0  F1  F2  B0  F3  W0  B1 ...

A rank that holds several stages (interleaved loops, V shapes, DualPipe's mirrored pipeline) runs several
chunks; the second chunk is drawn in lower case (ASCII) or a lighter shade of the same colour (SVG).
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from zbcompile.ir.schedule import KIND_SPECS, Action, Kind, Schedule
from zbcompile.simulate import SimResult

__all__ = ["ascii_timeline", "svg_timeline", "svg_memory"]

_MAX_ASCII_WIDTH = 200


def chunk_of(schedule: Schedule) -> dict[int, int]:
    """stage -> its index among the stages of its rank (0 for the first chunk, 1 for the second, ...)."""
    seen = [0] * schedule.num_ranks
    chunks = {}
    for s, r in enumerate(schedule.placement):
        chunks[s] = seen[r]
        seen[r] += 1
    return chunks


def _shade(action: Action, chunks: dict[int, int]) -> int:
    """1 for an action of a rank's second (fourth, ...) chunk, else 0. A sharded action's stage field is
    its vocabulary shard, not a stage: it is drawn in the first shade."""
    return 0 if KIND_SPECS[action.kind].sharded else chunks[action.stage] % 2


# ---- ASCII -------------------------------------------------------------------------------------
def ascii_timeline(result: SimResult, width: int | None = None) -> str:
    """One text row per rank, `width` columns for the makespan (default: wide enough for every label,
    at most 200 columns). Idle time is '.', an action shows its kind and microbatch (`F3`, `BW0`)."""
    schedule = result.schedule
    chunks = chunk_of(schedule)
    if width is None:
        width = _auto_width(result)
    scale = width / result.makespan if result.makespan > 0 else 0.0
    lines = []
    for r in range(schedule.num_ranks):
        cells = ["."] * width
        for a, t0, t1 in result.timed(r):
            c0 = min(width - 1, round(t0 * scale))
            c1 = min(width, max(c0 + 1, round(t1 * scale)))
            cells[c0:c1] = _cell_text(a, _shade(a, chunks) == 1, c1 - c0)
        lines.append(f"rank {r:>2} |" + "".join(cells))
    lines.append(_ascii_axis(result.makespan, width))
    legend = "F forward, B input backward, W weight backward, BW fused backward, . idle"
    if schedule.vocab_shards:
        legend += "; S/T vocab output shard, IF/IB vocab input shard"
    most = max(chunks.values(), default=0)
    if most > 0:   # the chunks alternate case: 2 of them read at a glance, more by their order
        legend += ("; lower case = second chunk on the rank" if most == 1 else
                   "; the rank's chunks alternate upper / lower case, from its first chunk (upper)")
    lines.append(legend)
    return "\n".join(lines)


def _label(action: Action, second_chunk: bool) -> str:
    code = KIND_SPECS[action.kind].code
    kind = code.lower() if second_chunk else code
    return f"{kind}{action.microbatch}"


def _cell_text(action: Action, second_chunk: bool, span: int) -> str:
    """`span` characters for one action: its label and a gap when they fit, else just the kind, so that
    neighbouring actions never run together into something like `w0f1`."""
    label = _label(action, second_chunk)
    if len(label) < span:
        return label.ljust(span)
    return label.rstrip("0123456789").ljust(span)[:span]


def _auto_width(result: SimResult) -> int:
    durations = [t1 - t0 for r in range(result.schedule.num_ranks) for _, t0, t1 in result.timed(r) if t1 > t0]
    if not durations or result.makespan <= 0:
        return 40
    longest_label = max(len(_label(a, False)) for _, _, a in result.schedule.actions())
    per_unit = (longest_label + 1) / min(durations)
    return max(20, min(_MAX_ASCII_WIDTH, math.ceil(result.makespan * per_unit)))


def _ascii_axis(makespan: float, width: int) -> str:
    """A ruler under the rows: a '|' every tick with the time written after it."""
    step = _nice_step(makespan, max(1, width // 12))
    ruler = [" "] * (width + 12)
    t = 0.0
    while t <= makespan + 1e-9:
        col = round(t / makespan * width) if makespan > 0 else 0
        text = f"|{t:g}"
        if all(c == " " for c in ruler[col: col + len(text) + 1]):
            ruler[col: col + len(text)] = text
        t += step
    return "   time  " + "".join(ruler).rstrip()


def _nice_step(span: float, ticks: int) -> float:
    """A 1/2/5 x 10^k step giving about `ticks` ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(k * base for k in (1, 2, 5, 10) if k * base >= raw)


# ---- SVG ---------------------------------------------------------------------------------------
# Fill per kind for the first chunk and for the second (lighter) chunk.
_COLOURS = {
    Kind.F: ("#4a86c5", "#a9cbea"),
    Kind.B: ("#3fa36b", "#a5d9b8"),
    Kind.W: ("#8e6bbf", "#d2c2e8"),
    Kind.BW: ("#e08a3c", "#f5c99c"),
    # vocabulary parallelism: the output layer's shard passes in reds, the input embedding's in teals
    Kind.S: ("#c8474f", "#e9a3a7"),
    Kind.T: ("#8f2d56", "#d59ab3"),
    Kind.IF: ("#2a9d8f", "#9fd8d0"),
    Kind.IB: ("#1f6f78", "#93c4c9"),
}
_OTHER_COLOURS = ("#8c8c8c", "#cfcfcf")  # a kind with no colour of its own here
_FONT = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""


def svg_timeline(result: SimResult, *, width: int = 1200, title: str | None = None) -> str:
    """The schedule as an SVG document: a row of boxes per rank, microbatch numbers inside, a time axis
    and a legend. `width` is the pixel width of the plot area."""
    schedule = result.schedule
    chunks = chunk_of(schedule)
    left, top, row_h, gap = 64, 44, 24, 4
    plot_h = schedule.num_ranks * (row_h + gap)
    scale = width / result.makespan if result.makespan > 0 else 0.0
    total_w, total_h = left + width + 20, top + plot_h + 84 + 22 * (max(chunks.values(), default=0) > 0)
    title = title or (f"{schedule.name}: p={schedule.num_ranks}, m={schedule.num_microbatches}, "
                      f"makespan {result.makespan:g}, bubble rate {100 * result.bubble_rate:.2f}%")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
        f'viewBox="0 0 {total_w} {total_h}">',
        f'<rect x="0" y="0" width="{total_w}" height="{total_h}" fill="white"/>',
        f'<text x="{left}" y="24" font-size="15" font-weight="bold" {_FONT}>{escape(title)}</text>',
    ]
    for r in range(schedule.num_ranks):
        y = top + r * (row_h + gap)
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4:.1f}" font-size="12" text-anchor="end" '
                   f'{_FONT}>rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{width}" height="{row_h}" fill="#f2f2f2"/>')
        for a, t0, t1 in result.timed(r):
            out.append(_svg_box(a, left + t0 * scale, y, (t1 - t0) * scale, row_h, _shade(a, chunks)))
    out += _svg_axis(result.makespan, left, top + plot_h, width, scale)
    out += _svg_legend(schedule, chunks, left, top + plot_h + 50)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_box(a: Action, x: float, y: float, w: float, h: float, shade: int) -> str:
    fill = _COLOURS.get(a.kind, _OTHER_COLOURS)[shade]
    box = (f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{fill}" stroke="#222" '
           f'stroke-width="0.6"><title>{a} ({KIND_SPECS[a.kind].label}, '
           f'{"shard" if KIND_SPECS[a.kind].sharded else "stage"} {a.stage}, microbatch {a.microbatch})</title></rect>')
    text = str(a.microbatch)
    size = min(12.0, h * 0.55, (w - 2) / (0.62 * len(text)))
    if size < 6:  # too narrow to read: the colour and the tooltip still say what it is
        return box
    colour = "white" if shade == 0 else "#111"
    return box + (f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + size * 0.36:.2f}" font-size="{size:.1f}" '
                  f'text-anchor="middle" fill="{colour}" {_FONT}>{text}</text>')


def _svg_axis(makespan: float, left: int, y: int, width: int, scale: float) -> list[str]:
    out = [f'<line x1="{left}" y1="{y + 2}" x2="{left + width}" y2="{y + 2}" stroke="#444"/>']
    step = _nice_step(makespan, 12)
    t = 0.0
    while t <= makespan + 1e-9:
        x = left + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{y + 2}" x2="{x:.2f}" y2="{y + 7}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{y + 19}" font-size="11" text-anchor="middle" {_FONT}>{t:g}</text>')
        t += step
    out.append(f'<text x="{left + width}" y="{y + 34}" font-size="11" text-anchor="end" fill="#444" '
               f'{_FONT}>time (cost units)</text>')
    return out


def _svg_legend(schedule: Schedule, chunks: dict[int, int], left: int, y: int) -> list[str]:
    """One legend row per shade: the kinds present, then 'idle' at the end of the first row."""
    kinds = [k for k in Kind if any(a.kind is k for _, _, a in schedule.actions())]
    shades = (0, 1) if max(chunks.values(), default=0) > 0 else (0,)
    out = []
    for shade in shades:
        entries = [(_COLOURS.get(k, _OTHER_COLOURS)[shade],
                    f"{KIND_SPECS[k].code} {KIND_SPECS[k].label}" + (" (2nd chunk)" if shade else ""))
                   for k in kinds if not (shade and KIND_SPECS[k].sharded)]
        if shade == 0:
            entries.append(("#f2f2f2", "idle"))
        x = left
        for fill, label in entries:
            out.append(f'<rect x="{x}" y="{y}" width="16" height="14" fill="{fill}" stroke="#222" '
                       f'stroke-width="0.6"/>')
            out.append(f'<text x="{x + 21}" y="{y + 11}" font-size="12" {_FONT}>{escape(label)}</text>')
            x += 34 + 7 * len(label)
        y += 22
    return out


# ---- memory over the step (passes/analysis/memory/) ----------------------------------------------------
_MEMORY_COLOURS = {"saved": "#4e79a7", "boundary": "#f28e2b", "grads": "#59a14f", "workspace": "#e15759",
                   "params": "#b07aa1", "other": "#bab0ac"}


def svg_memory(plan, *, width: int = 1000, row_h: int = 120, title: str | None = None) -> str:
    """A MemoryPlan as an SVG document: per rank, the step's dynamic bytes after every op stacked by category,
    the peak while each op runs as a line, and the rank's peak marked; x is the op index. All ranks share one
    byte scale, so their heights compare."""
    from zbcompile.passes.analysis.memory import CATEGORIES

    left, top, gap = 90, 44, 34
    top_bytes = max((r.peak_dynamic_bytes for r in plan.ranks), default=0) or 1
    total_w, total_h = left + width + 20, top + len(plan.ranks) * (row_h + gap) + 40
    title = title or f"{plan.name}: device memory the step allocates, per rank (resident memory not shown)"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
           f'viewBox="0 0 {total_w} {total_h}">',
           f'<rect x="0" y="0" width="{total_w}" height="{total_h}" fill="white"/>',
           f'<text x="{left}" y="24" font-size="15" font-weight="bold" {_FONT}>{escape(title)}</text>']
    for k, rank in enumerate(plan.ranks):
        y0 = top + k * (row_h + gap) + row_h   # the row's baseline
        n = max(len(rank.samples), 1)

        def x(i: float) -> float:
            return left + width * i / n

        def y(b: float) -> float:
            return y0 - row_h * b / top_bytes

        out.append(f'<text x="{left - 8}" y="{y0 - row_h / 2:.1f}" font-size="12" text-anchor="end" {_FONT}>'
                   f'rank {rank.rank}</text>')
        out.append(f'<text x="{left - 8}" y="{y0 - row_h / 2 + 15:.1f}" font-size="10" text-anchor="end" '
                   f'fill="#444" {_FONT}>{rank.peak_dynamic_bytes / 2**20:.2f} MiB</text>')
        out.append(f'<rect x="{left}" y="{y0 - row_h}" width="{width}" height="{row_h}" fill="#f7f7f7"/>')
        samples = rank.samples
        # only where the stack changes (most ops move no memory): a few hundred points per rank, not thousands
        keep = [i for i, s in enumerate(samples) if i in (0, len(samples) - 1) or s.after != samples[i - 1].after
                or s.after != samples[i + 1].after]
        below = [0] * len(keep)
        for c, cat in enumerate(CATEGORIES):
            above = [b + samples[i].after[c] for b, i in zip(below, keep)]
            if any(s.after[c] for s in samples):
                pts = [(x(i), y(a)) for i, a in zip(keep, above)] + [(x(i), y(b)) for i, b in
                                                                      reversed(list(zip(keep, below)))]
                out.append(f'<polygon points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in pts)}" '
                           f'fill="{_MEMORY_COLOURS[cat]}" fill-opacity="0.85"><title>{cat}</title></polygon>')
            below = above
        line = " ".join(f"{x(i):.1f},{y(s.peak):.1f}" for i, s in enumerate(samples)
                        if i in (0, len(samples) - 1) or s.peak != samples[i - 1].peak or s.peak != samples[i + 1].peak)
        out.append(f'<polyline points="{line}" fill="none" stroke="#222" stroke-width="0.8"/>')
        px, py = x(rank.peak_op), y(rank.peak_dynamic_bytes)
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="#d00"><title>peak '
                   f'{rank.peak_dynamic_bytes / 2**20:.3f} MiB during op {rank.peak_op}: {escape(rank.peak_at)}'
                   f'</title></circle>')
        out.append(f'<text x="{left + width}" y="{y0 + 14}" font-size="10" text-anchor="end" fill="#444" '
                   f'{_FONT}>op index ({len(rank.samples)} ops)</text>')
    lx, ly = left, total_h - 22
    for cat in (*CATEGORIES, "peak while an op runs"):
        colour = _MEMORY_COLOURS.get(cat, "#222")
        out.append(f'<rect x="{lx}" y="{ly}" width="16" height="{14 if cat in _MEMORY_COLOURS else 2}" '
                   f'fill="{colour}"/>')
        out.append(f'<text x="{lx + 21}" y="{ly + 11}" font-size="12" {_FONT}>{escape(cat)}</text>')
        lx += 34 + 7 * len(cat)
    out.append("</svg>")
    return "\n".join(out) + "\n"
