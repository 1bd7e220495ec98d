#!/usr/bin/env python3
"""Tables and SVG plots of docs/accuracy.md from `kvq ppl --json` and `kvq qview --csv` files.

Pure Python 3 (no numpy). Every number it prints comes from the files it is given; it computes
only means, paired differences and Student-t 95 % intervals over windows.

  python3 tools/accuracy_report.py headline --json A.json [--json B.json] [--name A --name B]
  python3 tools/accuracy_report.py pairs --json A.json PAIR...      # PAIR = worse:better
  python3 tools/accuracy_report.py position --json A.json --svg out.svg --title T [--bin 64]
  python3 tools/accuracy_report.py sweep --json run1.json ... [--base A.json --windows 0-3]
  python3 tools/accuracy_report.py windows --json A.json --csv out.csv   # per-window sums
  python3 tools/accuracy_report.py qview --csv view.csv [--metrics ...]  # per-layer table
  python3 tools/accuracy_report.py qplot --csv view.csv --metric tr_ek --svg out.svg ...
  python3 tools/accuracy_report.py energy --csv A.csv --name A --csv B.csv --name B --svg e.svg
"""
import argparse
import csv
import json
import math
import sys

# Two-sided 95 % Student-t quantiles (P(|T| <= t) = 0.95) for the degrees of freedom used here.
T95 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 5: 2.5706, 7: 2.3646, 11: 2.2010, 15: 2.1314,
       23: 2.0687, 31: 2.0395, 47: 2.0117}


def t95(df):
    if df in T95:
        return T95[df]
    # Cornish-Fisher expansion of the t quantile around the normal one (enough for df > 30).
    z = 1.959964
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    return z + g1 / df + g2 / df ** 2


def load(path):
    with open(path) as f:
        return json.load(f)


def row(set_, label):
    for r in set_["rows"]:
        if r["label"] == label:
            return r
    return None


def window_kl(r, tail=True, windows=None):
    ws = r["per_window"]
    idx = range(len(ws)) if windows is None else windows
    key = "tail" if tail else "all"
    return [ws[i][key]["kl"] / ws[i][key]["count"] for i in idx]


def paired(a, b):
    """mean of a - b, 95 % t interval, count of windows with a < b."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    m = sum(d) / n
    if n < 2:
        return m, float("nan"), float("nan"), sum(1 for x in d if x < 0), n
    s = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    h = t95(n - 1) * s / math.sqrt(n)
    return m, m - h, m + h, sum(1 for x in d if x < 0), n


def ppl(r, windows=None, tail=False):
    ws = r["per_window"]
    idx = range(len(ws)) if windows is None else windows
    key = "tail" if tail else "all"
    nll = sum(ws[i][key]["nll"] for i in idx)
    cnt = sum(ws[i][key]["count"] for i in idx)
    return math.exp(nll / cnt)


def kl(r, windows=None, tail=True):
    ws = r["per_window"]
    idx = range(len(ws)) if windows is None else windows
    key = "tail" if tail else "all"
    return sum(ws[i][key]["kl"] for i in idx) / sum(ws[i][key]["count"] for i in idx)


def top1(r, windows=None, tail=True):
    ws = r["per_window"]
    idx = range(len(ws)) if windows is None else windows
    key = "tail" if tail else "all"
    return sum(ws[i][key]["top1"] for i in idx) / sum(ws[i][key]["count"] for i in idx)


def fmt_ci(m, lo, hi, won, n):
    return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({won}/{n})"


def ref_label(set_):
    return set_["rows"][0]["label"]


def cmd_headline(args):
    for path, name in zip(args.json, args.name or args.json):
        j = load(path)
        sets = j["sets"]
        print(f"### {name}: {', '.join(s['name'] + ' ' + str(len(s['windows'])) for s in sets)} "
              f"windows x {sets[0]['length']} tokens, S0={j['options']['sink']} "
              f"W={j['options']['recent']} G={j['options']['group']} b={j['options']['bits']}\n")
        head = "| scheme | bits/elem |"
        sep = "|---|---|"
        for s in sets:
            d = s["name"].replace("heldout_", "")
            head += f" PPL {d} (Δ%) | KL {d} |" + (f" top-1 {d} |" if args.top1 else "")
            head += f" ΔKL vs OSCAR {d} [95% CI] (won) |"
            sep += "---|---|---|" + ("---|" if args.top1 else "")
        head += " ΔKL vs OSCAR pooled [95% CI] (won) |"
        sep += "---|"
        print(head)
        print(sep)
        labels = [r["label"] for r in sets[0]["rows"]]
        for lab in labels:
            line = f"| {'**oscar**' if lab == 'oscar' else lab} |"
            r0 = row(sets[0], lab)
            line += f" {r0['bits_per_element']:.2f} |"
            pool_a, pool_b = [], []
            for s in sets:
                r = row(s, lab)
                ref = s["rows"][0]
                o = row(s, "oscar")
                p = ppl(r)
                line += f" {p:.4f} ({100 * (p / ppl(ref) - 1):+.2f}) | {kl(r):.4f} |"
                line += f" {top1(r):.3f} |" if args.top1 else ""
                if o is not None and lab != "oscar":
                    a, b = window_kl(r), window_kl(o)
                    pool_a += a
                    pool_b += b
                    line += f" {fmt_ci(*paired(a, b))} |"
                else:
                    line += " — |"
            line += f" {fmt_ci(*paired(pool_a, pool_b))} |" if pool_a else " — |"
            print(line)
        print()


def cmd_pairs(args):
    for path, name in zip(args.json, args.name or args.json):
        j = load(path)
        sets = j["sets"]
        print(f"### {name}\n")
        head = "| comparison (ΔKL = KL(first) − KL(second)) |"
        sep = "|---|"
        for s in sets:
            head += f" {s['name'].replace('heldout_', '')} [95% CI] (second lower in) |"
            sep += "---|"
        head += " pooled |"
        sep += "---|"
        print(head)
        print(sep)
        for pair in args.pair:
            label, spec = (pair.split("=", 1) + [None])[:2] if "=" in pair else (pair, pair)
            first, second = spec.split(":")
            line = f"| {label}: {first} − {second} |"
            pa, pb = [], []
            for s in sets:
                ra, rb = row(s, first), row(s, second)
                a, b = window_kl(ra), window_kl(rb)
                pa += a
                pb += b
                m, lo, hi, won, n = paired(a, b)
                line += f" {m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({n - won}/{n}) |"
            m, lo, hi, won, n = paired(pa, pb)
            line += f" {m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({n - won}/{n}) |"
            print(line)
        print()


# ---- SVG ------------------------------------------------------------------------------------
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#aec7e8"]


def svg_lines(title, xlabel, ylabel, xs, series, logy=True, width=640, height=400,
              xticks=None):
    """series: [(name, [y or None per x])]. A small standalone SVG."""
    left, right, top, bottom = 62, 150, 30, 44
    pw, ph = width - left - right, height - top - bottom
    ys = [y for _, s in series for y in s if y is not None and (y > 0 or not logy)]
    if not ys:
        raise SystemExit(f"nothing to plot for {title}")
    f = (lambda v: math.log10(v)) if logy else (lambda v: v)
    lo, hi = f(min(ys)), f(max(ys))
    if logy:
        lo, hi = math.floor(lo), math.ceil(hi)
    if hi == lo:
        hi = lo + 1
    else:
        pad = 0 if logy else 0.05 * (hi - lo)
        lo, hi = lo - pad, hi + pad
    x0, x1 = min(xs), max(xs)
    if xticks is not None:
        x0, x1 = min([x0] + list(xticks)), max([x1] + list(xticks))
    if x1 == x0:
        x1 = x0 + 1

    def px(x):
        return left + (x - x0) / (x1 - x0) * pw

    def py(y):
        return top + (1 - (f(y) - lo) / (hi - lo)) * ph

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'font-family="sans-serif" font-size="11">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-size="12">{title}</text>',
         f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    if logy:
        for e in range(int(lo), int(hi) + 1):
            y = top + (1 - (e - lo) / (hi - lo)) * ph
            o.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#ddd"/>')
            o.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    else:
        for k in range(6):
            v = lo + (hi - lo) * k / 5
            y = top + (1 - k / 5) * ph
            o.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#ddd"/>')
            o.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for x in (xticks if xticks is not None else xs):
        o.append(f'<text x="{px(x):.1f}" y="{top + ph + 14}" text-anchor="middle">{x:g}</text>')
    o.append(f'<text x="{left + pw / 2:.0f}" y="{height - 8}" text-anchor="middle">{xlabel}'
             f'</text>')
    o.append(f'<text x="14" y="{top + ph / 2:.0f}" text-anchor="middle" '
             f'transform="rotate(-90 14 {top + ph / 2:.0f})">{ylabel}</text>')
    for i, (name, s) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        pts = [(px(x), py(y)) for x, y in zip(xs, s) if y is not None and (y > 0 or not logy)]
        o.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' %
                 (c, " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)))
        for a, b in pts if len(pts) <= 16 else []:
            o.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{c}"/>')
        ly = top + 12 + 15 * i
        o.append(f'<line x1="{left + pw + 8}" x2="{left + pw + 24}" y1="{ly - 4}" y2="{ly - 4}" '
                 f'stroke="{c}" stroke-width="2"/>')
        o.append(f'<text x="{left + pw + 28}" y="{ly}">{name}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


def cmd_position(args):
    j = load(args.json[0])
    labels = args.labels.split(",")
    sets = j["sets"]
    length = sets[0]["length"]
    nbins = (length - 1 + args.bin - 1) // args.bin
    xs = [b * args.bin + args.bin / 2 for b in range(nbins)]
    series = []
    table = {}
    for lab in labels:
        sums = [0.0] * nbins
        cnts = [0] * nbins
        for s in sets:
            r = row(s, lab)
            for w in r["per_window"]:
                for p, v in enumerate(w["kl"]):
                    sums[p // args.bin] += v
                    cnts[p // args.bin] += 1
        ys = [sm / c if c and sm > 0 else None for sm, c in zip(sums, cnts)]
        series.append((lab, ys))
        table[lab] = ys
    with open(args.svg, "w") as f:
        f.write(svg_lines(args.title, f"context position (bins of {args.bin} tokens)",
                          "KL(bf16 || scheme), nats", xs, series,
                          xticks=list(range(0, length + 1, 256))))
    # A text table: a few bins.
    picks = [b for b in range(nbins) if (b * args.bin) in (0, 256, 320, 512, 1024, 1536, 1984)]
    print("| scheme | " + " | ".join(f"{b * args.bin}–{(b + 1) * args.bin - 1}" for b in picks)
          + " |")
    print("|---|" + "---|" * len(picks))
    for lab in labels:
        print(f"| {lab} | " + " | ".join(
            "0" if table[lab][b] is None else f"{table[lab][b]:.4f}" for b in picks) + " |")


def parse_range(text):
    a, b = text.split("-")
    return list(range(int(a), int(b) + 1))


def cmd_sweep(args):
    print("| run | S0 | W | G | scheme | bits/elem | PPL en (Δ%) | PPL code (Δ%) | KL all en | "
          "KL all code | ΔKL all vs oscar pooled [95% CI] (won) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    runs = [(p, None) for p in args.json]
    if args.base:
        runs = [(args.base, parse_range(args.windows))] + runs
    for path, windows in runs:
        j = load(path)
        o = j["options"]
        for lab in [r["label"] for r in j["sets"][0]["rows"]]:
            if args.labels and lab not in args.labels.split(",") and not lab.startswith("bf16"):
                continue
            line = (f"| {path.split('/')[-1].replace('.json', '')} | {o['sink']} | "
                    f"{o['recent']} | {o['group']} | {lab} |")
            r0 = row(j["sets"][0], lab)
            line += f" {r0['bits_per_element']:.2f} |"
            kls = []
            pa, pb = [], []
            for s in j["sets"]:
                r, ref, osc = row(s, lab), s["rows"][0], row(s, "oscar")
                p = ppl(r, windows)
                line += f" {p:.4f} ({100 * (p / ppl(ref, windows) - 1):+.2f}) |"
                kls.append(kl(r, windows, tail=False))
                if osc is not None and lab != "oscar" and not lab.startswith("bf16"):
                    pa += window_kl(r, False, windows)
                    pb += window_kl(osc, False, windows)
            line += "".join(f" {k:.4f} |" for k in kls)
            line += f" {fmt_ci(*paired(pa, pb))} |" if pa else " — |"
            print(line)


def cmd_windows(args):
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "set", "window", "label", "bits_per_element", "count_all", "nll_all",
                    "kl_all", "top1_all", "count_tail", "nll_tail", "kl_tail", "top1_tail"])
        for path, name in zip(args.json, args.name or args.json):
            j = load(path)
            for s in j["sets"]:
                for r in s["rows"]:
                    for win, pw in zip(s["windows"], r["per_window"]):
                        a, t = pw["all"], pw["tail"]
                        w.writerow([name, s["name"], win, r["label"],
                                    f"{r['bits_per_element']:.4f}", a["count"],
                                    f"{a['nll']:.6f}", f"{a['kl']:.6g}", a["top1"], t["count"],
                                    f"{t['nll']:.6f}", f"{t['kl']:.6g}", t["top1"]])


def read_qview(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def cmd_qview(args):
    rows = read_qview(args.csv)
    labels = []
    for r in rows:
        if r["label"] not in labels:
            labels.append(r["label"])
    metrics = args.metrics.split(",")
    print("| rotation (clip) | ρ_K (mean) | " + " | ".join(metrics) + " |")
    print("|---|---|" + "---|" * len(metrics))
    for lab in labels:
        rs = [r for r in rows if r["label"] == lab]
        clip = sum(float(r["clip_k"]) for r in rs) / len(rs)
        vals = [sum(float(r[m]) for r in rs) / len(rs) for m in metrics]
        print(f"| {lab} | {clip:.3f} | " + " | ".join(f"{v:.4g}" for v in vals) + " |")
    if args.per_layer:
        print()
        for m in args.per_layer.split(","):
            layers = sorted({int(r["layer"]) for r in rows})
            print(f"{m} per layer (KV head 0):\n")
            print("| rotation | " + " | ".join(f"L{l}" for l in layers) + " |")
            print("|---|" + "---|" * len(layers))
            for lab in labels:
                vals = {int(r["layer"]): float(r[m]) for r in rows
                        if r["label"] == lab and r["kv_head"] == "0"}
                print(f"| {lab} | " + " | ".join(f"{vals[l]:.3g}" for l in layers) + " |")
            print()


def cmd_qplot(args):
    rows = read_qview(args.csv)
    labels = args.labels.split(",")
    layers = sorted({int(r["layer"]) for r in rows})
    heads = sorted({int(r["kv_head"]) for r in rows})
    series = []
    for lab in labels:
        for h in heads:
            vals = {int(r["layer"]): float(r[args.metric]) for r in rows
                    if r["label"] == lab and int(r["kv_head"]) == h}
            name = lab if len(heads) == 1 else f"{lab} h{h}"
            series.append((name, [vals.get(l) for l in layers]))
    with open(args.svg, "w") as f:
        f.write(svg_lines(args.title, "layer", args.metric, layers, series, logy=not args.linear))


def cmd_energy(args):
    """Key mean energy per layer (scheme-free) from several qview CSVs, one curve each."""
    series, layers_all = [], set()
    data = []
    for path, name in zip(args.csv, args.name):
        rows = [r for r in read_qview(path) if r["label"] == read_qview(path)[0]["label"]]
        per = {}
        for r in rows:
            per.setdefault(int(r["layer"]), []).append(float(r["mean_energy"]))
        data.append((name, {l: sum(v) / len(v) for l, v in per.items()}))
        layers_all |= set(per)
    layers = sorted(layers_all)
    for name, per in data:
        series.append((name, [per.get(l) for l in layers]))
    with open(args.svg, "w") as f:
        f.write(svg_lines(args.title, "layer", "||E k||^2 / E||k - E k||^2", layers, series))
    print("| keys | " + " | ".join(f"L{l}" for l in layers) + " |")
    print("|---|" + "---|" * len(layers))
    for name, per in data:
        print(f"| {name} | " + " | ".join(f"{per[l]:.3g}" if l in per else "" for l in layers)
              + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("headline")
    h.add_argument("--json", action="append", required=True)
    h.add_argument("--name", action="append")
    h.add_argument("--top1", action="store_true")
    pr = sub.add_parser("pairs")
    pr.add_argument("--json", action="append", required=True)
    pr.add_argument("--name", action="append")
    pr.add_argument("pair", nargs="+", help="LABEL=first:second or first:second")
    po = sub.add_parser("position")
    po.add_argument("--json", action="append", required=True)
    po.add_argument("--labels", required=True)
    po.add_argument("--svg", required=True)
    po.add_argument("--title", required=True)
    po.add_argument("--bin", type=int, default=64)
    sw = sub.add_parser("sweep")
    sw.add_argument("--json", action="append", required=True)
    sw.add_argument("--base")
    sw.add_argument("--windows", default="0-3")
    sw.add_argument("--labels", default="", help="only these rows (and the reference)")
    wi = sub.add_parser("windows")
    wi.add_argument("--json", action="append", required=True)
    wi.add_argument("--name", action="append")
    wi.add_argument("--csv", required=True)
    qv = sub.add_parser("qview")
    qv.add_argument("--csv", required=True)
    qv.add_argument("--metrics", default="max_abs,group_range,importance,tr_ek,weighted,"
                    "weighted_centred,mean_range")
    qv.add_argument("--per-layer", default="")
    qp = sub.add_parser("qplot")
    qp.add_argument("--csv", required=True)
    qp.add_argument("--metric", required=True)
    qp.add_argument("--labels", required=True)
    qp.add_argument("--svg", required=True)
    qp.add_argument("--title", required=True)
    qp.add_argument("--linear", action="store_true")
    en = sub.add_parser("energy")
    en.add_argument("--csv", action="append", required=True)
    en.add_argument("--name", action="append", required=True)
    en.add_argument("--svg", required=True)
    en.add_argument("--title", required=True)
    a = p.parse_args()
    {"headline": cmd_headline, "pairs": cmd_pairs, "position": cmd_position,
     "sweep": cmd_sweep, "windows": cmd_windows, "qview": cmd_qview, "qplot": cmd_qplot,
     "energy": cmd_energy}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
