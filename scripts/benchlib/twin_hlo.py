"""What the compiled lowtrain step does that its hand-cast twin does not: for each
precision, the loss and gradient of the recipe's Trainer (its precision's
`wrap_model`, its `loss`) and of the bench's twin (`benchlib.throughput.make_case`)
are compiled for this machine's backend, and their optimized HLO compared: XLA's
cost analysis (bytes accessed, FLOPs) and the fusions of the entry computation
counted by output type, listing those one has more of than the other.

    python scripts/bench.py twin-hlo --model gpt --precisions unit_bf16,unit_fp8

A fusion is one pass over memory on a GPU and a loop on a CPU, so extra fusions of
activation size are where a lowtrain / hand ratio above 1 comes from.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import equinox as eqx
import jax

from . import report, throughput

FUSION = re.compile(r"= (\w+\[[^\]]*\])\S* fusion\(")


def compiled_pair(model_name: str, precision: str, extra=()) -> dict:
    """`{"lowtrain": compiled, "hand": compiled}`: the value and gradient of the
    Trainer's loss and of the twin's, compiled for one batch of the case."""
    case = throughput.make_case(model_name, precision, None, list(extra))
    if case.hand_loss is None:
        raise ValueError(
            f"Expected a precision with a hand-cast twin, got {precision!r}, "
            "which has none (scalify_fp8): leave it out of `--precisions`."
        )
    batch = throughput.synthetic_data(case)(0)
    args = (case.trainer.model, batch["x"], batch["y"])
    out = {}
    for name, loss in (("lowtrain", case.trainer_loss), ("hand", case.hand_loss)):
        grad = eqx.filter_value_and_grad(loss)
        step = jax.jit(lambda m, x, y, grad=grad: grad(m, x, y))
        out[name] = step.lower(*args).compile()
    return out


def summary(compiled) -> dict:
    """Bytes accessed and FLOPs (XLA's cost analysis) and the entry computation's
    fusions by output type."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    return {
        "bytes": float(cost.get("bytes accessed", 0.0)),
        "flops": float(cost.get("flops", 0.0)),
        "fusions": collections.Counter(FUSION.findall(entry)),
    }


def compare(model_name: str, precision: str, extra=()) -> dict:
    """The two summaries and the fusions each has more of, by output type."""
    pair = {
        k: summary(v) for k, v in compiled_pair(model_name, precision, extra).items()
    }
    ours, theirs = pair["lowtrain"]["fusions"], pair["hand"]["fusions"]
    return {**pair, "more_in_lowtrain": ours - theirs, "more_in_hand": theirs - ours}


def markdown(rows: dict) -> str:
    lines = [
        "| precision | fusions (lowtrain / hand) | bytes accessed, lowtrain / hand | "
        "more in lowtrain | more in hand |",
        "|---|---:|---:|---|---|",
    ]
    for precision, r in rows.items():
        mine, twin = r["lowtrain"], r["hand"]
        fmt = lambda c: ", ".join(f"{n} x `{t}`" for t, n in sorted(c.items())) or "–"  # noqa: E731
        lines.append(
            f"| {precision} | {sum(mine['fusions'].values())} / "
            f"{sum(twin['fusions'].values())} | {mine['bytes'] / twin['bytes']:.3f} | "
            f"{fmt(r['more_in_lowtrain'])} | {fmt(r['more_in_hand'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.py twin-hlo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="gpt", choices=sorted(throughput.SIZES))
    parser.add_argument("--precisions", default="unit_bf16,unit_fp8")
    throughput.add_set_argument(parser, "precision", "model.attention=fused")
    args = parser.parse_args(argv)
    rows = {
        p: compare(args.model, p, args.set) for p in args.precisions.split(",") if p
    }
    print(f"Machine: {report.machine()}")
    print(f"\nThe compiled loss and gradient, `model={args.model}`:\n")
    print(markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
