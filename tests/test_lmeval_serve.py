"""Issue 39, acceptance bullet 2: lm-evaluation-harness as a client of ``crosstrain serve``.

A tiny run is exported (``crosstrain export --format hf``) and served by a real ``crosstrain serve`` process on
127.0.0.1. On a local 60-item multiple-choice task YAML, lm-eval's ``local-completions`` model (loglikelihood
through ``/v1/completions`` with ``echo`` and ``logprobs``) must choose what lm-eval's ``hf`` model chooses on the
exported folder, item by item, and what ``crosstrain eval RUN --tasks`` chooses in process; a ``generate_until``
task through ``local-chat-completions`` must give ``crosstrain generate``'s greedy text on the rendered chat prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model, the reference
pytest.importorskip("fastapi")

from lm_eval_tasks import WORDS, gen_task, mc_task  # noqa: E402
from serve_process import serve_process  # noqa: E402

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.config import load_config  # noqa: E402
from crosstrain.engine import Trainer  # noqa: E402

TRAIN = ["logging.progress=none", "train.steps=400", "train.seq_len=64", "train.batch_size=8", "model.n_layers=1",
         "checkpoint.every=400", "eval.every=0"]
#: what lm-eval's own model gives on the exported folder and the served model must reproduce
ACC = ("acc", "acc_norm")


@pytest.fixture(scope="module", autouse=True)
def _offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        yield


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The run, its HF export, the task YAMLs and a live ``crosstrain serve`` process on the run."""
    root = tmp_path_factory.mktemp("lmeval_serve")
    Trainer(load_config(None, TRAIN), run_dir=root / "run").fit()
    args = [str(root / "run"), "--threads", "1", "--max-batch", "16", "--max-wait-ms", "2", "--model-name", "tiny"]
    with serve_process(args, root / "serve.stderr") as server:
        # the export and the task files are written while the server starts
        assert main(["export", str(root / "run"), "--format", "hf", "--out", str(root / "hf")]) == 0
        mc_task(root)
        import httpx

        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
        yield {"root": root, "url": f"{server.url}/v1", "hf": root / "hf", "context": model["context_length"]}


def _tasks(root: Path) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(root), include_defaults=False)


def _choice(sample: dict[str, Any]) -> int:
    scores = [r[0] for r in sample["filtered_resps"]]
    return max(range(len(scores)), key=scores.__getitem__)


def _by_doc(samples: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {s["doc_id"]: s for s in samples}


@pytest.fixture(scope="module")
def completions(served: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``local-completions`` on the multiple-choice task, through the live server."""
    args = {"model": "tiny", "base_url": f"{served['url']}/completions", "tokenizer": str(served["hf"]),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": served["context"],
            "max_retries": 1, "timeout": 120}
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_mc"], batch_size=16,
                                  log_samples=True, task_manager=_tasks(served["root"]))
    assert out is not None
    return out


def test_local_completions_on_serve_equal_lm_eval_hf_on_the_export(served: dict[str, Any],
                                                                    completions: dict[str, Any]) -> None:
    # the byte tokenizer has neither BOS nor EOS, and lm-eval's hf model decodes its prefix token to look for a BOS
    ref = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(served["hf"]), "dtype": "float32",
                                                          "prefix_token_id": 0, "device": "cpu"},
                                  tasks=["tiny_mc"], batch_size=16, log_samples=True,
                                  task_manager=_tasks(served["root"]))
    for metric in ACC:
        assert completions["results"]["tiny_mc"][f"{metric},none"] == ref["results"]["tiny_mc"][f"{metric},none"]
    mine, theirs = _by_doc(completions["samples"]["tiny_mc"]), _by_doc(ref["samples"]["tiny_mc"])
    assert sorted(mine) == sorted(theirs) == list(range(60))
    for doc, sample in theirs.items():
        assert _choice(mine[doc]) == _choice(sample), doc
        for (ll, greedy), (ref_ll, ref_greedy) in zip(mine[doc]["filtered_resps"], sample["filtered_resps"],
                                                      strict=True):
            assert ll == pytest.approx(ref_ll, abs=1e-4) and greedy == ref_greedy, doc
    # the task is not trivial for this model: not every item is right, not every item is wrong
    assert 0 < completions["results"]["tiny_mc"]["acc,none"] < 1


def test_crosstrain_eval_in_process_equals_the_served_scores(served: dict[str, Any], completions: dict[str, Any],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    mc = str(served["root"] / "mc.yaml")
    assert main(["eval", str(served["root"] / "run"), "--tasks", mc, "--json", "--log-samples"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for metric in ACC:
        assert ours["scores"][f"tiny_mc/{metric}"] == completions["results"]["tiny_mc"][f"{metric},none"]
    mine, served_samples = _by_doc(ours["samples"]["tiny_mc"]), _by_doc(completions["samples"]["tiny_mc"])
    assert sorted(mine) == sorted(served_samples)
    for doc, sample in served_samples.items():
        assert _choice(mine[doc]) == _choice(sample), doc


def _generated(run: Path, prompt: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "24", "--json"]) == 0
    return str(json.loads(capsys.readouterr().out)["text"])


def test_chat_generate_until_equals_crosstrain_generate(served: dict[str, Any],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from crosstrain.plugins.rlhf.data import GENERATION_PROMPT, render_messages
    from crosstrain.plugins.serve.chat import CHAT_STOPS

    def rendered(content: str) -> str:
        return render_messages([{"role": "user", "content": content}]) + GENERATION_PROMPT

    def reply(text: str, stops: tuple[str, ...]) -> str:  # the text before the first stop string, as served
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        return text[:cut]

    run = served["root"] / "run"
    # the stop string: two characters of the first prompt's reply (item 0) whose first occurrence is past its start,
    # so that reply is cut and still says something
    first = reply(_generated(run, rendered(f"The {WORDS[0]} and the"), capsys), CHAT_STOPS)
    pairs = [first[i:i + 2] for i in range(1, len(first) - 1) if first.find(first[i:i + 2]) >= 1]
    assert pairs, first
    until = pairs[len(pairs) // 2]
    task = gen_task(served["root"], until)
    out = lm_eval.simple_evaluate(model="local-chat-completions",
                                  model_args={"model": "tiny", "base_url": f"{served['url']}/chat/completions",
                                              "max_retries": 1, "timeout": 120},
                                  tasks=[str(task)], apply_chat_template=True, log_samples=True,
                                  task_manager=_tasks(served["root"]))
    samples = sorted(out["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == 6 and "exact_match,none" in out["results"]["tiny_gen"]
    cut = said = 0
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        assert gen_kwargs["until"] == [until]
        messages = json.loads(context[0])  # lm-eval's JsonChatStr: a named tuple holding the messages' JSON
        assert [m["role"] for m in messages] == ["user"]
        text = _generated(run, rendered(messages[0]["content"]), capsys)
        assert sample["filtered_resps"] == [reply(text, (until, *CHAT_STOPS))]
        cut += until in reply(text, CHAT_STOPS)
        said += bool(sample["filtered_resps"][0])
    assert cut >= 1 and said >= 1


def test_a_stop_token_generated_after_the_continuation_keeps_its_last_token_scored() -> None:
    """lm-eval sends context + continuation with ``echo``, ``max_tokens`` 1 and reads every log-prob but the last
    (the generated token). When that token is a stop token (EOS), it must still be listed, or the continuation's
    last token would silently leave the score. A real model, batch and job; lm-eval's own parser reads the reply."""
    import asyncio

    import torch
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from crosstrain.generation import ContinuousBatch, GenerationConfig, Sequence
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.serve.logprobs import completion_logprobs
    from crosstrain.plugins.serve.requests import Job
    from crosstrain.plugins.serve.versions import Codec

    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=1, max_seq_len=64)
    model.init_weights()
    model.eval()
    context, continuation = list(b"Ada found the"), list(b" lantern")
    prompt = [*context, *continuation]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)
    eos = int(ref[-1].argmax())  # the token the model picks next, declared its stop token
    loop = asyncio.new_event_loop()
    try:
        job = Job(prompt, GenerationConfig(max_new_tokens=1, greedy=True, stop_tokens=(eos,)), None, (),
                  Codec({"type": "byte"}).decode, loop, alternatives=1, score_prompt=True)
        seq = ContinuousBatch(model, 1).add(Sequence(prompt, job.config, tag=job, alternatives=1, score_prompt=True))
        assert not job.feed(seq) and seq.stopped and job.text == ""
        lp = completion_logprobs(job, echo=True)
    finally:
        loop.close()
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][-1] == pytest.approx(ref[-1, eos].item(),
                                                                                             abs=1e-5)
    (ll, greedy), = LocalCompletionsAPI.parse_logprobs({"choices": [{"index": 0, "logprobs": lp}]},
                                                       ctxlens=[len(context)])
    expected = sum(ref[i - 1, prompt[i]].item() for i in range(len(context), len(prompt)))
    assert ll == pytest.approx(expected, abs=1e-4)
    assert greedy == all(int(ref[i - 1].argmax()) == prompt[i] for i in range(len(context), len(prompt)))


def test_the_lm_eval_command_line_scores_the_same_through_serve(served: dict[str, Any], completions: dict[str, Any],
                                                                tmp_path: Path) -> None:
    """The same run as ``lm-eval --model local-completions ... --tasks mc.yaml`` (the harness's own command)."""
    args = (f"model=tiny,base_url={served['url']}/completions,tokenizer={served['hf']},tokenizer_backend=huggingface,"
            f"tokenized_requests=True,max_length={served['context']},max_retries=1")
    # the `lm-eval` script's own entry point, after `import crosstrain`: PyPI's torchvision (in the dev extra for the
    # vision plugin) is built against the CUDA torch and breaks `import transformers` on the CPU build unless
    # crosstrain's import hook (crosstrain.torchvision_compat) runs first; a torchvision that matches torch needs none
    cli = ["-c", "import sys, crosstrain; from lm_eval.__main__ import cli_evaluate; sys.argv[0] = 'lm-eval'; "
                 "sys.exit(cli_evaluate())"]
    proc = subprocess.run([sys.executable, *cli, "--model", "local-completions", "--model_args", args, "--tasks",
                           str(served["root"] / "mc.yaml"), "--batch_size", "16", "--output_path", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(next(tmp_path.glob("**/results_*.json")).read_text())["results"]["tiny_mc"]
    for metric in ACC:
        assert results[f"{metric},none"] == completions["results"]["tiny_mc"][f"{metric},none"]
