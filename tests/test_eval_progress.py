"""Generation progress (tools/evaluate.py): what `greedy_generate` reports per decoding step, and how
`GenerationProgress` shows it (plain lines with a heartbeat when not on a terminal, a tqdm bar on one)."""

from __future__ import annotations

import io

from helpers.models import char_tokenizer, eval_llama
from ntl_pretrain.eval.generate import greedy_generate
from ntl_pretrain.eval.progress import GenerationProgress

PROMPTS = ["12+7=", "3*4=", "100-1=", "5+5=", "9*9=", "2+2="]


def test_generation_reports_batches_and_tokens_as_it_goes():
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=4, initializer_range=0.3)
    calls: list[tuple[int, int, int]] = []
    output = greedy_generate(model, tokenizer, PROMPTS, max_new_tokens=5, batch_size=4,
                             progress=lambda *call: calls.append(call))
    assert calls[0] == (0, 2, 0) and calls[-1] == (2, 2, output.new_tokens)  # the generation's own token count
    assert all(a[0] <= b[0] and a[2] <= b[2] for a, b in zip(calls, calls[1:]))  # never backwards
    assert len(calls) == output.forward_passes + 1


def test_plain_lines_every_n_batches_and_a_heartbeat_while_one_runs():
    stream = io.StringIO()
    progress = GenerationProgress("gsm8k", bar=False, every=2, heartbeat_s=3600, stream=stream)
    for done in range(5):
        progress(done, 4, 10 * done)
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["eval gsm8k: 2/4 batches", "eval gsm8k: 4/4 batches"]
    assert "about" in lines[0] and "left" not in lines[1]
    slow = io.StringIO()
    progress = GenerationProgress("gsm8k", bar=False, heartbeat_s=0, stream=slow)
    progress(0, 3, 0)
    progress(0, 3, 7)
    assert slow.getvalue().splitlines()[-1].startswith("eval gsm8k: batch 1/3 still generating, 7 tokens so far")


def test_a_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    progress = GenerationProgress("arith", stream=Terminal())
    for done in range(4):
        progress(done, 3, done)
    assert progress.use_bar and progress.bar.n == progress.bar.total == 3
