"""Predicted Kimi K2.6 tokens/s on 8 GPUs (TP8) from the measured one-GPU shard step + modelled collectives.

A **prediction**, not a measurement (issue #26, item 4): the 8-GPU kind is not lent. Inputs:

1. The TP8 shard's fused decode step measured on one H200 (`experiments/tp_shard_step.py` JSON: rows with
   B, context, method, budget, attn_impl, loop_step_ms (the step in the on-device loop, as `generate` runs it;
   older JSONs: step_ms, called from the host), collectives_ms = the real 8-GPU step's all-reduces and
   gathers priced by `analysis.roofline.step_cost(layout="tp8")`). Predicted TP8 step = the measured step +
   collectives_ms (what one GPU computes plus what the other seven add by communication, no overlap).
   Where a (B, context, method, budget) was measured more than once, the fastest attention column is used.
2. Acceptance, tokens per step (the bonus token included): the chain's tau from the public
   Kimi-K2.5-DFlash numbers at block 8 (3.7-5.5: `--chain-taus`), and DDTree's as the chain's times the
   embedded pair's measured DDTree / chain tokens-per-step ratio at the same budget and temperature
   (`bench_e2e` JSONs: tokens over decode steps, all 16 prompts pooled; each budget against the chain of its
   own file; several files of one temperature combine, the first listed giving a budget they share), capped at `--max-tau` (8: a block-8
   drafter proposes 7 tokens, + the bonus). That the ratio transfers from the embedded pair (block 16) to
   K2.6's block-8 drafter is an assumption; the ratio is printed with its source.

Per (B, context, temperature, chain tau) and column: predicted step ms, tokens/s of the batch
(B x tau / step), speedup over AR at the same B and context, and the break-even tau (step / AR step: the
tokens per step a method needs to match AR).

  python -m experiments.k26_prediction --shard benchmarks/results_archive/k26_tp8_shard_003b11c.json \\
      --e2e benchmarks/results_archive/e2e_embedded_T0_25753af.json,benchmarks/results_archive/e2e_embedded_T1_25753af.json

Writes k26_prediction.json (and a plot with --plot) under --out; prints one markdown table per temperature.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

PUBLIC_CHAIN_TAUS = (3.7, 4.6, 5.5)  # Kimi-K2.5-DFlash, block 8: the published range and its middle


def tokens_per_step(e2e: dict) -> dict[tuple[str, int | None], float]:
    """(method, budget) -> decoded tokens over decode steps, pooled over the prompts of a `bench_e2e` JSON."""
    out = {}
    for row in e2e["results"]:
        prompts = row["per_prompt"]
        steps = sum(p["steps"] for p in prompts)
        if steps <= 0:
            raise ValueError(f"{row['method']} {row.get('budget')}: no decode steps in the e2e JSON")
        out[row["method"], row.get("budget")] = sum(p["num_tokens"] - 1 for p in prompts) / steps
    return out


def acceptance_ratios(e2e: dict) -> dict[int, float]:
    """budget -> DDTree's tokens per step over the chain's (the embedded pair, one temperature)."""
    tps = tokens_per_step(e2e)
    if ("chain", None) not in tps:
        raise ValueError("the e2e JSON has no chain row")
    chain = tps["chain", None]
    return {budget: value / chain for (method, budget), value in tps.items() if method == "ddtree"}


E2E_RUN_FIELDS = ("top_p", "prompts", "num_prompts", "max_new_tokens", "dtype")  # files combined must share these


def merged_ratios(e2es: list[tuple[str, dict]]) -> dict[float, tuple[dict[int, float], dict[int, str]]]:
    """temperature -> (budget -> DDTree / chain ratio, budget -> the file it came from), from several bench_e2e
    JSONs: each budget's ratio is taken against the chain of its own file (one run, one machine), so files of one
    temperature combine (e.g. a later run of budget 8 beside the main run) when they ran the same requests
    (`E2E_RUN_FIELDS` of their settings equal; else ValueError naming both files and the field). A budget in
    several files of one temperature takes the first file listed (the others' ratio for it is ignored; `main`
    prints which). A file without a chain row or decode steps: ValueError naming it."""
    out: dict[float, tuple[dict[int, float], dict[int, str]]] = {}
    first: dict[float, tuple[str, dict]] = {}
    for path, e2e in e2es:
        settings = e2e["settings"]
        temperature = settings["temperature"]
        seen_path, seen = first.setdefault(temperature, (path, settings))
        for field in E2E_RUN_FIELDS:
            if settings.get(field) != seen.get(field):
                raise ValueError(
                    f"--e2e {seen_path} and {path} (T = {temperature:g}) differ in {field} "
                    f"({seen.get(field)!r} vs {settings.get(field)!r}): their ratios do not combine"
                )
        try:
            file_ratios = acceptance_ratios(e2e)
        except ValueError as e:
            raise ValueError(f"--e2e {path}: {e}") from e
        ratios, sources = out.setdefault(temperature, ({}, {}))
        for budget, ratio in file_ratios.items():
            if budget not in ratios:
                ratios[budget], sources[budget] = ratio, path
    return out


def measured_ms(row: dict) -> float:
    """A shard row's step: in the on-device loop as `generate` runs it (`loop_step_ms`, since `28d0418`), else
    the step called from the host (`step_ms`: the runs before the loop column existed, host dispatch included)."""
    return row["loop_step_ms"] if row.get("loop_step_ms") is not None else row["step_ms"]


def drafts(row: dict) -> str:
    """A shard row's drafter proposals (`tp_shard_step --drafts`): "spread" (a random distribution a depth, as a
    trained drafter's positions have), "distinct" (rows of `1031e46`-`32e5c1a`: a one-hot boost a depth, the chain's
    tokens distinct, a tree's siblings repeated; at `a90156e` the flag's name for "spread") or "model" (the random drafter's own, which repeat one token along the chain: every row
    before the field existed, `1031e46`)."""
    return row.get("drafts", "model")


def timing(row: dict) -> str:
    """ "loop" (the on-device loop's step) or "host" (the host-called step of older JSONs)."""
    return "loop" if row.get("loop_step_ms") is not None else "host"


def shard_steps(rows: list[dict]) -> dict[tuple[int, int, str, int | None], dict]:
    """(B, context, method, budget) -> the fastest measured row (over attention columns, grouped-gather forms and
    files; each prediction row records its attn_impl and grouped_gather). The two timings are
    never compared: where any row of the given JSONs has the loop step, only loop-timed rows are used (a
    host-called step holds the host's dispatch, so it would lose to any loop row and mix commits silently)."""
    layers = {row.get("layers") for row in rows}
    if len(layers) > 1:  # a 4-layer step would beat a 61-layer one: never pick the fastest across models
        raise ValueError(f"shard rows of different depths ({sorted(layers, key=str)} layers): one model at a time")
    forms = {drafts(row) for row in rows}
    if len(forms) > 1:  # the model's own drafts read fewer experts in the chain: its step would always win
        raise ValueError(
            f"shard rows of different drafts ({sorted(forms)}): the random drafter's own drafts repeat one token "
            "along the chain and flatter its step; predict from one form at a time (tp_shard_step --drafts)"
        )
    kind = "loop" if any(timing(row) == "loop" for row in rows) else "host"
    best = {}
    for row in rows:
        if timing(row) != kind:
            continue
        key = (row["B"], row["context"], row["method"], row.get("budget"))
        if key not in best or measured_ms(row) < measured_ms(best[key]):
            best[key] = row
    return best


SHARD_MODEL_FIELDS = ("model_size", "drafter_layers")  # the file's; "tiny" from the file, "layers" the rows'


def shard_tiny(data: dict) -> bool:
    """Whether a tp_shard_step JSON ran the tiny K2: its "tiny" field, else (files before the field) its name,
    `k26_tp<n>_shard_tiny[_<tag>]`. The name's --tag is not the model: files of one model with other tags combine."""
    if "tiny" in data:
        return bool(data["tiny"])
    # (an old K2.6 file tagged "tiny_..." would read as tiny: no such file exists)
    name, tiny = str(data.get("benchmark", "")), f"k26_tp{data.get('model_size')}_shard_tiny"
    return name == tiny or name.startswith(tiny + "_")


# per-row settings that change a step's time without changing the model: a file's rows must agree, and files whose
# rows recorded them must agree with each other (rows from before a field existed did not record it: they combine)
SHARD_ROW_SETTINGS = ("router_bias", "temperature")


def shard_model(path: str, data: dict) -> dict:
    """What a tp_shard_step JSON measured (TP size, tiny or K2.6, drafter layers, and its rows' layers and drafts):
    ValueError naming the file if its rows differ in layers or drafts."""
    layers = {row.get("layers") for row in data["rows"]}
    if len(layers) > 1:
        raise ValueError(f"{path}: rows of different depths ({sorted(layers, key=str)} layers)")
    forms = {drafts(row) for row in data["rows"]}
    if len(forms) > 1:
        raise ValueError(f"{path}: rows of different drafts ({sorted(forms)})")
    return {
        **{k: data.get(k) for k in SHARD_MODEL_FIELDS},
        "tiny": shard_tiny(data),
        "layers": layers.pop() if layers else None,
        "drafts": forms.pop() if forms else None,
    }


def shard_settings(path: str, data: dict) -> dict:
    """setting -> the value a tp_shard_step JSON's rows recorded for it (`SHARD_ROW_SETTINGS`), None where none did:
    ValueError naming the file if its rows differ in one."""
    settings = {}
    for setting in SHARD_ROW_SETTINGS:
        values = {row[setting] for row in data["rows"] if setting in row}
        if len(values) > 1:
            raise ValueError(f"{path}: rows of different {setting} ({sorted(values, key=str)})")
        settings[setting] = values.pop() if values else None
    return settings


def read_json(path: str, flag: str, fields: tuple[str, ...]) -> dict:
    """The JSON object at `path`, with `fields` at its top level; else ValueError naming `flag` and the file (a
    missing or unreadable file, not JSON, or another benchmark's file, e.g. a shard JSON given as --e2e)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path!r}: {e}") from None
    missing = [field for field in fields if not isinstance(data, dict) or field not in data]
    if missing:
        raise ValueError(f"{flag} {path!r}: no {', '.join(missing)} field: not the JSON {flag} takes")
    return data


def load_shards(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(rows, sources) of tp_shard_step JSONs measured on the same model: ValueError naming both files and the
    field where two differ (the fastest row per configuration would otherwise mix models, e.g. AR from a 4-layer
    run against DDTree from the 61-layer one), or where a file is given twice."""
    check_distinct(paths, "--shard")
    rows, sources, first, recorded = [], [], None, {}
    for path in paths:
        data = read_json(path, "--shard", ("rows",))
        model = shard_model(path, data)
        if first is None:
            first = (path, model)
        for key, value in model.items():
            if value != first[1][key]:
                raise ValueError(
                    f"--shard {first[0]} and {path} differ in {key} ({first[1][key]!r} vs {value!r}): "
                    "shard files of one model only"
                )
        for setting, value in shard_settings(path, data).items():
            if value is None:
                continue
            seen_path, seen = recorded.setdefault(setting, (path, value))
            if value != seen:
                raise ValueError(
                    f"--shard {seen_path} and {path} differ in {setting} ({seen!r} vs {value!r}): "
                    "the fastest row per configuration would mix settings"
                )
        rows += data["rows"]
        sources.append({"file": path, **{k: data.get(k) for k in ("commit", "date", "device")}})
    return rows, sources


def check_distinct(paths: list[str], flag: str) -> None:
    """ValueError if a file is given twice (its rows would count twice)."""
    seen = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"{flag}: {path} given twice" + (f" (as {seen[real]})" if seen[real] != path else ""))
        seen[real] = path


def predict(shard_rows: list[dict], ratios: dict[int, float], chain_taus, max_tau: float = 8.0) -> list[dict]:
    """One row per (B, context, chain tau, measured column) with a DDTree ratio or a chain / AR column."""
    steps = shard_steps(shard_rows)
    out = []
    for (batch, context, method, budget), row in sorted(steps.items(), key=lambda kv: str(kv[0])):
        ar = steps.get((batch, context, "ar", None))
        if ar is None:
            continue  # no AR step at this (B, context): nothing to compare with
        ar_ms = measured_ms(ar) + ar["collectives_ms"]
        step_ms = measured_ms(row) + row["collectives_ms"]
        for chain_tau in chain_taus:
            if method == "ar":
                tau = 1.0
            elif method == "chain":
                tau = chain_tau
            elif budget in ratios:
                tau = min(chain_tau * ratios[budget], max_tau)
            else:
                continue  # a budget the e2e run did not measure
            out.append(
                {
                    "B": batch,
                    "context": context,
                    "method": method,
                    "budget": budget,
                    "chain_tau": chain_tau,
                    "tau": tau,
                    "acceptance_ratio": ratios.get(budget) if method == "ddtree" else None,
                    "shard_step_ms": measured_ms(row),
                    "shard_step_timing": timing(row),
                    "ar_timing": timing(ar),
                    "collectives_ms": row["collectives_ms"],
                    "predicted_step_ms": step_ms,
                    "tokens_per_s": batch * tau / step_ms * 1e3,
                    "x_ar": tau / step_ms * ar_ms,
                    "break_even_tau": step_ms / ar_ms,
                    "attn_impl": row.get("attn_impl"),
                    "grouped_gather": row.get("grouped_gather"),
                    "drafts": drafts(row),
                }
            )
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| B | context | method | budget | chain tau | tau | predicted step ms | tokens/s | x AR | break-even tau |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['context']:,} | {r['method']} | {r['budget'] or ''} | {r['chain_tau']:.1f} | "
            f"{r['tau']:.2f} | {r['predicted_step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['x_ar']:.2f} | "
            f"{r['break_even_tau']:.2f} |"
        )
    return "\n".join(lines)


def column_colours(rows: list[dict]) -> dict:
    """(method, budget or 0) -> a matplotlib colour, one per column of the B = 1 rows, the same in every panel (a
    panel lacking a budget must not shift the others' colours)."""
    columns = sorted({(r["method"], r["budget"] or 0) for r in rows if r["B"] == 1})
    return {column: f"C{i}" for i, column in enumerate(columns)}


def plot(rows: list[dict], path: str) -> None:
    """tokens/s against the chain's tau, one line per column, one panel per (temperature, context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["temperature"], r["context"]) for r in rows if r["B"] == 1})
    colours = column_colours(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (temperature, context) in zip(axes[0], panels):
        mine = [r for r in rows if r["B"] == 1 and r["temperature"] == temperature and r["context"] == context]
        for column in sorted({(r["method"], r["budget"] or 0) for r in mine}):
            points = [r for r in mine if (r["method"], r["budget"] or 0) == column]
            label = column[0] if column[0] != "ddtree" else f"DDTree {column[1]}"
            ax.plot(
                [r["chain_tau"] for r in points],
                [r["tokens_per_s"] for r in points],
                marker="o",
                label=label,
                color=colours[column],
            )
        ax.set_title(f"T = {temperature:g}, context {context:,} (prediction)")
        ax.set_xlabel("chain tau (Kimi-K2.5-DFlash, block 8)")
        ax.set_ylabel("tokens/s, B = 1, TP8")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard", required=True, help="comma-separated tp_shard_step JSONs")
    parser.add_argument(
        "--e2e",
        required=True,
        help="comma-separated bench_e2e JSONs (a budget in several files of one temperature: the first listed)",
    )
    parser.add_argument("--chain-taus", default=",".join(str(t) for t in PUBLIC_CHAIN_TAUS))
    parser.add_argument("--max-tau", type=float, default=8.0, help="tokens a step at most (block 8: 7 drafted + bonus)")
    parser.add_argument("--commit", default="unknown", help="the code commit to record")
    parser.add_argument("--out", default=os.environ.get("OUT", "experiments/results"), help="output directory")
    parser.add_argument("--plot", action="store_true", help="also write k26_prediction.png")
    args = parser.parse_args(argv)
    try:
        chain_taus = [float(t) for t in args.chain_taus.split(",")]
    except ValueError:
        parser.error(f"--chain-taus {args.chain_taus!r}: comma-separated numbers expected")
    if any(t < 1 for t in chain_taus) or any(t > args.max_tau for t in chain_taus):
        raise SystemExit(f"error: chain taus are tokens per step in [1, --max-tau {args.max_tau}]; got {chain_taus}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} is a file; give a directory")
    e2e_paths = args.e2e.split(",")
    try:
        check_distinct(e2e_paths, "--e2e")
        shard_rows, sources = load_shards(args.shard.split(","))
    except ValueError as e:
        parser.error(str(e))
    try:
        e2es = [(path, read_json(path, "--e2e", ("settings", "results"))) for path in e2e_paths]
        by_temperature = merged_ratios(e2es)
    except ValueError as e:
        parser.error(str(e))
    rows = []
    for temperature, (ratios, paths) in by_temperature.items():
        print(
            f"T = {temperature:g}: DDTree / chain tokens per step on the embedded pair: "
            + ", ".join(f"{b}: {r:.2f} ({paths[b]})" for b, r in sorted(ratios.items()))
        )
        mine = predict(shard_rows, ratios, chain_taus, args.max_tau)
        for r in mine:
            r["temperature"] = temperature
            r["e2e_source"] = paths[r["budget"]] if r["method"] == "ddtree" else ",".join(sorted(set(paths.values())))
        rows += mine
        print(f"\nT = {temperature:g} (prediction: measured one-GPU shard step + modelled collectives)\n")
        print(table(mine))
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "k26_prediction.json")
    with open(out, "w") as f:
        record = {
            "benchmark": "k26_prediction",
            "kind": "prediction",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": args.commit,
            # where the shard step was measured (the prediction itself is arithmetic on the host)
            "shard_device": sorted({str(s["device"]) for s in sources}),
            "shard_sources": sources,
            "chain_taus": chain_taus,
            "rows": rows,
        }
        json.dump(record, f, indent=1)
    print(f"\nwritten: {out}")
    if args.plot:
        plot(rows, os.path.join(args.out, "k26_prediction.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
