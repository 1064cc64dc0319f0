"""Distributed evaluation on CPU (gloo): DeepSpeed ZeRO-3 with AutoTP (T=2, vocabulary-parallel LM head) on 2
processes (dp=1) and 4 processes (dp=2) gives the same predictions and metrics as one plain process.

The prompts' answer budgets differ wildly between the data-parallel chunks (1-3 tokens on the first rank,
about 40 on the second, and the second chunk is shorter), so the ranks finish at very different times: a
rank that stopped running forward passes early would hang ZeRO-3's parameter gathers, and the test's
timeout turns such a hang into a failure. Run as a script, this file is the per-rank worker."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.distributed import free_port, rank_env  # noqa: E402

PROMPTS = ["12+3=", "a", "hello world 123*45=", "7-8=", "q: what?", "1", "zz", "the answer is", "9*9="]
MAX_NEW = [1, 2, 1, 3, 2, 40, 36, 45, 38]
STOP = ["#"]
WORKER_TIMEOUT_S = 240


def _eval_config(gsm8k_dir: str):
    from ntl_pretrain.eval.config import EvalConfig

    return EvalConfig(arithmetic_n=6, arithmetic_max_new_tokens=5, gsm8k_path=gsm8k_dir, num_fewshot=1,
                      gsm8k_limit=3, gsm8k_max_new_tokens=24, batch_size=2)


def _comparable(metrics: dict) -> dict:
    """Metrics without wall-clock figures; NaN (MAE of no parseable answer) as None so that equality works."""
    return {k: None if math.isnan(v) else v for k, v in metrics.items()
            if not k.startswith(("eval/time_s", "eval/generation/tokens_per_s"))}


def worker(model_dir: str, tp_size: int, out_dir: str) -> None:
    """One rank: build a ZeRO-3 + AutoTP engine from the saved model, generate, run the hook, write results."""
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoTokenizer, LlamaForCausalLM

    from helpers.models import zero3_autotp_engine

    from ntl_pretrain.eval.generate import data_parallel_group, greedy_generate
    from ntl_pretrain.loss import vocab_shard_of
    from ntl_pretrain.eval.hooks import run_evaluation

    deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    engine = zero3_autotp_engine(model, tp_size)
    shard, dp_group = vocab_shard_of(engine), data_parallel_group(engine)
    rank = dist.get_rank()
    generation = greedy_generate(engine, tokenizer, PROMPTS, max_new_tokens=MAX_NEW, stop=STOP, batch_size=2)
    metrics = run_evaluation(engine, tokenizer, _eval_config(os.path.join(model_dir, "gsm")), step=1,
                             output_dir=out_dir)
    result = {"texts": generation.texts, "forward_passes": generation.forward_passes,
              "metrics": _comparable(metrics), "dp_size": dist.get_world_size(dp_group),
              "dp_rank": dist.get_rank(dp_group), "vocab": [shard.start, shard.start + shard.width],
              "tp_size": shard.size}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    dist.barrier()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The saved model and tokenizer, and what one plain process produces with them."""
    import torch

    from helpers.models import char_tokenizer, eval_llama
    from test_eval_generate import naive_greedy
    from ntl_pretrain.eval.generate import greedy_generate
    from ntl_pretrain.eval.hooks import predictions_path, run_evaluation

    model_dir = tmp_path_factory.mktemp("model")
    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=0, initializer_range=0.3)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    gsm_dir = model_dir / "gsm"
    gsm_dir.mkdir()
    rows = [{"question": f"ann has {a} pens and {b} more. how many?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
            for a, b in ((3, 4), (10, 25), (7, 1), (2, 2))]
    for split in ("train", "test"):
        (gsm_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    naive = [naive_greedy(model, tokenizer, p, m, STOP) for p, m in zip(PROMPTS, MAX_NEW)]
    # Logit gaps far above float32 round-off, so a different reduction order (TP all-reduce) cannot flip a token.
    assert min(gap for _, gap in naive) > 1e-3
    texts = greedy_generate(model, tokenizer, PROMPTS, max_new_tokens=MAX_NEW, stop=STOP, batch_size=2).texts
    assert texts == [text for text, _ in naive]
    out_dir = tmp_path_factory.mktemp("single")
    with torch.no_grad():
        metrics = run_evaluation(model, tokenizer, _eval_config(str(gsm_dir)), step=1, output_dir=str(out_dir))
    records = [json.loads(line) for line in open(predictions_path(str(out_dir), 1), encoding="utf-8")]
    return {"model_dir": model_dir, "texts": texts, "metrics": _comparable(metrics), "records": records}



def _launch(world_size: int, tp_size: int, model_dir: Path, out_dir: Path) -> None:
    """Start one process per rank; fail (and kill them all) if any fails or they outlive the timeout."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = rank_env(rank, world_size, port)
        log = open(out_dir / f"rank{rank}.log", "w", encoding="utf-8")
        procs.append((subprocess.Popen([sys.executable, __file__, str(model_dir), str(tp_size), str(out_dir)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                code = proc.wait(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of {world_size} did not finish in {WORKER_TIMEOUT_S}s (hang?); "
                            f"log: {(out_dir / f'rank{rank}.log').read_text()[-3000:]}")
            if code != 0:
                pytest.fail(f"rank {rank} of {world_size} exited with {code}: "
                            f"{(out_dir / f'rank{rank}.log').read_text()[-3000:]}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * WORKER_TIMEOUT_S)
@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 2)], ids=["zero3-tp2", "zero3-tp2-dp2"])
def test_distributed_generation_matches_single_process(reference, tmp_path: Path, world_size: int, tp_size: int):
    from ntl_pretrain.eval.hooks import predictions_path

    _launch(world_size, tp_size, reference["model_dir"], tmp_path)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    dp_size = world_size // tp_size
    for rank, result in enumerate(results):
        assert result["tp_size"] == tp_size and result["dp_size"] == dp_size
        assert result["dp_rank"] == rank // tp_size  # DeepSpeed's mesh: consecutive ranks form a TP group
        assert result["texts"] == reference["texts"], f"rank {rank}"
        assert result["metrics"] == reference["metrics"], f"rank {rank}"
    # The vocabulary is split between the TP ranks with no gap or overlap.
    assert results[0]["vocab"][0] == 0 and results[0]["vocab"][1] == results[1]["vocab"][0]
    # Every rank ran the same number of forward passes (ZeRO-3 needs it), idle ranks included.
    assert len({result["forward_passes"] for result in results}) == 1
    records = [json.loads(line) for line in open(predictions_path(str(tmp_path), 1), encoding="utf-8")]
    assert records == reference["records"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ntl_pretrain.parallel import distributed

    distributed.run_process(lambda: worker(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
