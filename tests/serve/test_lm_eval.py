"""lm-evaluation-harness's `local-completions` against a real `plainformer serve`, with the model_args of
docs/guide.md, offline, on tasks written here from the bundled corpus's held-out works: a loglikelihood task
(one context longer than the model's context), a multiple-choice task and a rolling (perplexity) task. Each
score lm-eval reports equals the model's own log-softmax in float64; a held-out slice scored as perplexity
equals `plainformer eval` on the same text within 1e-4 nats per token.

How the two perplexities meet: with max_length=T, lm-eval conditions a text's first token on the prefix token
("\\n", id 0: the last character of the blank line that precedes every document in the training stream),
then predicts the text in windows of T - 2 tokens, each after one token of context. `plainformer eval`
predicts every token of its split but the first, in windows of T, each after one. So the two agree on a text
of at most T - 2 tokens, given to eval with the "\\n" in front; and lm-eval's score of a text of whole windows
is `training.evaluation.validation_loss` with block_size T - 2 of "\\n" + text (its last window of a longer
text keeps more context)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plainformer as pf
from plainformer.cli import main
from plainformer.training.evaluation import validation_loss

from .conftest import TINY, Server

T = 128  # the run's context (TINY's --block-size), given to lm-eval as max_length
PREFIX_ID = 0  # custom_prefix_token_id: "\n", first of the sorted characters
MODEL = "default"  # the run's directory name, which the server serves it as


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny GPT trained for a few steps on the bundled corpus, so that its held-out works are in its vocabulary."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAINFORMER_CACHE", str(tmp / "cache"))
        assert main(["train", "--out", str(tmp / MODEL), "--no-progress", "--max-steps", "20", *TINY]) == 0
    return tmp / MODEL


@pytest.fixture(scope="module")
def held_out() -> str:
    """The first held-out work of the bundled corpus."""
    return next(pf.load_split().documents("val"))


def line_slice(text: str, start: int, length: int) -> str:
    """The first `length` characters of `text` from the first line start at or after `start` that begins a
    non-blank line and holds no document break (two blank lines), trailing whitespace dropped: what a text
    file holds as one document, as it is."""
    while True:
        start = text.index("\n", start - 1) + 1
        piece = text[start:start + length].rstrip()
        if not piece[:1].isspace() and "\n\n\n" not in "\n" + piece:
            return piece
        start += 1


@pytest.fixture(scope="module")
def reference(run) -> pf.GPT:
    return pf.load_model(run).double()


def greedy_text(model: pf.GPT, context: str, n: int) -> str:
    """The n characters the model picks greedily after `context` (float64)."""
    ids = model.tokenizer.encode(context)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    return model.tokenizer.decode(ids[-n:])


def write_tasks(directory: Path, held_out: str, model: pf.GPT) -> dict[str, list[dict]]:
    """Three lm-eval tasks (YAML, each over a JSON Lines file) from slices of the held-out work; their documents.
    A continuation the model picks greedily, and choices of common against rare characters, make the
    accuracies lm-eval reports neither 0 nor 1."""
    text, rare = held_out, "QZXJQZXJQZ"
    docs = {
        "pf_continuation": [{"context": text[200:260], "continuation": text[260:270]},
                            {"context": text[300:600], "continuation": text[600:612]},  # 300 + 12 tokens > T
                            {"context": text[400:460], "continuation": greedy_text(model, text[400:460], 3)}],
        "pf_choice": [{"context": text[700:760], "choices": [text[760:770], rare], "label": 0},
                      {"context": text[900:940], "choices": [text[940:950], rare, text[1940:1950]], "label": 1}],
        # one window (at most T - 2 tokens; the one plainformer eval also scores), and two whole windows
        "pf_rolling": [{"text": line_slice(text, 5000, T - 2)}, {"text": text[1000:1000 + 2 * (T - 2)]}],
    }
    fields = {"pf_continuation": ("loglikelihood", '"{{context}}"', '"{{continuation}}"', 'target_delimiter: ""\n',
                                  ["perplexity", "acc"]),
              "pf_choice": ("multiple_choice", '"{{context}}"', '"{{label}}"', 'doc_to_choice: "{{choices}}"\n',
                            ["acc"]),
              "pf_rolling": ("loglikelihood_rolling", '""', '"{{text}}"', "",
                             ["word_perplexity", "byte_perplexity", "bits_per_byte"])}
    for task, (output_type, doc_to_text, doc_to_target, extra, metrics) in fields.items():
        data = directory / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs[task]))
        metric_list = "".join(f"  - metric: {m}\n" for m in metrics)
        (directory / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {output_type}\ndoc_to_text: {doc_to_text}\n"
            f"doc_to_target: {doc_to_target}\n{extra}metric_list:\n{metric_list}")
    return docs


@pytest.fixture(scope="module")
def harness(run, held_out, reference, tmp_path_factory) -> dict:
    """docs/guide.md's lines: export the tokenizer's directory, serve the run, run `lm_eval` offline on the tasks
    of `write_tasks` with --log_samples. Returns {"results": ..., "samples": {task: [sample by doc_id]}, "docs"}."""
    tmp = tmp_path_factory.mktemp("harness")
    hf = tmp / "hf" / MODEL
    assert main(["export", "--ckpt", str(run), "--out", str(hf)]) == 0
    tasks = tmp / "tasks"
    tasks.mkdir()
    docs = write_tasks(tasks, held_out, reference)
    server = Server("--ckpt", str(run))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf_home"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model={MODEL},base_url={server.url}/completions,tokenizer={hf},max_length={T},"
                  f"custom_prefix_token_id={PREFIX_ID}")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
             "--tasks", ",".join(docs), "--include_path", str(tasks), "--output_path", str(tmp / "out"),
             "--log_samples"],
            env=env, capture_output=True, text=True, timeout=300)
    finally:
        code, out, err = server.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    assert code == 0 and "Traceback" not in err, err
    assert "context_length_exceeded" not in done.stderr  # no request was refused, so none was retried
    results = json.loads(next((tmp / "out").rglob("results_*.json")).read_text())["results"]
    samples = {task: sorted((json.loads(line) for path in (tmp / "out").rglob(f"samples_{task}_*.jsonl")
                             for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
               for task in docs}
    return {"results": results, "samples": samples, "docs": docs}


def token_logprobs(model: pf.GPT, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(ids[t] | ids[:t]), whether ids[t] is the argmax) for t = 1 .. len(ids) - 1, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0, :-1]  # (n - 1, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(ids[1:])
    return logprobs.gather(1, targets[:, None])[:, 0], logprobs.argmax(-1) == targets


def loglikelihood(model: pf.GPT, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval asks of a (context, continuation) with max_length=T: the continuation's summed logprob and
    whether it is greedy, the context cut from the left so that the request holds at most T - 1 tokens."""
    tokenizer = model.tokenizer
    n = len(tokenizer.encode(continuation))
    ids = (tokenizer.encode(context) + tokenizer.encode(continuation))[-(T - 1):]
    logprobs, greedy = token_logprobs(model, ids)
    return float(logprobs[-n:].sum()), bool(greedy[-n:].all())


def test_loglikelihoods_equal_the_models_own_with_long_contexts_cut_from_the_left(harness, reference):
    samples = harness["samples"]["pf_continuation"]
    expected = []
    for sample in samples:
        asked = sample["arguments"]["gen_args_0"]
        ll, greedy = loglikelihood(reference, asked["arg_0"], asked["arg_1"])
        got, got_greedy = sample["resps"][0][0]
        assert float(got) == pytest.approx(ll, abs=1e-5 * len(asked["arg_1"]))
        assert (got_greedy == "True") == greedy
        expected.append((ll, greedy))
    assert [s["arguments"]["gen_args_0"]["arg_1"] for s in samples] == [
        d["continuation"] for d in harness["docs"]["pf_continuation"]]  # as written: target_delimiter ""
    assert len(reference.tokenizer.encode(samples[1]["arguments"]["gen_args_0"]["arg_0"])) > T  # it was cut
    results = harness["results"]["pf_continuation"]
    mean = sum(ll for ll, _ in expected) / len(expected)
    assert results["perplexity,none"] == pytest.approx(math.exp(-mean), rel=1e-4)
    assert results["acc,none"] == sum(greedy for _, greedy in expected) / len(expected)
    assert 0 < results["acc,none"] < 1


def test_multiple_choice_scores_each_choice_as_the_model_does_and_picks_the_likeliest(harness, reference):
    samples, docs = harness["samples"]["pf_choice"], harness["docs"]["pf_choice"]
    correct = 0
    for sample, doc in zip(samples, docs, strict=True):
        asked = [sample["arguments"][f"gen_args_{i}"] for i in range(len(doc["choices"]))]
        assert [a["arg_1"] for a in asked] == [" " + c for c in doc["choices"]]  # lm-eval's target_delimiter
        expected = [loglikelihood(reference, a["arg_0"], a["arg_1"])[0] for a in asked]
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-5 * len(asked[0]["arg_1"]))
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["label"]
    assert harness["results"]["pf_choice"]["acc,none"] == correct / len(docs)
    assert 0 < correct < len(docs)


def test_rolling_perplexity_is_the_validation_loss_of_the_text_after_a_line_break(harness, reference):
    """Both documents, each against `validation_loss` in windows of T - 2 on "\\n" + text (the second spans two)."""
    samples = harness["samples"]["pf_rolling"]
    total_nll = total_bytes = 0.0
    for sample, doc in zip(samples, harness["docs"]["pf_rolling"], strict=True):
        ids = reference.tokenizer.encode(doc["text"])
        loss, count = validation_loss(reference, torch.tensor([PREFIX_ID, *ids]).numpy(), T - 2, 4)
        assert count == len(ids)
        assert -float(sample["resps"][0][0]) / count == pytest.approx(loss, abs=1e-5)
        total_nll, total_bytes = total_nll + loss * count, total_bytes + len(doc["text"].encode())
    bits_per_byte = harness["results"]["pf_rolling"]["bits_per_byte,none"]
    assert bits_per_byte == pytest.approx(total_nll / total_bytes / math.log(2), rel=1e-5)


def test_held_out_slice_perplexity_equals_plainformer_eval_on_the_same_text(harness, run, tmp_path, capsys,
                                                                           monkeypatch):
    """The slice (T - 2 characters of the held-out work from a line start) through lm-eval, and `plainformer eval` with
    --data a file whose validation split is "\\n" + that slice: the file's one document is filler without line
    breaks, then the slice after a blank line; for a split of L characters the file holds 10·L - 5, so that
    the split (10%: L - 0.5, cut at the line start before it, data.corpus.line_cut) begins at the blank line."""
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    text = harness["docs"]["pf_rolling"][0]["text"]
    split = "\n" + text
    filler = ("Speak, friend, and enter. " * len(split))[:9 * len(split) - 6]
    data = tmp_path / "held_out.txt"
    data.write_text(f"{filler}\n{split}\n")
    prepared = pf.prepare_lm_data(data, tokenizer=pf.load_model(run).tokenizer)
    assert prepared.tokenizer.decode(prepared.val_tokens) == split  # the split is the text, after its "\n"
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--data", str(data)]) == 0
    metrics = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert metrics["tokens"] == len(text)
    harness_nll = -float(harness["samples"]["pf_rolling"][0]["resps"][0][0]) / len(text)
    assert harness_nll == pytest.approx(metrics["val_loss"], abs=1e-4)
