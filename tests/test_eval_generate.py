"""Single-process evaluation: cached batched greedy decoding against a naive reference, a toy model that has
learnt single-digit addition evaluated through the hook, TensorBoard tags and the predictions JSONL."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from helpers.models import char_tokenizer, eval_llama
from helpers.tensorboard import scalars, tensor_tags
from ntl_pretrain.eval.arithmetic import generate_problems, is_interpolation_problem, make_problem
from ntl_pretrain.eval.config import EvalConfig
from ntl_pretrain.eval.generate import global_argmax, greedy_generate, truncate_at_stop
from ntl_pretrain.loss import VocabShard
from ntl_pretrain.eval.hooks import predictions_path, run_evaluation

def naive_greedy(model, tokenizer, prompt: str, max_new_tokens: int, stop=(), prefix_ids=(),
                 **encode) -> tuple[str, float]:
    """Reference decoding: no cache, no padding, one prompt at a time, full forward every step, `prefix_ids`
    before the encoded prompt.

    Also returns the smallest gap between the best and second-best logit seen, so a caller can check that
    its comparison is not decided by float round-off."""
    ids = [*prefix_ids, *tokenizer(prompt, **encode)["input_ids"]]
    generated: list[int] = []
    smallest_gap = math.inf
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids + generated])).logits[0, -1]
        top = torch.topk(logits, 2).values
        smallest_gap = min(smallest_gap, float(top[0] - top[1]))
        token = int(torch.argmax(logits))
        if token == tokenizer.eos_token_id:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if any(s in text for s in stop):
            break
    text = tokenizer.decode(generated, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return (text[:min(cuts)] if cuts else text), smallest_gap


PROMPTS = ["12+3=", "a", "hello world 123*45=", "7-8=", "q: what?", "1", "zz", "the answer is"]


def test_batched_cached_generation_matches_naive_reference():
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=0, initializer_range=0.3)
    max_new = [1, 20, 3, 12, 30, 7, 25, 16]
    stop = ["?", "zz"]
    expected = [naive_greedy(model, tokenizer, p, m, stop)[0] for p, m in zip(PROMPTS, max_new)]
    for batch_size in (1, 3, 8):
        output = greedy_generate(model, tokenizer, PROMPTS, max_new_tokens=max_new, stop=stop, batch_size=batch_size)
        assert output.texts == expected, f"batch_size={batch_size}"
    assert output.new_tokens > 0 and output.forward_passes > 0
    assert not model.training
    # With prefix tokens before every prompt (the arithmetic benchmark's EOS): the same as the reference given them.
    prefix = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("q")]
    expected = [naive_greedy(model, tokenizer, p, m, stop, prefix_ids=prefix)[0] for p, m in zip(PROMPTS, max_new)]
    output = greedy_generate(model, tokenizer, PROMPTS, max_new_tokens=max_new, stop=stop, batch_size=3,
                             prefix_ids=prefix)
    assert output.texts == expected


def test_generation_stops_at_eos_and_respects_zero_budget():
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=1, initializer_range=0.3)
    free_run, _ = naive_greedy(model, tokenizer, "12", 12)
    assert len(set(free_run)) > 2, free_run
    # Declare the third generated character the end-of-sequence token: decoding must stop just before it.
    stop_char = free_run[2]
    tokenizer.eos_token = stop_char
    output = greedy_generate(model, tokenizer, ["12", "3+4="], max_new_tokens=[12, 0])
    assert output.texts == [free_run[:free_run.index(stop_char)], ""]
    assert output.new_tokens == free_run.index(stop_char)


def test_all_tied_logits_pick_the_lowest_id():
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=1, initializer_range=0.3)
    with torch.no_grad():
        model.model.norm.weight.zero_()  # hidden states become 0, so every logit is exactly 0
    assert torch.all(model(torch.tensor([[5, 6]])).logits == 0)
    output = greedy_generate(model, tokenizer, ["12"], max_new_tokens=5)
    # id 0 is <pad>: five of them are generated (it is not EOS) and decode to nothing.
    assert output.texts == [""] and output.new_tokens == 5


def test_global_argmax_breaks_ties_by_lowest_id():
    """On one process (the shard is the whole vocabulary); the offset of a shard's ids by its start is
    checked over a real TP group in test_eval_distributed.py."""
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    assert global_argmax(logits, VocabShard()).tolist() == [1, 0, 2]
    assert global_argmax(logits, VocabShard(width=4)).tolist() == [1, 0, 2]


def test_truncate_at_stop_cuts_at_earliest_stop():
    assert truncate_at_stop("42\n\nQuestion: next", ("Question:", "\n\n")) == ("42", True)
    assert truncate_at_stop("no stop here", ("Q:",)) == ("no stop here", False)


def test_prompts_longer_than_the_model_keep_their_end():
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=2, initializer_range=0.3, max_positions=16)
    long_prompt = "abcdefghijklmnopqrstuvwxyz" * 2 + "1+2="
    output = greedy_generate(model, tokenizer, [long_prompt], max_new_tokens=4)
    expected, _ = naive_greedy(model, tokenizer, long_prompt[-12:], 4)  # 16 positions - 4 new tokens
    assert output.texts == [expected]


def test_truncation_is_warned_with_the_numbers_and_no_room_is_refused(caplog):
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=2, initializer_range=0.3, max_positions=16)
    long_prompt = "abcdefghijklmnopqrstuvwxyz" * 2 + "1+2="  # 56 tokens
    with caplog.at_level("WARNING", logger="ntl_pretrain.eval.generate"):
        output = greedy_generate(model, tokenizer, [long_prompt, "1+2="], max_new_tokens=4)
    assert output.truncated_prompts == 1
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "1 of this rank's 2 prompts" in warning and "56 tokens, kept 12" in warning, warning
    # The demo's case: max_new_tokens equal to max_position_embeddings left 1 prompt token, silently.
    with pytest.raises(ValueError, match=r"max_new_tokens=16 leaves no room for the prompt within 16 tokens "
                                         r"\(the model's max_position_embeddings\)"):
        greedy_generate(model, tokenizer, [long_prompt], max_new_tokens=16)
    with pytest.raises(ValueError, match=r"within 8 tokens \(max_length\)"):
        greedy_generate(model, tokenizer, ["1"], max_new_tokens=9, max_length=8)


def test_generation_rejects_bad_arguments():
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer))
    with pytest.raises(ValueError, match="one per prompt"):
        greedy_generate(model, tokenizer, ["1", "2"], max_new_tokens=[3])
    with pytest.raises(ValueError, match="batch_size=0"):
        greedy_generate(model, tokenizer, ["1"], max_new_tokens=3, batch_size=0)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        greedy_generate(model, tokenizer, [""], max_new_tokens=3)


# ------------------------------------------------------------------ a toy model that has learnt an arithmetic task
@pytest.fixture(scope="module")
def addition_model():
    """A tiny Llama trained (plain torch, full batch) on all 100 single-digit additions "</s>a+b=c</s>", each
    after the EOS of the document before it as in a packed stream."""
    tokenizer = char_tokenizer("0123456789+-*=")
    model = eval_llama(len(tokenizer), seed=0)
    model.train()
    documents = [make_problem(a, b, "+") for a in range(10) for b in range(10)]
    eos = tokenizer.eos_token_id
    encoded = [[eos] + tokenizer(p.text)["input_ids"] + [eos] for p in documents]
    width = max(len(ids) for ids in encoded)
    inputs = torch.tensor([ids + [0] * (width - len(ids)) for ids in encoded])
    context = [1 + len(tokenizer(p.prompt)["input_ids"]) for p in documents]  # EOS + prompt: no loss
    labels = torch.tensor([[-100] * start + ids[start:] + [-100] * (width - len(ids))
                           for start, ids in zip(context, encoded)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(250):
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model, tokenizer


def _expected_scores(model, tokenizer, problems, max_new_tokens, prefix_ids=None):
    """Accuracy, parseable share and MAE computed here from the naive decoder, independently of the eval code;
    each prompt after `prefix_ids` (default: the EOS, as the benchmark's "document" prompt format does)."""
    prefix = [tokenizer.eos_token_id] if prefix_ids is None else prefix_ids
    outputs = [naive_greedy(model, tokenizer, p.prompt, max_new_tokens, ("\n",), prefix_ids=prefix)[0]
               for p in problems]
    values = [int(o) if o.lstrip("-").isdigit() else None for o in outputs]
    parsed = [(v, p.answer) for v, p in zip(values, problems) if v is not None]
    return {"accuracy": sum(v == g for v, g in parsed) / len(problems),
            "parseable": len(parsed) / len(problems),
            "mae": sum(abs(v - g) for v, g in parsed) / len(parsed) if parsed else math.nan}, outputs


def test_toy_addition_model_evaluates_to_known_accuracy(addition_model, tmp_path: Path):
    from torch.utils.tensorboard import SummaryWriter

    model, tokenizer = addition_model
    every_problem = [make_problem(a, b, "+") for a in range(10) for b in range(10)]
    learnt, _ = _expected_scores(model, tokenizer, every_problem, 4)
    assert learnt["accuracy"] == 1.0, "the toy model did not learn single-digit addition"

    held_out = sum(is_interpolation_problem(p) for p in every_problem)
    cfg = EvalConfig(arithmetic_n=held_out, arithmetic_ops=["+"], arithmetic_train_digits=[1, 1],
                     arithmetic_extrapolation_digits=[2, 2], arithmetic_max_new_tokens=4, batch_size=5,
                     samples_to_log=3)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    metrics = run_evaluation(model, tokenizer, cfg, step=7, output_dir=str(tmp_path), writer=writer)
    writer.close()

    assert metrics["eval/arith/interpolation/accuracy"] == 1.0
    assert metrics["eval/arith/interpolation/add/accuracy"] == 1.0
    assert metrics["eval/arith/interpolation/mae"] == 0.0
    assert metrics["eval/arith/interpolation/digit_accuracy"] == 1.0
    assert metrics["eval/arith/interpolation/n"] == held_out
    extrapolation = generate_problems("extrapolation", held_out, cfg.arithmetic_seed, ops=("+",),
                                      train_digits=(1, 1), extrapolation_digits=(2, 2))
    expected, outputs = _expected_scores(model, tokenizer, extrapolation, 4)
    for name in ("accuracy", "parseable", "mae"):
        got = metrics[f"eval/arith/extrapolation/{name}"]
        assert got == pytest.approx(expected[name], nan_ok=True), name

    # Every prediction on disk, in order, with prompt, output, extracted answer and gold.
    lines = [json.loads(line) for line in open(predictions_path(str(tmp_path), 7), encoding="utf-8")]
    assert len(lines) == 2 * held_out
    extrapolation_lines = [line for line in lines if line["split"] == "extrapolation"]
    assert [line["prompt"] for line in extrapolation_lines] == [p.prompt for p in extrapolation]
    assert [line["output"] for line in extrapolation_lines] == outputs
    assert [line["gold"] for line in extrapolation_lines] == [p.answer for p in extrapolation]
    assert all(set(line) >= {"prompt", "output", "extracted", "gold", "correct"} for line in lines)
    assert os.path.basename(predictions_path(str(tmp_path), 7)) == "step_0000007.jsonl"

    # TensorBoard: the scalars read back with tensorboard's own reader, plus the sample text.
    logged = scalars(tmp_path / "tb")
    for tag in ("eval/arith/interpolation/accuracy", "eval/arith/extrapolation/smape",
                "eval/arith/extrapolation/digit_accuracy", "eval/arith/interpolation/parseable"):
        assert tag in logged
        ((step, value),) = logged[tag]
        assert step == 7
        assert value == pytest.approx(metrics[tag], rel=1e-6)
    assert "eval/samples/arith/text_summary" in tensor_tags(tmp_path / "tb")


def test_arithmetic_prompt_formats_encode_as_documented(addition_model, tmp_path: Path):
    """"document" (the default) puts the EOS that precedes every packed training document before each prompt,
    except after training with data.document_mask (a document then starts alone); "plain" gives the prompt alone.
    A toy model trained only after an EOS tells the two apart."""
    from helpers.models import char_tokenizer

    model, tokenizer = addition_model
    problems = generate_problems("extrapolation", 40, 1234, ops=("+",), train_digits=(1, 1), extrapolation_digits=(2, 2))
    outputs = {}
    for name, prompt_format, document_mask, prefix in (("document", "document", False, [tokenizer.eos_token_id]),
                                                       ("plain", "plain", False, []),
                                                       ("document_mask", "document", True, [])):
        cfg = EvalConfig(arithmetic_n=40, arithmetic_splits=["extrapolation"], arithmetic_ops=["+"],
                         arithmetic_train_digits=[1, 1], arithmetic_extrapolation_digits=[2, 2],
                         arithmetic_max_new_tokens=4, arithmetic_prompt_format=prompt_format)
        run_evaluation(model, tokenizer, cfg, step=1, output_dir=str(tmp_path / name), document_mask=document_mask)
        lines = [json.loads(line) for line in open(predictions_path(str(tmp_path / name), 1), encoding="utf-8")]
        outputs[name] = [line["output"] for line in lines]
        assert outputs[name] == _expected_scores(model, tokenizer, problems, 4, prefix)[1]
    assert outputs["document"] != outputs["plain"], "the two formats gave the same outputs: the test cannot tell them apart"
    with pytest.raises(ValueError, match="arithmetic_prompt_format"):
        EvalConfig(arithmetic_prompt_format="chat")
    no_eos = char_tokenizer("0123456789+-*=")
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="arithmetic_prompt_format=plain"):
        run_evaluation(model, no_eos, EvalConfig(arithmetic_n=4, arithmetic_ops=["+"], arithmetic_train_digits=[1, 1],
                                                 arithmetic_extrapolation_digits=[2, 2]),
                       step=1, output_dir=str(tmp_path / "no_eos"))


def test_hook_runs_gsm8k_from_a_local_folder(addition_model, tmp_path: Path):
    model, tokenizer = addition_model
    data = tmp_path / "gsm"
    data.mkdir()
    # Made-up questions in GSM8K's format (the project copies no GSM8K problems); digits-only text suits the toy
    # tokenizer, whose unknown characters simply become <unk>.
    rows = [{"question": f"{a}+{b}", "answer": f"{a}+{b}={a + b}\n#### {a + b}"} for a, b in ((1, 2), (3, 4), (5, 1))]
    for split in ("train", "test"):
        with open(data / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    cfg = EvalConfig(arithmetic_n=0, gsm8k_path=str(data), num_fewshot=2, gsm8k_limit=2, gsm8k_max_new_tokens=3,
                     max_length=256)
    metrics = run_evaluation(model, tokenizer, cfg, step=3, output_dir=str(tmp_path))
    lines = [json.loads(line) for line in open(predictions_path(str(tmp_path), 3), encoding="utf-8")]
    assert len(lines) == 2 and metrics["eval/gsm8k/n"] == 2
    recomputed = sum(line["extracted"]["flexible-extract"] == line["gold"] for line in lines) / 2
    assert metrics["eval/gsm8k/flexible-extract/accuracy"] == recomputed
    assert lines[0]["gold"] == "3" and lines[0]["prompt"].endswith("Question: 1+2\nAnswer:")
    final = run_evaluation(model, tokenizer, cfg, step=4, output_dir=str(tmp_path), final=True)
    assert final["eval/gsm8k/n"] == 3  # the final evaluation uses the whole test split by default


def test_eval_config_validates_and_schedules():
    cfg = EvalConfig(every_n_steps=50)
    assert [step for step in range(0, 201) if cfg.is_due(step)] == [50, 100, 150, 200]
    assert cfg.is_due(13, final=True) and not EvalConfig(at_end=False).is_due(13, final=True)
    assert not EvalConfig().is_due(100)
    with pytest.raises(ValueError, match="arithmetic_extrapolation_digits"):
        EvalConfig(arithmetic_extrapolation_digits=[3, 6])
    with pytest.raises(ValueError, match="arithmetic_ops"):
        EvalConfig(arithmetic_ops=["/"])
    with pytest.raises(ValueError, match="gsm8k_variant"):
        EvalConfig(gsm8k_variant="gsm8k_fr")
    with pytest.raises(ValueError, match="batch_size"):
        EvalConfig(batch_size=0)
    with pytest.raises(ValueError, match="arithmetic_splits"):
        EvalConfig(arithmetic_splits=["train"])
