"""Reports of one run: JSON (everything), a Markdown table, PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .harness import Results

log = logging.getLogger("rocketstore.bench")

DOC_START = "<!-- bench:start -->"
DOC_END = "<!-- bench:end -->"


def fmt_value(v: float | None, unit: str | None = None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        s = f"{v:,.0f}"
    elif abs(v) >= 10:
        s = f"{v:,.1f}"
    else:
        s = f"{v:.3g}"
    return f"{s} {unit}" if unit else s


def fmt_ratio(r: float | None, ceiling: bool = False) -> str:
    """A ratio as "1.23x"; an absolute ceiling (``ceiling``: memory) as its MB figure."""
    if r is None:
        return "-"
    return f"{r:,.0f} MB" if ceiling else (f"{r:.2f}x" if r < 10 else f"{r:.1f}x")


def build_json(res: Results, meta: dict[str, Any], targets: list[dict[str, Any]]) -> dict[str, Any]:
    ms = []
    for m in res.items.values():
        d = m.to_json()
        d["ratio_to_ref"] = res.ratio(m)
        ms.append(d)
    return {"schema": "rocketstore-bench/1", "meta": meta, "targets": targets, "measurements": ms,
            "notes": res.notes, "series": res.series, "profiles": res.profiles}


def machine_line(meta: dict[str, Any]) -> str:
    fs = meta.get("workdir_fs") or {}
    return (f"`{meta.get('uname', '')}`; {meta.get('nproc')} cores ({meta.get('cpu') or 'unknown CPU'}), "
            f"{meta.get('memory_gib')} GiB memory; Python {meta.get('python')}, SQLite {meta.get('sqlite')}; "
            f"work directory on {fs.get('type') or '?'} ({fs.get('device') or '?'})")


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| workload | target | rocketstore | reference | ratio | result |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for t in targets:
        if t["met"] is None:
            result = "not measured"
        else:
            result = "met" if t["met"] else "**missed**"
        ref = fmt_value(t["ref_value"], t["ref_unit"]) if t["ref"] else \
            (fmt_value(t["threshold"], t["unit"]) + " (target)" if t.get("floor") else "-")
        lines.append(f"| {t['workload']} | {t['target']} | {fmt_value(t['value'], t['unit'])} | {ref} | "
                     f"{fmt_ratio(t['ratio'], t['ceiling'] and not t['ref'])} | {result} |")
    return lines


def figures_table(res: Results) -> list[str]:
    lines = ["| id | what | value | body MB/s | shown against | ratio |", "| --- | --- | ---: | ---: | --- | ---: |"]
    for m in res.items.values():
        if m.status != "ok":
            lines.append(f"| `{m.id}` | {m.label} | {m.status}: {m.note or ''} | | | |")
            continue
        mb = m.mb_per_s
        r = res.ratio(m)
        lines.append(f"| `{m.id}` | {m.label} | {fmt_value(m.value, m.unit)} | {fmt_value(mb) if mb else ''} | "
                     f"{'`' + m.ref + '`' if m.ref else ''} | {fmt_ratio(r) if r is not None else ''} |")
    return lines


def latency_table(res: Results) -> list[str]:
    """p50/p99/p999 of every figure that recorded per-operation latencies (sync puts, the disk's fdatasync)."""
    rows = [m for m in res.items.values() if m.status == "ok" and "p50_us" in m.extra]
    if not rows:
        return []
    lines = ["| id | what | p50 | p99 | p999 | samples |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for m in rows:
        e = m.extra
        lines.append(f"| `{m.id}` | {m.label} | {fmt_value(e['p50_us'], 'µs')} | {fmt_value(e['p99_us'], 'µs')} | "
                     f"{fmt_value(e['p999_us'], 'µs')} | {e.get('latency_samples', '')} |")
    return lines


def build_markdown(res: Results, meta: dict[str, Any], targets: list[dict[str, Any]], plots: list[str]) -> str:
    met = sum(1 for t in targets if t["met"])
    missed = sum(1 for t in targets if t["met"] is False)
    unmeasured = sum(1 for t in targets if t["met"] is None)
    out = [f"# rocketstore benchmarks: {meta['date']}, {meta['host']} ({meta['mode']} mode)", "",
           f"Machine: {machine_line(meta)}.", "",
           f"Run took {meta['duration_s']:.0f} s (git {meta.get('git_commit') or '?'}"
           f"{' with uncommitted changes' if meta.get('git_dirty_files') else ''}). "
           f"Targets: {met} met, {missed} missed, {unmeasured} not measured. "
           "Every ratio divides two figures taken in this run; absolute figures vary 20-40 % between runs "
           "and several-fold between machines of the same kind.", "",
           "## Targets (1 KiB bodies unless noted)", "", *targets_table(targets), "",
           "## Every figure", "", *figures_table(res), ""]
    lat = latency_table(res)
    if lat:
        out += ["## Latency (each put's own time; the disk's fdatasync alone, same run)", "", *lat, ""]
    if res.notes:
        out += ["## Notes", "", *[f"- {n}" for n in res.notes], ""]
    if res.profiles:
        out += ["## Profiles of missed targets", ""]
        for k, path in res.profiles.items():
            out.append(f"- {k}: `{os.path.basename(path)}`")
        out.append("")
    if plots:
        out += ["## Plots", "", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots], ""]
    return "\n".join(out)


def doc_block(meta: dict[str, Any], targets: list[dict[str, Any]], stem: str, notes: list[str] | None = None) -> str:
    """The table that docs/bench.md and README.md show between the bench markers."""
    met = sum(1 for t in targets if t["met"])
    missed = sum(1 for t in targets if t["met"] is False)
    lines = [DOC_START,
             f"Latest full run: **{meta['date']}** on `{meta['host']}`: {machine_line(meta)}. "
             f"{met} targets met, {missed} missed. Every figure and plot: `bench/results/{stem}.md`.", "",
             *targets_table(targets)]
    if notes:
        lines += ["", *[f"Note: {n}" for n in notes]]
    return "\n".join(lines + [DOC_END])


def update_doc(path: str, block: str) -> bool:
    """Replace the text between the bench markers of ``path``; False if the file or markers are missing."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return False
    a, b = text.find(DOC_START), text.find(DOC_END)
    if a < 0 or b < a:
        return False
    new = text[:a] + block + text[b + len(DOC_END):]
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return True


# ---------------------------------------------------------------- plots

def make_plots(res: Results, targets: list[dict[str, Any]], out_dir: str, stem: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[str] = []

    def save(fig, name: str) -> None:
        p = os.path.join(out_dir, f"{stem}-{name}.png")
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)

    # 1. Targets: how far each ratio is from its target (1.0 = exactly on target).
    fig, ax = plt.subplots(figsize=(7, 0.36 * len(targets) + 1.2))
    labels, values, colors = [], [], []
    for t in reversed(targets):
        labels.append(f"{t['workload']}: {t['target']}")
        if t["ratio"] is None:
            values.append(0.0)
            colors.append("#bbbbbb")
            continue
        score = (t["threshold"] / t["ratio"] if t["ratio"] else 0.0) if t["ceiling"] else \
            t["ratio"] if t.get("floor") else t["ratio"] / t["threshold"]
        values.append(score)
        colors.append("#2e8b57" if t["met"] else "#c0392b")
    ax.barh(range(len(values)), values, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ratio / target (>= 1 met; log scale; grey = not measured)")
    ax.set_title("Targets, each a ratio taken in this run")
    save(fig, "targets")

    # 2. Put throughput by body size: single, batched, the bare-append floor.
    sizes = sorted({m.params.get("body_size") for m in res.items.values()
                    if m.id.startswith(("rs.put.async.t1.", "rs.batch32.async.t1.")) and m.value})
    if sizes:
        series = [("put, async", "rs.put.async.t1.{}"), ("put_batch(32), async", "rs.batch32.async.t1.{}"),
                  ("bare-append floor", "floor.append.{}")]
        fig, ax = plt.subplots(figsize=(7, 4))
        w = 0.8 / len(series)
        for i, (name, pat) in enumerate(series):
            ys = [res.value(pat.format(s)) or 0 for s in sizes]
            ax.bar([x + i * w for x in range(len(sizes))], ys, w, label=name)
        ax.set_xticks([x + w for x in range(len(sizes))])
        ax.set_xticklabels([f"{s} B" for s in sizes])
        ax.set_ylabel("messages/s")
        ax.set_title("Put throughput by body size (1 thread)")
        ax.legend()
        save(fig, "put")

    # 3. Peers at 1 KiB: put and consume.
    put_ids = [("rocketstore put", "rs.put.async.t1.1024"), ("rocketstore put_batch(32)", "rs.batch32.async.t1.1024"),
               ("SQLite 1 txn/msg, OFF", "sqlite.txn.off"), ("SQLite 1 txn/msg, NORMAL", "sqlite.txn.normal"),
               ("SQLite 32/txn, OFF", "sqlite.batch32.off"), ("persist-queue", "persist-queue.put"),
               ("diskcache Deque", "diskcache.put"), ("litequeue", "litequeue.put"),
               ("Redis XADD (pipelined)", "redis.put"),
               ("bare-append floor", "floor.append.1024")]
    get_ids = [("rocketstore get(32)", "rs.consume32"), ("SQLite rowid range (32)", "sqlite.consume32"),
               ("persist-queue", "persist-queue.consume"), ("diskcache Deque", "diskcache.consume"),
               ("litequeue", "litequeue.consume"), ("Redis XRANGE (32)", "redis.consume"),
               ("bare-read floor", "floor.read.1024")]
    if any(res.value(i) for _, i in put_ids + get_ids):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, ids, title in ((axes[0], put_ids, "Put, 1 KiB, 1 thread"), (axes[1], get_ids, "Consume, 1 KiB")):
            pairs = [(n, res.value(i)) for n, i in ids if res.value(i)]
            ax.barh([p[0] for p in pairs][::-1], [p[1] for p in pairs][::-1],
                    color=["#1f77b4" if n.startswith("rocketstore") else "#888888" if "floor" in n else "#ff7f0e"
                           for n, _ in pairs][::-1])
            ax.set_xscale("log")
            ax.set_xlabel("messages/s (log)")
            ax.set_title(title)
        save(fig, "peers")

    # 4. Producer threads: async and sync flush.
    threads = sorted({m.params.get("threads") for m in res.items.values()
                      if m.id.startswith("rs.put.") and m.id.endswith(".1024") and m.value})
    if threads:
        fig, ax = plt.subplots(figsize=(6, 4))
        for fl in ("async", "sync"):
            xs = [t for t in threads if res.value(f"rs.put.{fl}.t{t}.1024")]
            if xs:
                ax.plot(xs, [res.value(f"rs.put.{fl}.t{t}.1024") for t in xs], marker="o", label=f"{fl} flush")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(threads)
        ax.set_xticklabels([str(t) for t in threads])
        ax.set_xlabel("producer threads")
        ax.set_ylabel("messages/s (log)")
        ax.set_title("put, 1 KiB, by producer threads")
        ax.legend()
        save(fig, "threads")

    # 5. Memory while writing.
    mem = res.series.get("memory")
    if mem and mem.get("t"):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(mem["t"], mem["anon_mb"], label="private (anonymous) RSS")
        ax.plot(mem["t"], mem["file_mb"], label="file-backed RSS (page cache of the maps)", alpha=0.6)
        ax.axhline(300, color="#c0392b", linestyle="--", linewidth=1, label="target: 300 MB private")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MB")
        ax.set_title("Memory of a writer process")
        ax.legend()
        save(fig, "memory")
    return paths


def write_reports(res: Results, meta: dict[str, Any], targets: list[dict[str, Any]], out_dir: str,
                  stem: str) -> dict[str, Any]:
    os.makedirs(out_dir, exist_ok=True)
    plots: list[str] = []
    try:
        plots = make_plots(res, targets, out_dir, stem)
    except ImportError as e:
        res.note(f"no plots: matplotlib is not installed ({e})")
    doc = build_json(res, meta, targets)
    doc["plots"] = [os.path.basename(p) for p in plots]
    jpath = os.path.join(out_dir, f"{stem}.json")
    with open(jpath, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, default=str)
        fh.write("\n")
    mpath = os.path.join(out_dir, f"{stem}.md")
    with open(mpath, "w", encoding="utf-8") as fh:
        fh.write(build_markdown(res, meta, targets, plots))
    return {"json": jpath, "markdown": mpath, "plots": plots}
