"""The table of current headline figures, built from the results files themselves.

    python benchmarks/figures.py            # rewrite the table in README.md and docs/performance.md
    python benchmarks/figures.py --check    # exit 1 when a checked-in table differs (the suite runs this)

``benchmarks/figures.json`` lists each figure: its words, the results file (in ``benchmarks/results/``),
the path to the value inside it (keys joined by ``/``; ``key[field=value,...]`` picks the element of
a list whose fields match) and its format. Machine and date come from the file's own ``machine`` and
``date``. The table goes between the ``<!-- figures -->`` and ``<!-- /figures -->`` lines of each page.

A page may also hold serving sweeps (``benchmarks/bench_serving.py sweep``): between a
``<!-- serving: <results file> -->`` line and the next ``<!-- /serving -->``, a table of every stack,
input length and rate of that file (TTFT, TPOT and ITL p50 / p99, output tokens/s, goodput), a
two-GPU sweep's goodput at its SLOs, the share of the ITL tail at the client and in vLLM's engines
where the points have both, and its plot (the file's ``.png``), rebuilt from the file as the figures are.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGES = (REPO / "README.md", REPO / "docs" / "performance.md")
BEGIN, END = "<!-- figures -->", "<!-- /figures -->"
STEP = re.compile(r"^([^\[]+)(?:\[(.+)\])?$")
SERVING = re.compile(r"(<!-- serving: (\S+) -->\n)(.*?)(<!-- /serving -->)", re.S)


def lookup(document, path: str):
    """The value at ``path`` in a results document (see the module docstring)."""
    value = document
    for step in _steps(path):
        key, where = STEP.match(step).groups()
        value = value[key]
        if where is not None:
            wanted = dict(part.split("=", 1) for part in where.split(","))
            matches = [item for item in value if all(str(item.get(k)) == v for k, v in wanted.items())]
            if len(matches) != 1:
                raise KeyError(f"{step}: {len(matches)} elements match")
            value = matches[0]
    return value


def _steps(path: str) -> list[str]:
    """``path`` split at the ``/`` outside brackets (a selector's value may hold one)."""
    steps, depth, current = [], 0, ""
    for char in path:
        depth += char == "["
        depth -= char == "]"
        if char == "/" and depth == 0:
            steps.append(current)
            current = ""
        else:
            current += char
    return [*steps, current]


def machine(document) -> str:
    value = document.get("machine", "?")
    if isinstance(value, dict):
        gpus = value.get("gpus", 1)
        return f"{gpus} x {value.get('gpu', '?')}" if gpus != 1 else value.get("gpu", "?")
    return re.sub(r",\s*\d+ MiB$", "", str(value)).removeprefix("1 x ")


def table() -> str:
    rows = ["| figure | value | machine | date | file |", "|---|---|---|---|---|"]
    for entry in json.loads((REPO / "benchmarks" / "figures.json").read_text()):
        document = json.loads((RESULTS / entry["file"]).read_text())
        value = entry["format"].format(lookup(document, entry["path"]))
        link = f"[{entry['file']}](benchmarks/results/{entry['file']})"
        rows.append(f"| {entry['figure']} | {value} | {machine(document)} | {str(document.get('date', '?'))[:10]} | {link} |")
    return "\n".join(rows) + "\n"


def serving_table(name: str) -> str:
    """The table of a serving sweep's results file ``name``: a row per stack, input length and rate
    (``inf``: every prompt at once), then its plot."""
    document = json.loads((RESULTS / name).read_text())

    def inputs(run: dict) -> str:  # the input lengths a run measured where it lists them (the first runs measured all of theirs)
        return f" at {', '.join(str(n) for n in run['inputs'])} tokens in" if run.get("inputs") else ""

    ingress = ", the client at the replica's own port (no proxy)" if document.get("ingress") == "replica" else ""
    rows = [f"{machine(document)}, {str(document.get('date', '?'))[:10]}, vLLM {document.get('vllm_mode', '?')}{ingress}; SLO for goodput: TTFT <= "
            f"{document['slo']['ttft_ms']:g} ms and TPOT <= {document['slo']['tpot_ms']:g} ms ([{name}](benchmarks/results/{name})).", "",
            *([f"Stacks measured in {len(document['runs'])} runs, each starting its servers afresh: "
               + "; ".join(f"{', '.join(run['stacks'])}{inputs(run)} ({machine(run)}, {run['date']})" for run in document["runs"]) + ".", ""]
               if document.get("runs") else []),
            *(["The sweep did not finish: the points it did not reach are not in the table.", ""] if not document.get("complete") else []),
            "| stack | input tokens | rate (req/s) | done / failed | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | output tokens/s | goodput (req/s) |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for stack, by_input in document["results"].items():
        for input_len, points in by_input.items():
            for p in sorted(points, key=lambda p: p["rate"]):
                goodput = "-" if p.get("request_goodput") is None else f"{p['request_goodput']:.2f}"
                rows.append(f"| {stack} | {input_len} | {_rate(p)} | {p['completed']} / {p['failed']} | {_p50_p99(p.get('ttft'))} | {_p50_p99(p.get('tpot'))} | {_p50_p99(p.get('itl'))} "
                            f"| {p['output_throughput']:,.0f} | {goodput} |")  # fmt: skip
    rows += _goodput_lines(document) + _tail_table(document) + _ttft_table(document)
    plot = Path(name).with_suffix(".png").name
    if (RESULTS / plot).exists():
        rows += ["", f"![latency and throughput against the request rate, {name}](benchmarks/results/{plot})"]
    return "\n".join(rows) + "\n"


def _p50_p99(got: dict | None) -> str:
    """``p50 / p99`` of a point's figure, ``-`` for one it lacks."""
    got = got or {}
    return " / ".join("-" if got.get(q) is None else f"{got[q]:,.1f}" for q in ("p50", "p99"))


def _rate(point: dict) -> str:
    return "saturation" if point["rate"] == float("inf") else f"{point['rate']:g}"


def _goodput_lines(document) -> list[str]:
    """A two-GPU sweep's (``--pd``) goodput per input length: at its p99 SLOs, and vLLM's own at the best rate."""
    lines = []
    for input_len, by_stack in document.get("slo_goodput", {}).items():
        stacks = {k: v for k, v in by_stack.items() if isinstance(v, dict)}
        at_p99 = "; ".join(f"{k} {v['goodput_req_s']:.2f} req/s (ITL bound {v['itl_p99_bound_ms']:g} ms)" for k, v in stacks.items())
        counted = "; ".join(f"{k} {v['request_goodput']['req_s']:.2f} req/s at {v['request_goodput']['rate']:g}/s" for k, v in stacks.items())
        p99_ratio = f", {by_stack['ratio']:.2f}x" if "ratio" in by_stack else ""
        ratio = f", {by_stack['request_goodput_ratio']:.2f}x" if "request_goodput_ratio" in by_stack else ""
        slo = document["slo"]
        lines += ["", f"Goodput at {input_len} tokens in: at TTFT p99 <= {slo['ttft_ms']:g} ms and ITL p99 <= 2x the stack's unloaded ITL "
                      f"(its ITL p50 at the lowest rate), {at_p99}{p99_ratio}. vLLM's own goodput (each request within TTFT "
                      f"{slo['ttft_ms']:g} ms and TPOT {slo['tpot_ms']:g} ms), at the best rate: {counted}{ratio}."]  # fmt: skip
    return lines


def _ttft_table(document) -> list[str]:
    """Where the tier's TTFT tail arises (points through the tier that have the pool's and the tier's own
    records, ``bench_serving.py``'s ``pool`` and ``tier_steps``): the client's TTFT, the tier's steps and the
    pool's, p50 / p99, and the pool's queue, KV-room waits and batches (count, mean, share over 1 s)."""
    points = [(stack, input_len, p) for stack, by_input in document["results"].items() for input_len, points in by_input.items()
              for p in sorted(points, key=lambda p: p["rate"]) if "pool" in p and "tier_steps" in p]  # fmt: skip
    if not points:
        return []

    def times(got: dict) -> str:
        return "0" if not got.get("count") else f"{got['count']}, {got['mean_ms']:,.1f} ms, {100 * got['over_s'].get('1.0', 0):.0f}%"

    rows = ["", "Where the TTFT tail arises through the tier: the client's TTFT; the tier's own steps (its timeline of the point's requests: "
                "received to the pool's logits in the endpoint, of that the pool's TTFT, and from the logits to the first token sent), "
                "p50 / p99 in ms; the pool's queue, its waits for KV room and its batches (count, mean, share over 1 s).", "",
            "| stack | input tokens | rate (req/s) | client TTFT | received to prefilled | pool TTFT | prefilled to first token sent | queue | KV-room waits | batches |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for stack, input_len, p in points:
        steps, pool = p["tier_steps"], p["pool"]
        rows.append(f"| {stack} | {input_len} | {_rate(p)} | {_p50_p99(p.get('ttft'))} | {_p50_p99(steps.get('received_to_prefilled'))} "
                    f"| {_p50_p99(steps.get('pool_ttft'))} | {_p50_p99(steps.get('prefilled_to_first_token_sent'))} | {times(pool['queue'])} | {times(pool['kv_wait'])} | {times(pool['batch'])} |")  # fmt: skip
    return rows


def _tail_table(document) -> list[str]:
    """Where the points' ITL tails arise: the share of the intervals over 10 / 25 / 50 ms at the client
    and in vLLM's engines (points that have both); where the points have them, also the client's
    without each request's first interval and that interval's p50 / p99."""
    points = [(stack, input_len, p) for stack, by_input in document["results"].items() for input_len, points in by_input.items()
              for p in sorted(points, key=lambda p: p["rate"]) if "itl_over_ms" in p and p.get("engine_itl", {}).get("over_ms")]  # fmt: skip
    if not points:
        return []
    apart = any("first_itl" in p for _, _, p in points)

    def shares(got: dict | None) -> str:
        return "-" if got is None else " / ".join(f"{100 * got[ms]:.2f}" for ms in ("10", "25", "50"))

    rows = []
    for stack, input_len, p in points:
        cells = [stack, input_len, _rate(p), shares(p["itl_over_ms"])]
        if apart:
            first = p.get("first_itl")
            cells += [shares(p.get("itl_over_ms_later")), "-" if first is None else _p50_p99(first)]
        rows.append("| " + " | ".join(str(c) for c in [*cells, shares(p["engine_itl"]["over_ms"])]) + " |")
    head = ["stack", "input tokens", "rate (req/s)", "client, % over 10 / 25 / 50 ms"]
    if apart:
        head += ["client without each request's first interval, %", "first interval p50 / p99 (ms)"]
    head.append("vLLM's engines, % over 10 / 25 / 50 ms")
    return ["", "Where the ITL tail arises: the share of the intervals over 10 / 25 / 50 ms, as the client saw them and as vLLM's engines "
                "recorded them (their Prometheus histogram, before vLLM's API server and any relay)"
                + (". Through the tier a request's first interval is the handoff (its first token from the pool, the second from vLLM after "
                   "the KV load), which vLLM's histogram does not hold: the client's shares without it are the ones to set beside the engines'."
                   if apart else "."), "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]  # fmt: skip


def rendered(page: Path, text: str) -> str:
    """``text`` with its figures table and serving tables replaced by the current ones (links
    relative to ``page``)."""

    def linked(body: str) -> str:
        return body if page.parent == REPO else body.replace("](benchmarks/", "](../benchmarks/")

    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    text = text[:start] + "\n" + linked(table()) + text[end:]
    return SERVING.sub(lambda m: m.group(1) + linked(serving_table(m.group(2))) + m.group(4), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming the pages whose table is stale")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = rendered(page, text)
        if new != text:
            stale.append(str(page.relative_to(REPO)))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"stale figures table in {', '.join(stale)}: run python benchmarks/figures.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
