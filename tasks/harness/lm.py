"""The project's model as an lm-evaluation-harness `LM`: FP32, BF16 or the INT8 artifact (torchao or AMCT modules),
run as it is through tasks.model.generate (KV cache), with the tokenizer it was trained with (`tokenizers`).

Semantics follow lm-eval 0.4.13's HFLM (lm_eval/models/huggingface.py) so that scores agree with it: the same
(context, continuation) encoding (TemplateLM._encode_pair), left truncation to max_length + 1 tokens, the
continuation's log-probabilities summed in fp32, greedy-match flags, rolling windows (utils.get_rolling_token_windows)
and greedy generation until a stop sequence (models.utils.normalize_gen_kwargs / handle_stop_sequences /
postprocess_generated_text). Where HFLM fails on an assertion or a 0-length input, or would decode otherwise, this
says so in one line or takes lm-eval's own rule: a continuation that adds no token to its context (StageError), a
generation kwarg greedy decoding cannot honour (greedy_problem: num_beams, repetition_penalty, max_length), an empty
prompt (the prefix token, as an empty context). Faster where it can be: requests that share a context (the choices
of a multiple-choice question) prefill it once and score every choice against that cache; the output projection runs
only on the positions that are scored.

Progress: lm-eval hands over every task's requests of one type at once; they run task by task, each with progress
lines (tasks.logs.Progress: `progress: evaluate INT8 demo-continuation request 600/1200 (50%), 410 requests/s, ETA
2s`) at the first and last batch and every `log_every` requests or 30 s, instead of lm-eval's tqdm bars.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from tasks.errors import StageError
from tasks.model.generate import hidden_cached


class ProjectLM(TemplateLM):
    backend = "causal"

    def __init__(
        self,
        model,
        tokenizer,
        device,
        batch_size: int = 16,
        max_length: int | None = None,
        label: str = "evaluate",
        log_every: int = 0,
    ):
        """`tokenizer`: a tasks.harness.models.TextTokenizer; `max_length`: default the model's max_seq_len;
        `label`: what the progress lines say is running ("evaluate INT8"); `log_every`: requests between them."""
        super().__init__()
        self.model = model.eval()
        self.tok = tokenizer
        self._device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length or model.config.max_seq_len
        self.label, self.log_every, self._task = label, log_every, None

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_gen_toks(self) -> int:
        return default_max_gen_toks(self.max_length)

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # as HFLM: no second BOS when the text already starts with one
            add_special_tokens = not (self.tok.bos_token and string.startswith(self.tok.bos_token))
        return self.tok.encode(string, add_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        # TemplateLM's (tokenize, then _loglikelihood_tokens) without its tqdm bar: our progress lines instead
        return self._each_task(requests, lambda reqs: TemplateLM.loglikelihood(self, reqs, disable_tqdm=True))

    def _each_task(self, requests, run) -> list:
        """`run` on each task's requests in turn (their progress lines name the task); answers in request order."""
        by_task = defaultdict(list)
        for i, req in enumerate(requests):
            by_task[getattr(req, "task_name", None)].append(i)
        out: list = [None] * len(requests)
        try:
            for task, idx in by_task.items():
                self._task = task
                for i, answer in zip(idx, run([requests[i] for i in idx])):
                    out[i] = answer
        finally:
            self._task = None
        return out

    def _meter(self, total: int, unit: str) -> "Meter":
        what = f"{self.label} {self._task}" if self._task else self.label
        return Meter(what, total, unit, self.log_every)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model.output(hidden).float(), dim=-1)

    def _score(self, hidden: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
        """hidden [n, dim]: the states that predict `cont` (n tokens) → (sum of log-probabilities, all greedy)."""
        logp = self._logprobs(hidden)
        target = torch.tensor(cont, device=logp.device)
        return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, unit: str = "request", **kwargs
    ) -> list[tuple[float, bool]]:
        """requests: [(cache key, context ids, continuation ids)] → [(log-probability, is greedy)] in order."""
        for key, ctx, cont in requests:
            if not cont:  # HFLM asserts here; scoring no token would read as probability 1, the choice always picked
                context, continuation = key if isinstance(key, tuple) and len(key) == 2 else ("", "")
                where = f"task {self._task}: " if self._task else ""
                raise StageError(
                    f"{self.label}: {where}the continuation {continuation!r} of the context "
                    f"...{context[-40:]!r} is no token of its own: the tokenizer merges it into the context's last "
                    "token (lm-eval scores the tokens after the context's); begin the task's choices with a separator "
                    "(target_delimiter, default ' ')"
                )
        meter = self._meter(len(requests), unit)
        out: list = [None] * len(requests)
        shared, plain = defaultdict(list), []
        for i, (_, ctx, cont) in enumerate(requests):
            if len(ctx) + len(cont) <= self.max_length + 1:  # no truncation: the context is a common prefix
                shared[tuple(ctx)].append(i)
            else:
                plain.append(i)
        for ctx, idx in shared.items():
            if len(idx) == 1:
                plain += idx
            else:
                self._shared_context(list(ctx), [(i, requests[i][2]) for i in idx], out, meter)
        self._plain(sorted(plain, key=lambda i: -len(requests[i][1]) - len(requests[i][2])), requests, out, meter)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    @torch.no_grad()
    def _shared_context(self, ctx: list[int], conts: list[tuple[int, list[int]]], out: list, meter) -> None:
        """Prefill ctx[:-1] once (batch 1), then every continuation as a row after that cache: row = ctx[-1] +
        cont[:-1], right-padded (padding after the real tokens is never attended to by them)."""
        cache: dict = {}
        start = len(ctx) - 1
        if start:
            hidden_cached(self.model, torch.tensor([ctx[:-1]], device=self._device), cache, 0)
        for j in range(0, len(conts), self.batch_size):
            chunk = conts[j : j + self.batch_size]
            width = max(len(c) for _, c in chunk)
            rows = torch.zeros(len(chunk), width, dtype=torch.long, device=self._device)
            for r, (_, cont) in enumerate(chunk):
                rows[r, : len(cont)] = torch.tensor([ctx[-1]] + cont[:-1])
            h = hidden_cached(self.model, rows, dict(cache), start)
            for r, (i, cont) in enumerate(chunk):
                out[i] = self._score(h[r, : len(cont)], cont)
            meter.advance(len(chunk))

    @torch.no_grad()
    def _plain(self, order: list[int], requests, out: list, meter) -> None:
        """Whole sequences, right-padded in batches (longest first, as HFLM), left-truncated to max_length + 1."""
        for j in range(0, len(order), self.batch_size):
            chunk = order[j : j + self.batch_size]
            seqs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1) :][:-1] for i in chunk]
            rows = torch.zeros(len(chunk), max(map(len, seqs)), dtype=torch.long, device=self._device)
            for r, s in enumerate(seqs):
                rows[r, : len(s)] = torch.tensor(s)
            h = hidden_cached(self.model, rows, {}, 0)
            for r, i in enumerate(chunk):
                cont = requests[i][2]
                out[i] = self._score(h[r, len(seqs[r]) - len(cont) : len(seqs[r])], cont)
            meter.advance(len(chunk))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self._each_task(requests, self._rolling)

    def _rolling(self, requests) -> list[float]:
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, unit="window")):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy, batched (left-padded prompts, KV cache), until a stop sequence, EOS or max_gen_toks."""
        return self._each_task(requests, self._generate)

    def _generate(self, requests) -> list[str]:
        meter = self._meter(len(requests), "request")
        batches = Collator(
            [req.args for req in requests],
            sort_fn=lambda x: (-len(self.tok_encode(x[0])), x[0]),
            group_by="gen_kwargs",
            group_fn=lambda x: x[1],
        )
        eos = self.tok.decode([self.eot_token_id], skip_special_tokens=False)
        res = []
        for chunk in batches.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            if problem := greedy_problem(kwargs):
                raise StageError(f"{self.label}: task {self._task or '(unnamed)'} {problem}")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen} is not below the model's context {self.max_length}")
            # an empty prompt (no BOS added) starts from the prefix token, as lm-eval's loglikelihood does for an
            # empty context (HFLM's generate fails on a 0-length input)
            prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-(self.max_length - max_gen) :] for c in contexts]
            for context, toks in zip(contexts, self._greedy(prompts, max_gen, until)):
                text = postprocess_generated_text(self.tok.decode(toks), until, None)
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
            meter.advance(len(chunk))
        return batches.get_original(res)

    @torch.no_grad()
    def _greedy(self, prompts: list[list[int]], max_gen: int, until: list[str]) -> list[list[int]]:
        width = max(map(len, prompts))
        pad = torch.tensor([width - len(p) for p in prompts], device=self._device)
        rows = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self._device)
        cache: dict = {}
        h = hidden_cached(self.model, rows, cache, 0, pad)
        gen = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_gen):
            nxt = self.model.output(h[:, -1]).argmax(-1)
            for r, t in enumerate(nxt.tolist()):
                if not done[r]:
                    gen[r].append(t)
                    done[r] = t == self.eot_token_id or any(s and s in self.tok.decode(gen[r]) for s in until)
            if all(done) or step == max_gen - 1:
                break
            h = hidden_cached(self.model, nxt[:, None], cache, width + step, pad)
        return gen


class Meter:
    """The progress lines of one model on one task: at the start, every `every` items (0: by time only) or 30 s, and
    at the last, with the rate so far (tasks.logs.Progress adds the ETA)."""

    def __init__(self, what: str, total: int, unit: str, every: int):
        from tasks.logs import Progress

        self.progress, self.unit = Progress(what, total, unit, every), unit
        self.done, self.t0 = 0, time.monotonic()
        if total:
            self.progress.update(0)

    def advance(self, n: int) -> None:
        self.done += n
        took = time.monotonic() - self.t0
        self.progress.update(self.done, **{f"{self.unit}s_per_s": self.done / took if took > 0 else None})


# Generation kwargs (after lm-eval's normalize_gen_kwargs) that greedy decoding honours as they are: sampling's own
# knobs do nothing without sampling (transformers ignores them with do_sample false, as HFLM runs it).
_GREEDY_NOOPS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p"}
_GREEDY_DEFAULTS = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


def greedy_problem(kwargs: dict) -> str | None:
    """Why this wrapper cannot run these normalized generation kwargs as lm-eval's HFLM would (None: it can). It
    decodes greedily until a stop sequence, EOS or max_gen_toks: sampling, a beam search, a repetition penalty or a
    total `max_length` would be ignored silently and score another decoding than the task asks for."""
    if kwargs.get("do_sample"):
        return (
            "samples (do_sample/temperature); the gate compares models on greedy decoding: set "
            "generation_kwargs.do_sample: false in its YAML"
        )
    for key, value in kwargs.items():
        if key in _GREEDY_NOOPS or (key in _GREEDY_DEFAULTS and value == _GREEDY_DEFAULTS[key]):
            continue
        fix = "give max_gen_toks (new tokens) instead" if key == "max_length" else "remove it from its YAML"
        return (
            f"generates with generation_kwargs.{key}: {value!r}, which the models' greedy decoding cannot honour (it "
            f"stops at until, EOS or max_gen_toks, nothing else); {fix}"
        )
    return None


def default_max_gen_toks(max_length: int) -> int:
    """HFLM's 256 new tokens, at most half of a smaller model's context."""
    return min(256, max_length // 2)
