"""penzai: a tiny llama-like transformer from `penzai.models.transformer` (two decoder
blocks, grouped-query attention, SwiGLU, named arrays), its next-token loss
differentiated through tapegrad w.r.t. its parameters (`pz.unbind_params`)."""

from __future__ import annotations

import functools

import pytest

penzai = pytest.importorskip("penzai")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from penzai import pz  # noqa: E402
from penzai.models.transformer.variants import llamalike_common  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402

VOCAB, BATCH, SEQ = 32, 2, 6


def llama_like() -> Case:
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=1,
        query_head_multiplier=2,
        embedding_dim=16,
        projection_dim=8,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    model = llamalike_common.build_llamalike_transformer(config, jax.random.key(0))
    unbound, params = pz.unbind_params(model, freeze=True)
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    tokens = pz.nx.wrap(ids).tag("batch", "seq")

    def loss(params):
        logits = pz.bind_variables(unbound, params)(tokens)
        logp = jax.nn.log_softmax(logits.unwrap("batch", "seq", "vocabulary"), axis=-1)
        nxt = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)
        return -jnp.mean(nxt)

    return Case(loss, (params,))


CASES = {"llamalike-transformer": llama_like}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


XFAIL: dict = {}


# Building the model (penzai initialises each parameter eagerly) and jax's jitted gradient
# land in the first mode, eager: ~10 s. The budget's planning is ~13 s.
SLOW = {("llamalike-transformer", "eager"), ("llamalike-transformer", "budget")}


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW, at_save="slow"))
def test_penzai(name, mode):
    check(case(name), mode)
