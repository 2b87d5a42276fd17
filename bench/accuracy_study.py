"""Accuracy of training with compressed residuals, on real data (issue 16, item 4).

    python bench/accuracy_study.py                 # both models, 3 seeds, every policy
    python bench/accuracy_study.py --steps 200 --seeds 1 --only mlp   # a quick look

scikit-learn's ``load_digits`` (1,797 8x8 images, 10 classes; the ``study`` extra), a
fixed 75/25 train/test split, standardized pixels. Two models, each trained with optax
Adam for a fixed number of steps under ``jax.jit(tg.value_and_grad(..., policy=...))``:

* ``mlp``: 64-256-256-10, ReLU;
* ``cnn``: conv 3x3x16 - ReLU - max-pool 2, conv 3x3x32 - ReLU - max-pool 2, dense 10.

For each residual policy (``save()``, bf16, int8, 4-bit, 2-bit; stochastic rounding gets
a fresh key every step) and seed: the activation bytes backward holds beyond the inputs
(``tg.memory_report`` on one batch, measured from the arrays), the final test accuracy,
and the loss curve (means over 10 steps). Prints a table (mean over seeds, accuracy
change against ``save()`` in percentage points) and writes every curve to
``bench/accuracy_study.json``, which notebook 02 plots.

Seeds are paired: seed ``s`` gives every policy the same initial weights, the same
batches and the same rounding keys, so a policy's change against ``save()`` is read
seed by seed, and the table gives the mean of those paired differences with its
standard error (sample sd / sqrt(seeds)). One test image is 1/450 = 0.22 points: with
3 seeds a change under ~0.5 points is seldom told apart from noise; ``--seeds 10``
narrows it.
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
# name -> policy for a step's key (a fresh one per step for stochastic rounding)
POLICIES: dict[str, Callable] = {
    "save": lambda key: tg.policies.save(),
    "bf16": lambda key: C(jnp.bfloat16),
    "int8": lambda key: C("int8"),
    "4-bit": lambda key: C(bits=4, key=key),
    "2-bit": lambda key: C(bits=2, key=key),
}


def train(model: str, policy: str, seed: int, steps: int, batch: int, lr: float, d) -> dict:
    import optax

    init, apply = MODELS[model]
    loss = xent(apply)
    x_tr, y_tr, x_te, y_te = d
    key = jax.random.key(seed)
    params = init(key)
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb, k):
        pol = POLICIES[policy](k)
        val, g = tg.value_and_grad(loss, policy=pol)(params, xb, yb)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, val

    rng = np.random.RandomState(seed)
    curve = []
    for i in range(steps):
        idx = rng.randint(0, len(x_tr), batch)
        params, state, val = step(params, state, x_tr[idx], y_tr[idx], jax.random.fold_in(key, i))
        curve.append(float(val))
    acc = float(jnp.mean(jnp.argmax(apply(params, x_te), -1) == y_te))
    xb, yb = x_tr[:batch], y_tr[:batch]
    rep = tg.memory_report(loss, policy=POLICIES[policy](key))(params, xb, yb)
    return {
        "model": model,
        "policy": policy,
        "seed": seed,
        "test_accuracy": acc,
        "final_loss": statistics.fmean(curve[-20:]),
        "held_bytes": rep.beyond_inputs_bytes,
        # the loss curve as means over windows of 10 steps (a small file to plot)
        "curve": [round(statistics.fmean(curve[i : i + 10]), 5) for i in range(0, len(curve), 10)],
    }


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
            held = rs[0]["held_bytes"]
            out.append(
                {
                    "model": model,
                    "policy": policy,
                    "held_bytes": held,
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--only", nargs="*", default=list(MODELS))
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--out", default=OUT, help="where the runs are written (JSON)")
    args = ap.parse_args()
    print(
        f"jax {jax.__version__} on {jax.default_backend()}, {platform.machine()}, "
        f"{os.cpu_count()} cpus; load_digits, {args.steps} Adam steps (lr {args.lr}), "
        f"batch {args.batch}, seeds {args.first_seed}..{args.first_seed + args.seeds - 1}"
    )
    d = data()
    runs = []
    t0 = time.perf_counter()
    for model in args.only:
        for policy in args.policies:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                runs.append(train(model, policy, seed, args.steps, args.batch, args.lr, d))
    print(f"({time.perf_counter() - t0:.0f} s)\n")
    summary = summarize(runs, args.only, args.policies)
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
        print(
            f"| {row['model']} | {row['policy']} | {row['held_bytes']:,} B | {ratio} | "
            f"{row['accuracy']:.2f}% ({accs}) | {delta} | {row['final_loss']:.4f} |"
        )
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "summary": summary, "runs": runs}, fh)
    print(f"\ncurves written to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
