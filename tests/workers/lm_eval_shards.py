"""One rank of tests/test_eval_lm_eval_model.py's sharded run: a ZeRO-3 + AutoTP (vocabulary-parallel head) engine
from the saved model; lm-eval's evaluator on ShardedLM, then the lm_eval benchmark through the evaluation hook;
writes what it got to OUT/rank<R>.json.

    python lm_eval_shards.py MODEL_DIR TP_SIZE OUT_DIR   (one process per rank, env:// rendezvous)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_eval_lm_eval_model's settings


def main(model_dir: str, tp_size: int, out_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from lm_eval.evaluator import evaluate
    from transformers import AutoTokenizer, LlamaForCausalLM

    from helpers.models import zero3_autotp_engine

    from test_eval_lm_eval_model import BATCH_SIZE, LIMIT, MAX_LENGTH, eval_settings, request_results
    from ntl_pretrain.eval.benchmarks.lm_eval import LM_EVAL, load_tasks
    from ntl_pretrain.eval.generate import data_parallel_group
    from ntl_pretrain.eval.hooks import run_evaluation
    from ntl_pretrain.eval.lm_eval_model import ShardedLM

    deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    engine = zero3_autotp_engine(model, tp_size)
    cfg = eval_settings()
    lm = ShardedLM(engine, tokenizer, batch_size=BATCH_SIZE, max_length=MAX_LENGTH)
    results = evaluate(lm=lm, task_dict=load_tasks(cfg.settings_of(LM_EVAL)), limit=LIMIT, bootstrap_iters=0,
                       log_samples=True)
    metrics = run_evaluation(engine, tokenizer, cfg, step=1, output_dir=out_dir)
    rank = dist.get_rank()
    record = {"requests": request_results(results), "metrics": {k: v for k, v in metrics.items() if "/lm_eval/" in k},
              "dp_size": dist.get_world_size(data_parallel_group(engine)), "tp_size": lm.shard.size}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    dist.barrier()


if __name__ == "__main__":
    from ntl_pretrain.parallel import distributed

    distributed.run_process(lambda: main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
