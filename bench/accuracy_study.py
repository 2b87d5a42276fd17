"""Accuracy of training with compressed residuals, on real data (issue 16, item 4).

    python bench/accuracy_study.py                 # both models, 3 seeds, every policy
    python bench/accuracy_study.py --steps 200 --seeds 1 --only mlp   # a quick look

scikit-learn's ``load_digits`` (1,797 8x8 images, 10 classes; the ``study`` extra), a
fixed 75/25 train/test split, standardized pixels. Two models, each trained with optax
Adam for a fixed number of steps under ``jax.jit(tg.value_and_grad(..., policy=...))``:

* ``mlp``: 64-256-256-10, ReLU;
* ``cnn``: conv 3x3x16 - ReLU - max-pool 2, conv 3x3x32 - ReLU - max-pool 2, dense 10.

For each residual policy (``save()``, bf16, int8, 4-bit, 2-bit, and ``auto``: a bit width
per residual averaging at most 3 bits a value, fitted on the run's first batch at its
initial weights; stochastic rounding gets a fresh key every step) and seed: the
activation bytes backward holds beyond the inputs (``tg.memory_report`` on one batch,
measured from the arrays), the final test accuracy, and the loss curve (means over 10
steps). Prints a table (mean over seeds, accuracy change against ``save()`` in
percentage points) and writes every curve to ``bench/accuracy_study.json``, which
notebook 02 plots.

Seeds are paired: seed ``s`` gives every policy the same initial weights, the same
batches and the same rounding keys, so a policy's change against ``save()`` is read
seed by seed, and the table gives the mean of those paired differences with its
standard error (sample sd / sqrt(seeds)). One test image is 1/450 = 0.22 points: with
3 seeds a change under ~0.5 points is seldom told apart from noise; ``--seeds 10``
narrows it.

The learning rate follows ``--schedule``: ``cosine`` (the default) decays it from
``--lr`` to 0 over the run (``optax.cosine_decay_schedule``), ``constant`` keeps it. At a
constant rate Adam divides near-zero late gradients by their near-zero running scale,
so the last steps stay full size and any perturbation (a rounding, a hard batch) can
throw a converged run off (several MLP runs spiked near step 550); a decaying rate is
the usual practice and lets the comparison measure the rounding rather than that. No
warmup: the constant-rate runs show no early instability to cure.

Runs are deterministic (same seed, same numbers on the same machine), so seeds can be
run in parts (``--first-seed``) and merged: ``--merge a.json b.json --out all.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import tapegrad as tg

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "accuracy_study.json")


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, d.target, test_size=0.25, random_state=0, stratify=d.target
    )
    mu, sd = x_tr.mean(), x_tr.std()
    return (x_tr - mu) / sd, y_tr.astype(np.int32), (x_te - mu) / sd, y_te.astype(np.int32)


# ---------------------------------------------------------------------------- models


def mlp_init(key) -> dict:
    sizes = [64, 256, 256, 10]
    ks = jax.random.split(key, len(sizes) - 1)
    return {
        f"w{i}": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a)
        for i, (k, a, b) in enumerate(zip(ks, sizes[:-1], sizes[1:]))
    } | {f"b{i}": jnp.zeros((b,)) for i, b in enumerate(sizes[1:])}


def mlp_apply(p: dict, x) -> jax.Array:
    h = x.reshape(x.shape[0], -1)
    for i in range(3):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < 2:
            h = jax.nn.relu(h)
    return h


def _conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def cnn_init(key) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "c1": jax.random.normal(k1, (3, 3, 1, 16)) * np.sqrt(2.0 / 9),
        "c2": jax.random.normal(k2, (3, 3, 16, 32)) * np.sqrt(2.0 / 144),
        "w": jax.random.normal(k3, (2 * 2 * 32, 10)) * np.sqrt(1.0 / 128),
        "b": jnp.zeros((10,)),
    }


def cnn_apply(p: dict, x) -> jax.Array:
    h = x[..., None]
    h = _pool(jax.nn.relu(_conv(h, p["c1"])))
    h = _pool(jax.nn.relu(_conv(h, p["c2"])))
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


MODELS: dict[str, tuple[Callable, Callable]] = {
    "mlp": (mlp_init, mlp_apply),
    "cnn": (cnn_init, cnn_apply),
}


def xent(apply: Callable) -> Callable:
    def loss(p, x, y):
        logits = apply(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    return loss


# ---------------------------------------------------------------------------- policies

C = tg.policies.compress
# Bits a value on average for bits="auto" (codes only, as for bits=2 and 4): halfway
# between them, so its bytes land between theirs.
AUTO_BUDGET = 3.0
# name -> policy for a step's key (a fresh one per step for stochastic rounding) and,
# for "auto", the bit allocation its run fitted
POLICIES: dict[str, Callable] = {
    "save": lambda key, alloc=None: tg.policies.save(),
    "bf16": lambda key, alloc=None: C(jnp.bfloat16),
    "int8": lambda key, alloc=None: C("int8"),
    "4-bit": lambda key, alloc=None: C(bits=4, key=key),
    "auto": lambda key, alloc=None: C(bits="auto", allocation=alloc, key=key),
    "2-bit": lambda key, alloc=None: C(bits=2, key=key),
}
SCHEDULES = ("cosine", "constant")


def learning_rate(schedule: str, lr: float, steps: int):
    import optax

    if schedule == "cosine":
        return optax.cosine_decay_schedule(lr, steps)  # lr -> 0 at the last step
    return lr


def train(
    model: str, policy: str, seed: int, steps: int, batch: int, lr: float, schedule: str, d
) -> dict:
    import optax

    init, apply = MODELS[model]
    loss = xent(apply)
    x_tr, y_tr, x_te, y_te = d
    key = jax.random.key(seed)
    params = init(key)
    opt = optax.adam(learning_rate(schedule, lr, steps))
    state = opt.init(params)
    rng = np.random.RandomState(seed)
    batches = [rng.randint(0, len(x_tr), batch) for _ in range(steps)]
    alloc = None
    if policy == "auto":
        # Calibrated once, on the run's first batch at its initial weights (seeded by
        # the run's seed): a few jitted gradients, before training.
        b0 = batches[0]
        fitted = C(bits="auto", budget_bits=AUTO_BUDGET).fit(
            loss, params, x_tr[b0], y_tr[b0], seed=seed
        )
        alloc = fitted.allocation

    @jax.jit
    def step(params, state, xb, yb, k):
        pol = POLICIES[policy](k, alloc)
        val, g = tg.value_and_grad(loss, policy=pol)(params, xb, yb)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, val

    curve = []
    for i, idx in enumerate(batches):
        params, state, val = step(params, state, x_tr[idx], y_tr[idx], jax.random.fold_in(key, i))
        curve.append(float(val))
    acc = float(jnp.mean(jnp.argmax(apply(params, x_te), -1) == y_te))
    xb, yb = x_tr[:batch], y_tr[:batch]
    rep = tg.memory_report(loss, policy=POLICIES[policy](key, alloc))(params, xb, yb)
    out = {
        "model": model,
        "policy": policy,
        "seed": seed,
        "test_accuracy": acc,
        "final_loss": statistics.fmean(curve[-20:]),
        "held_bytes": rep.beyond_inputs_bytes,
        # the loss curve as means over windows of 10 steps (a small file to plot)
        "curve": [round(statistics.fmean(curve[i : i + 10]), 5) for i in range(0, len(curve), 10)],
    }
    if alloc is not None:  # the widths the run's fit chose, by residual name
        out |= {"bits": alloc.bits, "average_bits": alloc.average_bits}
    return out


def summarize(runs: list[dict], models: list[str], policies: list[str]) -> list[dict]:
    """Per model and policy: bytes, accuracy, and the change against ``save()`` in
    points as the mean of per-seed differences (same seed, same init and batches) with
    its standard error (None with one seed, or without ``save()`` runs)."""
    out = []
    for model in models:
        base = {r["seed"]: r for r in runs if r["model"] == model and r["policy"] == "save"}
        for policy in policies:
            rs = [r for r in runs if r["model"] == model and r["policy"] == policy]
            if not rs:
                continue
            diffs = [
                100 * (r["test_accuracy"] - base[r["seed"]]["test_accuracy"])
                for r in rs
                if r["seed"] in base
            ]
            # The same for every seed, but "auto" fits its widths per run: its bytes
            # may differ between seeds (then the mean, and the range alongside).
            helds = [r["held_bytes"] for r in rs]
            held = statistics.fmean(helds)
            out.append(
                {
                    "model": model,
                    "policy": policy,
                    "held_bytes": held,
                    "held_bytes_range": [min(helds), max(helds)],
                    "fewer": base[min(base)]["held_bytes"] / held if base else None,
                    "accuracies": [100 * r["test_accuracy"] for r in rs],
                    "accuracy": 100 * statistics.fmean(r["test_accuracy"] for r in rs),
                    "change": statistics.fmean(diffs) if diffs else None,
                    "change_se": (
                        statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
                    ),
                    "final_loss": statistics.fmean(r["final_loss"] for r in rs),
                }
            )
    return out


def merge(paths: list[str]) -> tuple[dict, list[dict]]:
    """The args and runs of study files run in parts (``--first-seed``), with the same
    settings. A run found in two files must be the same in both (the runs are
    deterministic): a check that parts from different invocations can be merged."""
    keys = ("steps", "batch", "lr", "schedule")
    first, runs = None, {}
    for path in paths:
        with open(path) as fh:
            part = json.load(fh)
        a = part["args"]
        a.setdefault("schedule", "constant")  # files written before --schedule existed
        if first is None:
            first = a
        elif any(a[k] != first[k] for k in keys):
            raise SystemExit(f"{path}: settings {a} differ from {first}")
        for r in part["runs"]:
            k = (r["model"], r["policy"], r["seed"])
            if k in runs and runs[k] != r:
                raise SystemExit(f"{path}: run {k} differs from the same run in another part")
            runs[k] = r
    assert first is not None
    seeds = sorted({k[2] for k in runs})
    models = [m for m in MODELS if any(k[0] == m for k in runs)]
    policies = [p for p in POLICIES if any(k[1] == p for k in runs)]
    args = {k: v for k, v in first.items() if k != "merge"} | {
        "seeds": len(seeds),
        "first_seed": seeds[0],
        "only": models,
        "policies": policies,
        "merged": paths,
    }
    return args, sorted(
        runs.values(),
        key=lambda r: (models.index(r["model"]), policies.index(r["policy"]), r["seed"]),
    )


def print_table(summary: list[dict]) -> None:
    print(
        "| model | policy | activation bytes held | vs save() | test accuracy (mean of seeds) "
        "| change vs save() (paired mean ± s.e.) | final loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in summary:
        accs = ", ".join(f"{a:.2f}" for a in row["accuracies"])
        ratio = f"{row['fewer']:.2f}x fewer" if row["fewer"] else "-"
        delta = "-"
        if row["change"] is not None:
            se = f" ± {row['change_se']:.2f}" if row["change_se"] is not None else ""
            delta = f"{row['change']:+.2f}{se} pp"
        lo, hi = row["held_bytes_range"]
        held = f"{row['held_bytes']:,.0f} B" + (f" ({lo:,}–{hi:,})" if lo != hi else "")
        print(
            f"| {row['model']} | {row['policy']} | {held} | {ratio} | "
            f"{row['accuracy']:.2f}% ({accs}) | {delta} | {row['final_loss']:.4f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument(
        "--schedule", choices=SCHEDULES, default="cosine", help="learning rate over the run"
    )
    ap.add_argument("--only", nargs="*", default=list(MODELS))
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--out", default=OUT, help="where the runs are written (JSON)")
    ap.add_argument(
        "--merge", nargs="+", metavar="JSON", help="merge study files run in parts; train nothing"
    )
    args = ap.parse_args()
    if args.merge:
        meta, runs = merge(args.merge)
        meta["out"] = args.out
    else:
        meta = vars(args)
        print(
            f"jax {jax.__version__} on {jax.default_backend()}, {platform.machine()}, "
            f"{os.cpu_count()} cpus; load_digits, {args.steps} Adam steps (lr {args.lr}, "
            f"{args.schedule}), batch {args.batch}, "
            f"seeds {args.first_seed}..{args.first_seed + args.seeds - 1}"
        )
        d = data()
        runs = []
        t0 = time.perf_counter()
        for model in args.only:
            for policy in args.policies:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    runs.append(
                        train(
                            model, policy, seed, args.steps, args.batch, args.lr, args.schedule, d
                        )
                    )
        print(f"({time.perf_counter() - t0:.0f} s)\n")
    summary = summarize(runs, meta["only"], meta["policies"])
    print_table(summary)
    with open(args.out, "w") as fh:
        json.dump({"args": meta, "summary": summary, "runs": runs}, fh)
    print(f"\ncurves written to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
