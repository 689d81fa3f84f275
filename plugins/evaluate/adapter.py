"""``CrosstrainLM``: a crosstrain GPT (a live training module or a loaded checkpoint) as lm-eval's model API.

It follows lm-eval's own ``HFLM`` (lm_eval/models/huggingface.py) wherever the result depends on it, so a run and
its ``crosstrain export --format hf`` folder score the same: the context/continuation split of
``TemplateLM._encode_pair``, the left truncation to ``max_length + 1`` tokens, ``is_greedy`` as "every
continuation token is the argmax", and the rolling windows of ``loglikelihood_rolling``. Generation is
:func:`crosstrain.generation.generate` under the reference kernels, what ``crosstrain generate`` runs, greedy,
cut at the first ``until`` string.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models, lazily: a registry holding only ours would hide them)
import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from torch import nn

from crosstrain.errors import ConfigError

#: rolling windows and empty contexts start from this token when the tokenizer has no EOS (the byte tokenizer):
#: NUL, a byte that text never holds.
NO_EOS_PREFIX = 0


@register_model("crosstrain")
class CrosstrainLM(TemplateLM):
    """``model``: a crosstrain GPT (or a wrapper :func:`crosstrain.generation.sharded.unwrap` sees through);
    ``tokenizer``: its metadata dict (``crosstrain.plugins.export.loading.tokenizer_metadata``)."""

    def __init__(self, model: nn.Module, tokenizer: dict[str, Any], max_length: int, batch_size: int = 16,
                 autocast: Any = None) -> None:
        super().__init__()
        self.model = model
        self.tokenizer_info = tokenizer
        self._max_length = max_length
        self.batch_size = batch_size
        self._autocast = autocast
        self._device = next(model.parameters()).device

    @classmethod
    def from_run(cls, path: str, best: bool = False, batch_size: int = 16) -> CrosstrainLM:
        """A run dir, checkpoint, .safetensors file or HF folder, loaded as ``crosstrain generate`` loads it (a
        fp32 GPT on CPU, :func:`crosstrain.plugins.export.loading.load_model`)."""
        from crosstrain.plugins.export.loading import load_model

        loaded = load_model(path, best=best)
        return cls(loaded.model, loaded.tokenizer, max_length=int(loaded.config.max_seq_len), batch_size=batch_size)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> CrosstrainLM:
        """``lm_eval.simple_evaluate(model="crosstrain", model_args={"path": RUN, "best": False},
        batch_size=N, device=D)`` (``import crosstrain.plugins.evaluate.adapter`` registers the name)."""
        args = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None}}
        unknown = sorted(set(args) - {"path", "best", "batch_size", "device", "max_batch_size"})
        if "path" not in args or unknown:
            raise ConfigError(f"model_args {arg_dict!r}: pass path=RUN_DIR_OR_CHECKPOINT (and optionally best, "
                              f"batch_size, device){'; unknown ' + ', '.join(unknown) if unknown else ''}")
        best = args.get("best", False)
        lm = cls.from_run(str(args["path"]), best=best in (True, "True", "true", "1"),
                          batch_size=int(args.get("batch_size") or 16))
        if args.get("device"):
            lm.model.to(args["device"])
            lm._device = torch.device(args["device"])
        return lm

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> CrosstrainLM:
        """``model_args="path=RUN[,best=True]"``."""
        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    # -- tokenizer ------------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer_info.get("eos_id")
        return NO_EOS_PREFIX if eos is None else int(eos)

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        from crosstrain.plugins.export.generate import encode

        return encode(self.tokenizer_info, string)

    def tok_decode(self, tokens: list[int]) -> str:
        from crosstrain.plugins.export.generate import decode

        return decode(self.tokenizer_info, tokens)

    # -- scoring --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """fp32 logits ``[B, T, vocab]`` of right-padded ``rows`` (causal: padding never reaches earlier tokens)."""
        from crosstrain.kernels import registry as kernel_registry

        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        was_training = self.model.training
        self.model.eval()
        try:
            with kernel_registry.use_reference(), (self._autocast() if self._autocast else nullcontext()):
                return self.model(ids.to(self._device)).float().cpu()
        finally:
            self.model.train(was_training)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, override_bs: int | None = None) -> list[tuple[float, bool]]:
        """Sum of the continuation's token log-probs and whether greedy decoding yields it (HFLM's inputs: the last
        ``max_length + 1`` tokens of context + continuation, minus the last)."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
            logprobs = F.log_softmax(self._logits(rows), dim=-1)
            for row, i in zip(range(len(chunk)), chunk, strict=True):
                cont = requests[i][2]
                n = len(rows[row])
                picked = logprobs[row, n - len(cont) : n]
                target = torch.tensor(cont, dtype=torch.long)
                greedy = bool((picked.argmax(-1) == target).all())
                value = float(picked.gather(-1, target[:, None]).sum())
                out[i] = (value, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (value, greedy))
        return [o for o in out if o is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings in disjoint windows of ``max_length`` (HFLM's windows, context 1)."""
        results = []
        for (string,) in [req.args for req in requests]:
            windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])  # type: ignore[misc]
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            results.append(total)
        return results

    # -- generation -----------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, ending at EOS, ``max_gen_toks`` or before the first ``until``."""
        from crosstrain.generation import GenerationConfig, generate
        from crosstrain.kernels import registry as kernel_registry

        results = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = dict(gen_kwargs)
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise ConfigError("the crosstrain lm-eval model decodes greedily only; set the task's "
                                  "generation_kwargs to do_sample: false, temperature: 0")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            context_ids = self.tok_encode(context)[-(self.max_length - max_new):] if max_new < self.max_length \
                else []
            if not context_ids:
                raise ConfigError(f"max_gen_toks={max_new} leaves no room for the context in the model's "
                                  f"max_seq_len {self.max_length}; lower the task's max_gen_toks")
            eos = self.tokenizer_info.get("eos_id")
            config = GenerationConfig(max_new_tokens=max_new, greedy=True,
                                      stop_tokens=() if eos is None else (int(eos),))
            was_training = self.model.training
            self.model.eval()
            try:
                with kernel_registry.use_reference(), torch.inference_mode():
                    gen = generate(self.model, [context_ids], config)
            finally:
                self.model.train(was_training)
            new = gen.tokens[0, : int(gen.lengths[0])].tolist()
            if eos is not None and new and new[-1] == int(eos):
                new = new[:-1]
            text = self.tok_decode(new)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results

