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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--only", nargs="*", default=list(MODELS))
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    args = ap.parse_args()
    print(
        f"jax {jax.__version__} on {jax.default_backend()}, {platform.machine()}, "
        f"{os.cpu_count()} cpus; load_digits, {args.steps} Adam steps (lr {args.lr}), "
        f"batch {args.batch}, seeds 0..{args.seeds - 1}"
    )
    d = data()
    runs = []
    t0 = time.perf_counter()
    for model in args.only:
        for policy in args.policies:
            for seed in range(args.seeds):
                runs.append(train(model, policy, seed, args.steps, args.batch, args.lr, d))
    print(f"({time.perf_counter() - t0:.0f} s)\n")
    print(
        "| model | policy | activation bytes held | vs save() | test accuracy (mean of seeds) "
        "| change vs save() | final loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in args.only:
        base = [r for r in runs if r["model"] == model and r["policy"] == "save"]
        base_acc = statistics.fmean(r["test_accuracy"] for r in base) if base else None
        base_bytes = base[0]["held_bytes"] if base else None
        for policy in args.policies:
            rs = [r for r in runs if r["model"] == model and r["policy"] == policy]
            acc = statistics.fmean(r["test_accuracy"] for r in rs)
            accs = ", ".join(f"{100 * r['test_accuracy']:.2f}" for r in rs)
            ratio = f"{base_bytes / rs[0]['held_bytes']:.1f}x fewer" if base_bytes else "-"
            delta = f"{100 * (acc - base_acc):+.2f} pp" if base_acc is not None else "-"
            loss = statistics.fmean(r["final_loss"] for r in rs)
            print(
                f"| {model} | {policy} | {rs[0]['held_bytes']:,} B | {ratio} | "
                f"{100 * acc:.2f}% ({accs}) | {delta} | {loss:.4f} |"
            )
    with open(OUT, "w") as fh:
        json.dump({"args": vars(args), "runs": runs}, fh)
    print(f"\ncurves written to {os.path.relpath(OUT)}")


if __name__ == "__main__":
    main()
