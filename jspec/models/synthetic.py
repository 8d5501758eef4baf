"""Seeded synthetic weights with a predictable greedy chain: the toy target and its EAGLE-1
head (``jspec demo``'s), and an EAGLE-3 head constructed (not trained) to draft the toy target
well. For tests, demos and examples.

Toy target (:func:`toy_llama_params`, the toy of ``jspec demo`` and the engine tests; the
RNG stream of the engine's former ``init_target_params``): the LM head is the embedding composed with a fixed random permutation
``sigma``, ``lm_head[:, sigma(x)] = embed[x] / sqrt(H)``, so ``argmax logits ~ sigma(x)`` plus
context terms from the layers (scaled by ``residual_scale``).

Matched EAGLE-3 head (:func:`matched_eagle3`): its ``hidden_out`` is ``gain * e`` where
``e = rms_norm(embed(token))``, whatever the incoming hidden, so its logits
``lm_head(norm(gain * e))`` predict ``sigma(token)`` like the toy target does:

* ``fc = 0``: the target's aux states contribute nothing (hidden = 0 on the first step);
* q = k = ``focus * e`` (the embedding half of the 2H input): RoPE keeps ``q . k`` largest at
  relative distance 0, so each token attends to itself;
* v = ``e - rms_norm(hidden)``, o = ``gain * I``: the attention returns ``gain * (e - h_hat)``,
  and the residual ``+ hidden`` cancels the previous ``hidden = gain * h_hat`` exactly;
* ``w_down = 0`` (no MLP); norms are ones; ``lm_head`` = the target's LM head on the hot ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.eagle1 import Eagle1Draft, Eagle1Params
from jspec.models.eagle3 import Eagle3Draft, Eagle3Params
from jspec.models.hf_config import Eagle3Config
from jspec.models.llama import LayerParams, LlamaParams, LlamaTarget


def toy_llama_params(
    target: LlamaTarget, seed: int = 0, *, residual_scale: float = 0.5
) -> LlamaParams:
    """Transition-dominated target weights (the toy's init; untied LM head).

    ``lm_head[:, sigma(x)] = embed[x] / sqrt(H)``: with small layer residuals the normed hidden
    of token ``x`` is close to ``embed[x]``, so ``argmax logits ~ sigma(x)`` with a margin of
    about ``sqrt(H)`` standard deviations; ``residual_scale`` sets how often the context (the
    attention and MLP residuals) overrides it.
    """
    cfg = target.config
    if cfg.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=True: the toy init needs its own LM head")
    rng = np.random.default_rng(seed)
    hid, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, cfg.jnp_dtype)

    def dense(fan_in: int, fan_out: int, scale: float = 1.0) -> jax.Array:
        return put(rng.standard_normal((fan_in, fan_out)) * (scale / np.sqrt(fan_in)))

    embed = rng.standard_normal((vocab, hid))
    sigma = rng.permutation(vocab)
    lm_head = np.zeros((hid, vocab))
    lm_head[:, sigma] = embed.T / np.sqrt(hid)
    # NOTE: the draw order below (per layer: wq, wk, wv, wo, w_gate, w_up, w_down) is the toy's.
    layers = []
    for _ in range(cfg.num_layers):
        wq, wk, wv = dense(hid, qd), dense(hid, kvd), dense(hid, kvd)
        wo = dense(qd, hid, residual_scale)
        w_gate, w_up = dense(hid, inter), dense(hid, inter)
        layers.append(
            LayerParams.from_projections(
                attn_norm=put(np.ones(hid)),
                wq=wq,
                wk=wk,
                wv=wv,
                wo=wo,
                mlp_norm=put(np.ones(hid)),
                w_gate=w_gate,
                w_up=w_up,
                w_down=dense(inter, hid, residual_scale),
                head_dim=cfg.head_dim,
            )
        )
    return LlamaParams(
        embed=put(embed), layers=tuple(layers), final_norm=put(np.ones(hid)), lm_head=put(lm_head)
    )


def toy_eagle1(
    target: LlamaTarget, target_params: LlamaParams, seed: int = 1, *, hidden_mix: float = 0.1
) -> tuple[Eagle1Draft, Eagle1Params]:
    """The toy's EAGLE-1 head (the former engine toy's ``init_draft_params``), accepting well on a
    :func:`toy_llama_params` target.

    ``fc = [I; hidden_mix * R]`` passes the token embedding through (plus a little of the
    incoming hidden state) and the decoder layer is the target's last layer, so the head
    predicts the target's dominant transition ``sigma``.
    """
    cfg = target.config
    rng = np.random.default_rng(seed)
    hid = cfg.hidden_size
    fc = np.concatenate([np.eye(hid), hidden_mix * rng.standard_normal((hid, hid)) / np.sqrt(hid)])
    params = Eagle1Params(
        fc=jnp.asarray(fc, cfg.jnp_dtype),
        fc_bias=None,
        layer=target_params.layers[-1],
        final_norm=jnp.ones(hid, cfg.jnp_dtype),
    )
    return Eagle1Draft(cfg), params


def matched_eagle3(
    target: LlamaTarget,
    target_params: LlamaParams,
    *,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    draft_vocab_size: int | None = None,
    capture_layers: tuple[int, ...] | None = None,
    seed: int = 0,
    gain: float = 4.0,
    focus: float = 3.0,
) -> tuple[Eagle3Draft, Eagle3Params]:
    """An EAGLE-3 head that drafts ``sigma`` (see the module docstring) for ``target``.

    Args:
      num_heads: the head's attention heads (no GQA); must divide the hidden size.
      draft_vocab_size: hot vocabulary size (default: the whole target vocabulary); the hot
        ids are a seeded random sorted subset, ``d2t`` maps to them.
      capture_layers: default ``(0, 1, 2)`` clipped to the target's depth for shallow targets,
        sglang's ``(2, N // 2, N - 3)`` from 8 layers on (the head ignores them: ``fc = 0``).
      gain, focus: output scale and attention sharpness.

    Returns:
      ``(Eagle3Draft, Eagle3Params)`` in the target's dtype.
    """
    cfg = target.config
    hid, vocab = cfg.hidden_size, cfg.vocab_size
    if hid % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide hidden_size={hid}")
    n = cfg.num_layers
    default = (2, n // 2, n - 3)
    if capture_layers is None:
        capture_layers = default if n >= 8 else (0, min(1, n - 1), min(2, n - 1))
    capture_layers = tuple(capture_layers)
    aux_ids = None if capture_layers == default else tuple(i - 1 for i in capture_layers)
    vd = draft_vocab_size or vocab
    draft = Eagle3Draft(
        Eagle3Config(
            hidden_size=hid,
            intermediate_size=intermediate_size or 2 * hid,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hid // num_heads,
            vocab_size=vocab,
            draft_vocab_size=vd,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            aux_layer_ids=aux_ids,
            num_aux=len(capture_layers),
            dtype=cfg.dtype,
        ),
        capture_layers,
    )
    rng = np.random.default_rng(seed)
    hot = np.arange(vocab) if vd == vocab else np.sort(rng.choice(vocab, vd, replace=False))
    eye, zero = np.eye(hid), np.zeros((hid, hid))
    lm_head = (
        np.asarray(target_params.embed, np.float32).T
        if target_params.lm_head is None
        else np.asarray(target_params.lm_head, np.float32)
    )

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, cfg.jnp_dtype)

    inter = draft.config.intermediate_size
    layer = LayerParams.from_projections(
        attn_norm=put(np.ones(hid)),
        wq=put(focus * np.concatenate([eye, zero])),
        wk=put(focus * np.concatenate([eye, zero])),
        wv=put(np.concatenate([eye, -eye])),
        wo=put(gain * eye),
        mlp_norm=put(np.ones(hid)),
        w_gate=put(rng.standard_normal((hid, inter)) / np.sqrt(hid)),
        w_up=put(rng.standard_normal((hid, inter)) / np.sqrt(hid)),
        w_down=put(np.zeros((inter, hid))),
        head_dim=hid // num_heads,
    )
    params = Eagle3Params(
        fc=put(np.zeros((len(capture_layers) * hid, hid))),
        fc_bias=None,
        hidden_norm=put(np.ones(hid)),
        layer=layer,
        final_norm=put(np.ones(hid)),
        lm_head=put(lm_head[:, hot]),
        d2t=jnp.asarray(hot - np.arange(vd), jnp.int32),
    )
    return draft, params
