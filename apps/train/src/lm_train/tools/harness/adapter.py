"""Our model behind lm-eval's LM interface: log-likelihoods from TokenScorer, generation with the KV cache.

It follows lm-eval's own conventions for a causal model (those of its TemplateLM base and its Hugging Face
backend): a context's trailing spaces join the continuation, an empty context is the EOS token, an input is
left-truncated to the last seq_len + 1 tokens, rolling log-likelihoods use lm-eval's own windows, and
generation stops at the task's `until` strings and at EOS. So the same checkpoint scores the same here and
through transformers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM

import named_tensors as nt
from lm_models import generate
from lm_train.run.mesh import MeshPlan
from lm_train.tools.harness.progress import HarnessProgress
from lm_train.tools.token_scoring import TokenScorer


class LmTrainLM(TemplateLM):
    """An lm-eval LM over a trained lm_models model, its tokenizer, and the mesh it lives on."""

    def __init__(self, model: Any, tokenizer: Any, eos_id: int, scorer: TokenScorer, plan: MeshPlan, seed: int = 0):
        super().__init__()
        self.model = model
        self.tokenizer_ = tokenizer
        self.eos_id = eos_id
        self.scorer = scorer
        self.plan = plan
        self.seed = seed
        self.progress: HarnessProgress | None = None  # set while lm-eval's `evaluate` runs

    # -- what TemplateLM needs -------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def max_length(self) -> int:
        return self.scorer.seq_len

    @property
    def tokenizer_name(self) -> str:
        return "lm-train"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = self.tokenizer_.encode(
            string, add_special_tokens=True if add_special_tokens is None else add_special_tokens
        ).ids
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer_.decode(list(ids), skip_special_tokens=True)

    def _begin(self, kind: str, requests: list) -> None:
        if self.progress is not None:
            self.progress.requests(kind, requests)

    def _report(self, positions: range | list[int]) -> None:
        if self.progress is not None:
            self.progress.scored(positions)

    def _score(self, rows: list[list[int]], done: Any = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """The scorer's results for `rows`, a batch at a time; `done(end)` after each batch, `end` rows scored."""
        scored = []
        for start in range(0, len(rows), self.scorer.batch_size):
            scored.extend(self.scorer.score(rows[start : start + self.scorer.batch_size]))
            if done is not None:
                done(len(scored))
        return scored

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's, with the requests counted for the progress line."""
        self._begin("loglikelihood", requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, done: Any = None, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log-probs of the continuation, whether greedy decoding gives it) for each request; `done`, as
        for `_score` (default: report the requests themselves as scored)."""
        rows, spans = [], []
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError("lm-eval sent a request with an empty context or continuation, or one too long")
            tokens = (context + continuation)[-(self.max_length + 1) :]
            rows.append(tokens)
            spans.append(len(continuation))
        reported = [0]

        def requests_done(end: int) -> None:
            self._report(range(reported[0], end))
            reported[0] = end

        scored = self._score(rows, done if done is not None else requests_done)
        out = []
        for (key, _, _), n, (log_probs, is_argmax) in zip(requests, spans, scored, strict=True):
            result = (float(np.sum(log_probs[-n:], dtype=np.float64)), bool(np.all(is_argmax[-n:])))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings, over lm-eval's disjoint windows of at most seq_len predictions."""
        self._begin("loglikelihood_rolling", requests)
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            token_windows = lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_eval_utils.make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(index)
        reported = [0]

        def strings_done(end: int) -> None:  # a string is done once its last window is
            complete = len(requests) if end == len(owners) else owners[end]
            self._report(range(reported[0], complete))
            reported[0] = max(reported[0], complete)

        totals = [0.0] * len(requests)
        for owner, (log_likelihood, _) in zip(
            owners, self._loglikelihood_tokens(windows, done=strings_done), strict=True
        ):
            totals[owner] += log_likelihood
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when do_sample) continuations cut at the first `until` string or EOS.

        Prompts of the same length and settings are generated as one batch on the mesh (lm_models.generate:
        KV-cached prefill, then a scanned decode), so each prompt length compiles once.
        """
        self._begin("generate_until", requests)
        eos_text = self.tokenizer_.decode([self.eos_id], skip_special_tokens=False)
        groups: dict[tuple, list[tuple[int, list[int], list[str]]]] = defaultdict(list)
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text not in until:
                until.append(eos_text)
            max_new = min(int(kwargs.pop("max_gen_toks", 256)), self.max_length - 1)
            sample = bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
            temperature = float(kwargs.get("temperature", 1.0)) if sample else 0.0
            prompt = self.tok_encode(context)[-(self.max_length - max_new) :] or [self.eos_id]
            groups[(len(prompt), max_new, temperature)].append((index, prompt, until))
        results: list[str] = [""] * len(requests)
        size = self.scorer.batch_size
        for (_, max_new, temperature), members in sorted(groups.items()):
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                new_tokens = self._generate([p for _, p, _ in chunk], max_new, temperature, size)
                for (index, _, until), tokens in zip(chunk, new_tokens, strict=False):
                    results[index] = self._cut(tokens, until)
                    self.cache_hook.add_partial("generate_until", requests[index].args, results[index])
                self._report([index for index, _, _ in chunk])
        return results

    def _generate(self, prompts: list[list[int]], max_new: int, temperature: float, size: int) -> np.ndarray:
        rows = np.asarray(prompts + [prompts[-1]] * (size - len(prompts)), np.int32)  # a full batch: one shape
        array = jax.make_array_from_callback(rows.shape, self.plan.batch_sharding(), lambda index: rows[index])
        ids = nt.NamedArray(array, (nt.Axis("batch", size), nt.Axis("position", rows.shape[1])))
        key = jax.random.key(self.seed) if temperature > 0 else None
        with nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            tokens = generate(self.model, ids, max_new, temperature=temperature, key=key)
        tokens = nt.permute(tokens, ("batch", "position")).array
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            tokens = multihost_utils.process_allgather(tokens, tiled=True)
        return np.asarray(jnp.asarray(tokens))[: len(prompts), rows.shape[1] :]

    def _cut(self, tokens: np.ndarray, until: list[str]) -> str:
        ids = tokens.tolist()
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        text = self.tok_decode(ids)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text
