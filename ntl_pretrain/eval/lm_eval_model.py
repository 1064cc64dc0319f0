"""`ShardedLM`: an lm-evaluation-harness model backed by the running (or a checkpoint's) sharded model.

lm-eval's own Hugging Face backend (`HFLM`) needs the whole model on one device; this class scores and generates on
the project's DeepSpeed ZeRO-3 + AutoTP (vocabulary-parallel head) + data-parallel engine, as the arithmetic and
GSM8K benchmarks generate (`eval.generate`):

- every rank of the world calls each method with the same requests (lm-eval builds them identically on every
  rank: the class tells lm-eval it runs in a world of one, so lm-eval neither splits nor gathers);
- requests are split into contiguous chunks over the data-parallel ranks (`generate.prompt_share`; the tensor-
  parallel peers of a rank hold the same chunk) and the results gathered, so every rank returns them all;
- ZeRO-3 gathers parameters inside every forward and AutoTP all-reduces activations, so every rank runs the same
  number of forwards: ranks agree once per batch whether any still has work, and one without runs a 1-token idle
  forward;
- a vocabulary-parallel head gives each TP rank its slice of the logits: a continuation's log-probability is the
  target logit minus the full-vocabulary log-sum-exp (`loss.parallel.reduce_shard_rows`, the loss's own
  reduction), and "is greedy" compares with the global argmax (`generate.global_argmax`, lowest id on ties).

Tokenization, truncation and the request semantics are HFLM's (lm-eval 0.4.13), so the results equal HFLM's on the
exported model: `tok_encode` adds special tokens as HFLM does (`add_bos_token` None: the tokenizer's default), a
context+continuation longer than `max_length + 1` tokens keeps its end, rolling log-likelihoods use lm-eval's
windows, and generation is greedy up to a stop string, the EOS token or `max_gen_toks`. Log-probabilities are
computed in float32 (HFLM computes them in the model's dtype).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.distributed as dist
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import has_bos_prefix, normalize_gen_kwargs, resolve_max_length

from ntl_pretrain.eval.generate import (_any_rank_flag, _model_device, _rank_and_size, data_parallel_group,
                                        global_argmax, greedy_generate, prompt_share, unwrap_model)
from ntl_pretrain.loss.parallel import NumberColumns, reduce_shard_rows
from ntl_pretrain.loss.shard import vocab_shard_of

# HFLM's default answer budget for requests whose task names none
DEFAULT_MAX_GEN_TOKS = 256

# A request for `_loglikelihood_tokens`: (the strings or None, context token ids, continuation token ids).
TokenRequest = tuple[Any, list[int], list[int]]


class ShardedLM(TemplateLM):
    """lm-eval's model interface on a (sharded) causal LM: a DeepSpeed engine or a plain module.

    `batch_size`: requests scored or prompts decoded together on each data-parallel rank. `max_length`: the
    window in tokens (0: the model's, as HFLM finds it). `add_bos_token`: HFLM's (None: the tokenizer's default).
    `dp_group`: the group requests are split over (None: the engine's data-parallel group). `tp_group`: the group
    of a vocabulary-parallel head (None: the head's own).
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 16, max_length: int = 0,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None, dp_group: Any = None,
                 tp_group: Any = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.module = unwrap_model(model)
        self.batch_size = batch_size
        self.add_bos_token = add_bos_token
        self._max_gen_toks = max_gen_toks
        self._max_length = max_length or resolve_max_length(self.module.config, tokenizer)
        self.shard = vocab_shard_of(model)
        if tp_group is not None:
            self.shard = replace(self.shard, tp_group=tp_group)
        self.dp_group = data_parallel_group(model, dp_group)
        self.model_device = _model_device(model)  # (LM.device is a read-only property)
        self._no_numbers = NumberColumns(torch.zeros(0, dtype=torch.long, device=self.model_device),
                                         torch.zeros(0, dtype=torch.long, device=self.model_device))

    # lm-eval's model properties -----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context becomes: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """HFLM's encoding: `add_special_tokens`, else `add_bos_token`, else the tokenizer's default; never a second
        BOS before a string that starts with one."""
        special = self._special_tokens(string, add_special_tokens)
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _special_tokens(self, string: str, add_special_tokens: bool | None = None) -> dict[str, bool]:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        if has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            return {"add_special_tokens": False}
        return {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}

    # scoring ------------------------------------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's encoding of (context, continuation) pairs, without its progress bar on every rank."""
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding gives it) per request, in order, the same
        on every rank; every rank calls this with the same requests (collectives)."""
        dp_rank, dp_size = _rank_and_size(self.dp_group)
        mine = list(prompt_share(len(requests), dp_rank, dp_size))
        windows: dict[int, tuple[list[int], int]] = {}
        for index in mine:
            _, context, continuation = requests[index]
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(f"request {index} has {len(context)} context and {len(continuation)} continuation "
                                 f"tokens; lm-eval gives both non-empty and the continuation within max_length "
                                 f"({self.max_length})")
            # as HFLM: the last max_length + 1 tokens, the last one only a target
            whole = (context + continuation)[-(self.max_length + 1):]
            windows[index] = (whole, len(continuation))
        # longest first (as HFLM), so a batch holds similar lengths
        mine.sort(key=lambda i: (-len(windows[i][0]), i))
        queue = [mine[start:start + self.batch_size] for start in range(0, len(mine), self.batch_size)]
        results: dict[int, tuple[float, bool]] = {}
        self._forward_batches(queue, lambda batch: results.update(self._score_batch(batch, windows)))
        return self._gather(results, len(requests))

    def _forward_batches(self, queue: list[list[int]], score: Any) -> None:
        """Run `score(batch)` on each of this rank's batches; a rank out of batches runs idle 1-token forwards
        until every rank is done (one all-reduce over the world per batch)."""
        pad_id = self._pad_id()
        idle_input = torch.full((1, 1), pad_id, dtype=torch.long, device=self.model_device)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                while _any_rank_flag(bool(queue), self.model_device):
                    if queue:
                        score(queue.pop(0))
                    else:
                        self.module(input_ids=idle_input, use_cache=False)
        finally:
            self.module.train(was_training)

    def _score_batch(self, batch: list[int], windows: dict[int, tuple[list[int], int]]) -> dict[int, tuple[float, bool]]:
        """One right-padded forward of `batch` (causal attention: padding after a row changes none of its logits,
        as in HFLM); the continuation positions' log-probabilities over the whole (possibly split) vocabulary."""
        width = max(len(windows[i][0]) - 1 for i in batch)
        ids = torch.full((len(batch), width), self._pad_id(), dtype=torch.long)
        rows, positions, targets = [], [], []
        for row, index in enumerate(batch):
            whole, continuation_length = windows[index]
            inputs = whole[:-1]
            ids[row, :len(inputs)] = torch.tensor(inputs, dtype=torch.long)
            first = len(inputs) - continuation_length
            rows += [row] * continuation_length
            positions += range(first, len(inputs))
            targets += whole[-continuation_length:]
        logits = self.module(input_ids=ids.to(self.model_device), use_cache=False).logits
        picked = logits[torch.tensor(rows, device=self.model_device), torch.tensor(positions, device=self.model_device)]
        target_ids = torch.tensor(targets, dtype=torch.long, device=self.model_device)
        columns, owned = self.shard.local_targets(target_ids, picked.shape[-1], ignore_index=-100)
        shift, table, _ = reduce_shard_rows(picked, self._no_numbers, 0, columns, owned, self.shard.tp_group)
        token_logprobs = (table[:, 1] - shift - table[:, 0].log()).float().cpu()
        greedy = (global_argmax(picked, self.shard) == target_ids).cpu()
        scored, offset = {}, 0
        for index in batch:
            count = windows[index][1]
            scored[index] = (float(token_logprobs[offset:offset + count].sum()),
                             bool(greedy[offset:offset + count].all()))
            offset += count
        return scored

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string, in lm-eval's disjoint windows of max_length tokens (each after
        the prefix token or the previous window's last token); all windows of all requests scored in one pass."""
        windows: list[TokenRequest] = []
        counts = []
        for (string,) in (request.args for request in requests):
            rolling = lm_eval_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                              prefix_token=self.prefix_token_id,
                                                              max_seq_len=self.max_length, context_len=1)
            own = [(None, *lm_eval_utils.make_disjoint_window(window)) for window in rolling]
            windows += own
            counts.append(len(own))
        scores = self._loglikelihood_tokens(windows)
        totals, offset = [], 0
        for count in counts:
            totals.append(sum(logprob for logprob, _ in scores[offset:offset + count]))
            offset += count
        return totals

    # generation ---------------------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (`generate.greedy_generate`), each cut before its first stop string; a request
        that asks to sample is refused (every rank raises the same error)."""
        prompts, budgets, stops = [], [], []
        for context, gen_kwargs in (request.args for request in requests):
            settings = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if settings.get("do_sample"):
                raise ValueError(f"a request asks to sample ({gen_kwargs}); ShardedLM decodes greedily: set the task's "
                                 f"generation_kwargs do_sample: false")
            budget = int(settings["max_gen_toks"])
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks={budget} leaves no room for a prompt within max_length "
                                 f"{self.max_length}; lower the task's max_gen_toks or raise eval.max_length")
            prompts.append(context)
            budgets.append(budget)
            stops.append([stop for stop in settings.get("until", []) if stop])
        texts: list[str] = [""] * len(prompts)
        # HFLM adds no second BOS before a context that starts with one; the others as add_bos_token says
        after_bos = [has_bos_prefix(prompt, self.tokenizer.bos_token) for prompt in prompts]
        for starts_with_bos in (False, True):
            chosen = [i for i, flag in enumerate(after_bos) if flag == starts_with_bos]
            if not chosen:
                continue  # the same on every rank: every rank builds the same requests
            output = greedy_generate(self.model, self.tokenizer, [prompts[i] for i in chosen],
                                     max_new_tokens=[budgets[i] for i in chosen], stop=[stops[i] for i in chosen],
                                     batch_size=self.batch_size, max_length=self.max_length,
                                     add_special_tokens=False if starts_with_bos else self.add_bos_token,
                                     dp_group=self.dp_group, tp_group=self.shard.tp_group)
            for i, text in zip(chosen, output.texts):
                texts[i] = text
        return texts

    # helpers ------------------------------------------------------------------------------------------------------

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is not None:
            return pad
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    def _gather(self, results: dict[int, tuple[float, bool]], count: int) -> list[tuple[float, bool]]:
        """Every request's result on every rank, in order (all-gather over the data-parallel group)."""
        if dist.is_available() and dist.is_initialized():
            parts: list[Any] = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(parts, results, group=self.dp_group)
            results = {index: value for part in parts for index, value in part.items()}
        missing = [i for i in range(count) if i not in results]
        if missing:
            raise RuntimeError(f"the data-parallel ranks scored no result for requests {missing[:10]}: the group "
                               f"passed as dp_group does not cover every chunk; pass the model's data-parallel group")
        return [results[i] for i in range(count)]
