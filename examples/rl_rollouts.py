"""A reinforcement-learning loop with jaxinfer as the rollout engine, all in JAX on the same
devices: sample completions with the engine, score them with a programmatic reward, take a
policy-gradient step with jax.grad, push the new weights into the engine, repeat.

    python examples/rl_rollouts.py                 # the embedded SmolLM2-135M-Instruct
    python examples/rl_rollouts.py --iterations 4 --model /path/to/a/llama/folder

The policy is the checkpoint's own Llama-family weights under their HF names; the trainer's
forward below is plain jax.numpy (no engine code), so what it computes is checked against the
engine: the log-probabilities the engine reported for its samples must match the trainer's
(printed on the first iteration). The reward asks for brief answers (1 - tokens / max_tokens,
0 when the answer is cut off): an easy target whose mean visibly rises within a few steps.
The update is GRPO-style: advantages are rewards minus the mean of their prompt's group.

Every iteration prints the mean reward, the update's latency and the weight version the
engine labelled the samples with (RequestOutput.outputs[i].weight_versions)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer import LLM, SamplingParams

PROMPTS = ["What is the capital of France?", "Name a color of the sky.",
           "What is 2 + 3?", "Say hello to a friend.", "What do cats like to eat?",
           "Which season is the coldest?", "What is water made of?",
           "Recommend a book to read."]


# -- the trainer's model: Llama-family forward over HF-named parameters ------------------------
def load_params(model_dir: str) -> tuple[dict, dict]:
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    params = {k: jnp.asarray(v, jnp.float32)
              for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    return params, cfg


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta):  # x [B, T, H, D]; HF's rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = pos[..., None].astype(jnp.float32) * inv  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def forward(params: dict, cfg: dict, ids, mask):
    """Logits [B, T, V] of a right-padded batch (mask: 1 on real tokens)."""
    B, T = ids.shape
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None] & (mask[:, None, None, :] > 0)
    x = params["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, params[p + "input_layernorm.weight"], eps)
        q = (h @ params[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, D)
        k = (h @ params[p + "self_attn.k_proj.weight"].T).reshape(B, T, Hkv, D)
        v = (h @ params[p + "self_attn.v_proj.weight"].T).reshape(B, T, Hkv, D)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        k, v = jnp.repeat(k, H // Hkv, axis=2), jnp.repeat(v, H // Hkv, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        a = jax.nn.softmax(jnp.where(causal, s, -1e30), -1)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, H * D)
        x = x + o @ params[p + "self_attn.o_proj.weight"].T
        h = _rms(x, params[p + "post_attention_layernorm.weight"], eps)
        g = jax.nn.silu(h @ params[p + "mlp.gate_proj.weight"].T)
        x = x + (g * (h @ params[p + "mlp.up_proj.weight"].T)) @ params[
            p + "mlp.down_proj.weight"].T
    x = _rms(x, params["model.norm.weight"], eps)
    head = params.get("lm_head.weight", params["model.embed_tokens.weight"])
    return x @ head.T


def completion_logprobs(params, cfg, ids, mask, out_mask):
    """Per-token log-probabilities of the completion tokens (out_mask: 1 on them)."""
    logits = forward(params, cfg, ids, mask)[:, :-1]
    lp = jax.nn.log_softmax(logits, -1)
    tok = jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
    return tok * out_mask[:, 1:]


def pg_loss(params, ids, mask, out_mask, adv, *, cfg):
    lp = completion_logprobs(params, cfg, ids, mask, out_mask)
    return -jnp.sum(lp.sum(-1) * adv) / jnp.maximum(out_mask.sum(), 1.0)


# -- the loop -----------------------------------------------------------------------------------
def reward(token_ids, finish_reason, max_tokens: int) -> float:
    """Brief answers score higher; an answer cut off at max_tokens scores 0."""
    if finish_reason != "stop":
        return 0.0
    return 1.0 - len(token_ids) / max_tokens


def batch(prompt_ids, outputs, pad: int):
    rows = [p + list(o.token_ids) for p, o in zip(prompt_ids, outputs)]
    T = max(map(len, rows))
    ids = np.full((len(rows), T), pad, np.int32)
    mask = np.zeros((len(rows), T), np.float32)
    out_mask = np.zeros((len(rows), T), np.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, rows)):
        ids[i, :len(r)], mask[i, :len(r)], out_mask[i, len(p):len(r)] = r, 1, 1
    return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(out_mask)


def main(model_dir: str | None = None, iterations: int = 6, samples: int = 4,
         max_tokens: int = 32, lr: float = 2e-5, seed: int = 0,
         engine_options: dict | None = None) -> dict:
    """Runs the loop; returns {"rewards": mean reward per iteration, "versions": the weight
    versions that sampled each iteration, "logprob_max_diff": trainer vs engine}."""
    if model_dir is None:
        from jaxinfer.checkpoints.default_model import ensure_default_model

        model_dir = ensure_default_model()
    params, cfg = load_params(model_dir)
    # The engine in this process: update_weights takes the trainer's arrays directly.
    llm = LLM(model_dir, dtype="float32", enable_multiprocessing=False, seed=seed,
              max_model_len=256, **(engine_options or {}))
    tok = llm.get_tokenizer()
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}],
                                          add_generation_prompt=True, tokenize=True)
                  for p in PROMPTS]
    prompt_ids = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompt_ids]
    opt = optax.adam(lr)
    opt_state = opt.init(params)
    grad_fn = jax.jit(jax.value_and_grad(functools.partial(pg_loss, cfg=cfg)))
    history: dict = {"rewards": [], "versions": []}
    for it in range(iterations):
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=samples, logprobs=0,
                            seed=seed * 1000 + it)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp, use_tqdm=False)
        t_gen = time.perf_counter() - t0
        rows_p, rows_o, rewards, groups = [], [], [], []
        for g, (p, out) in enumerate(zip(prompt_ids, outs)):
            for o in out.outputs:
                rows_p.append(p)
                rows_o.append(o)
                rewards.append(reward(o.token_ids, o.finish_reason, max_tokens))
                groups.append(g)
        r = np.array(rewards, np.float32)
        g = np.array(groups)
        adv = r - np.array([r[g == k].mean() for k in g])
        ids, mask, out_mask = batch(rows_p, rows_o, tok.eos_token_id or 0)
        if it == 0:  # the trainer's forward against the engine's own log-probabilities
            mine = np.asarray(completion_logprobs(params, cfg, ids, mask, out_mask))
            diffs = []
            for i, (p, o) in enumerate(zip(rows_p, rows_o)):
                engine = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
                diffs.append(np.abs(mine[i, len(p) - 1:len(p) - 1 + len(engine)]
                                    - np.array(engine)).max(initial=0.0))
            history["logprob_max_diff"] = float(max(diffs))
            print(f"trainer vs engine log-probabilities: max |diff| {max(diffs):.2e}")
        t1 = time.perf_counter()
        loss, grads = grad_fn(params, ids, mask, out_mask, jnp.asarray(adv))
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        jax.block_until_ready(params)
        t_train = time.perf_counter() - t1
        pushed = llm.update_weights(params, weight_version=f"iter-{it + 1}")
        versions = {s.version for o in rows_o for s in o.weight_versions}
        history["rewards"].append(float(r.mean()))
        history["versions"].append(sorted(versions))
        print(f"iteration {it}: mean reward {r.mean():.3f} (mean length "
              f"{np.mean([len(o.token_ids) for o in rows_o]):.1f} tokens, sampled by "
              f"{sorted(versions)}); rollout {t_gen:.1f}s, train step {t_train:.1f}s, "
              f"weight update {pushed['seconds'] * 1e3:.0f} ms "
              f"({pushed['bytes'] / 2**20:.0f} MiB)", flush=True)
    llm.shutdown()
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Llama-family HF folder (default: the "
                                                  "embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    a = ap.parse_args()
    rewards = main(a.model, a.iterations, a.samples, a.max_tokens, a.lr)["rewards"]
    print("mean reward per iteration:", " ".join(f"{r:.3f}" for r in rewards))
