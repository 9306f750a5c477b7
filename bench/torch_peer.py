"""Hugging Face's GPT2LMHeadModel trained by torch in eager mode on the CPU: the peer a PyTorch user would time.

Built from the plain-JAX reference's weights (bench/train_step.py's `reference_params`, a copy of ours), with the
same shapes, dropout off, GPT-2's tanh GELU, tied embeddings, the mean next-token cross-entropy that
`labels=` computes, and torch.optim.AdamW with the same betas, epsilon, decoupled weight decay on the same
parameters, global-norm clipping and the learning rate of our schedule's first step. So its first two losses
are ours (checked by the caller). Attention is transformers' default for GPT-2 (`sdpa`), as a user gets it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# Idle OpenMP threads of torch sleep instead of spinning, so that they take no core from the jax step timed
# right after a torch step (set before torch is imported).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available() -> bool:
    """Whether CPU torch and transformers are installed (the workspace's `parity` group)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class TorchPeer:
    """One eager torch train step of HF GPT-2; `batch` converts the ids, `step` trains on them and returns the loss."""

    def __init__(self, params: dict[str, Any], decay: dict[str, Any], shape: Any, eps: float, adam: Any, lr: float):
        import torch
        import transformers

        torch.manual_seed(0)
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core this process may use, as jax does
        config = transformers.GPT2Config(
            vocab_size=shape.vocab,
            n_positions=shape.seq,
            n_embd=shape.hidden,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_inner=4 * shape.hidden,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=eps,
            tie_word_embeddings=True,
        )
        self.torch = torch
        self.model = transformers.GPT2LMHeadModel(config).train()
        named = hf_state(params)
        missing = set(self.model.state_dict()) - set(named) - {"lm_head.weight"}  # tied to wte
        assert not missing, f"no weights for {sorted(missing)}"
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in named.items()}, strict=False)
        decayed = hf_decay(decay, shape.layers)
        groups: dict[bool, list[Any]] = {True: [], False: []}
        for name, parameter in self.model.named_parameters():  # lm_head.weight is wte: listed once
            groups[decayed[name]].append(parameter)
        self.optimizer = torch.optim.AdamW(
            [
                {"params": groups[True], "weight_decay": adam.weight_decay},
                {"params": groups[False], "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(adam.beta1, adam.beta2),
            eps=adam.epsilon,
        )
        self.max_grad_norm = adam.max_grad_norm

    def batch(self, ids: np.ndarray) -> Any:
        return self.torch.from_numpy(ids.astype(np.int64))

    def step(self, ids: Any) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(loss.detach())


def hf_state(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The reference's GPT-2 weights under transformers' names (its Conv1D weights are laid out (in, out) too)."""
    blocks = {k: np.asarray(v, np.float32) for k, v in params["blocks"].items()}
    state = {
        "transformer.wte.weight": np.asarray(params["wte"], np.float32),
        "transformer.wpe.weight": np.asarray(params["wpe"], np.float32),
        "transformer.ln_f.weight": np.asarray(params["lnf_g"], np.float32),
        "transformer.ln_f.bias": np.asarray(params["lnf_b"], np.float32),
    }
    for i in range(blocks["wq"].shape[0]):
        h = f"transformer.h.{i}."
        state[h + "ln_1.weight"], state[h + "ln_1.bias"] = blocks["ln1_g"][i], blocks["ln1_b"][i]
        state[h + "ln_2.weight"], state[h + "ln_2.bias"] = blocks["ln2_g"][i], blocks["ln2_b"][i]
        state[h + "attn.c_attn.weight"] = np.concatenate([blocks[f"w{n}"][i] for n in "qkv"], axis=1)
        state[h + "attn.c_attn.bias"] = np.concatenate([blocks[f"b{n}"][i] for n in "qkv"])
        state[h + "attn.c_proj.weight"], state[h + "attn.c_proj.bias"] = blocks["wo"][i], blocks["bo"][i]
        state[h + "mlp.c_fc.weight"], state[h + "mlp.c_fc.bias"] = blocks["w_up"][i], blocks["b_up"][i]
        state[h + "mlp.c_proj.weight"], state[h + "mlp.c_proj.bias"] = blocks["w_down"][i], blocks["b_down"][i]
    return {k: np.ascontiguousarray(v) for k, v in state.items()}


def hf_decay(decay: dict[str, Any], layers: int) -> dict[str, bool]:
    """Which of transformers' parameter names get weight decay: the reference's (so our) choice, renamed."""
    b = {k: bool(v) for k, v in decay["blocks"].items()}
    if b["wq"] != b["wk"] or b["wq"] != b["wv"] or b["bq"] != b["bk"] or b["bq"] != b["bv"]:
        raise SystemExit("q, k and v decay differently in ours: the fused c_attn of GPT-2 cannot follow")
    names = {
        "transformer.wte.weight": bool(decay["wte"]),
        "transformer.wpe.weight": bool(decay["wpe"]),
        "transformer.ln_f.weight": bool(decay["lnf_g"]),
        "transformer.ln_f.bias": bool(decay["lnf_b"]),
    }
    per_layer = {
        "ln_1.weight": b["ln1_g"],
        "ln_1.bias": b["ln1_b"],
        "ln_2.weight": b["ln2_g"],
        "ln_2.bias": b["ln2_b"],
        "attn.c_attn.weight": b["wq"],
        "attn.c_attn.bias": b["bq"],
        "attn.c_proj.weight": b["wo"],
        "attn.c_proj.bias": b["bo"],
        "mlp.c_fc.weight": b["w_up"],
        "mlp.c_fc.bias": b["b_up"],
        "mlp.c_proj.weight": b["w_down"],
        "mlp.c_proj.bias": b["b_down"],
    }
    for i in range(layers):
        names.update({f"transformer.h.{i}.{k}": v for k, v in per_layer.items()})
    return names
