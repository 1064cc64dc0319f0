"""GSM8K prompts and prompt encoding against lm-evaluation-harness itself (the optional extra `[lmeval]`,
installed by `tools/install.sh --dev`): its own task objects build the prompts from the real GSM8K files,
its own HFLM encodes them."""

from __future__ import annotations

import pathlib

import pytest

import lm_eval  # noqa: E402  (a dev dependency: without it the test fails, it does not skip)

from ntl_pretrain.eval.config import EvalConfig  # noqa: E402
from ntl_pretrain.eval.gsm8k import build_prompts, load_gsm8k  # noqa: E402

GSM8K = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
TASK_FILES = {"gsm8k": "gsm8k.yaml", "gsm8k_cot": "gsm8k-cot.yaml"}


def lm_eval_prompts(variant: str, limit: int | None = None, rank: int = 0, world_size: int = 1) -> list[str]:
    """The prompts lm-eval's own task builds (fewshot seed 1234, as `simple_evaluate` sets it), read from the
    local GSM8K files instead of the hub."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    config = dict(load_yaml(pathlib.Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / TASK_FILES[variant]))
    config.pop("tag", None)
    config.pop("dataset_name", None)
    config["dataset_path"] = "json"
    config["dataset_kwargs"] = {"data_files": {"train": str(GSM8K / "train.jsonl"), "test": str(GSM8K / "test.jsonl")}}
    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(1234)
    task.build_all_requests(limit=limit, rank=rank, world_size=world_size)
    return [instance.args[0] for instance in sorted(task.instances, key=lambda i: i.doc_id)]


@pytest.fixture(scope="module")
def gsm8k_rows():
    if not (GSM8K / "test.jsonl").is_file():
        pytest.fail(f"{GSM8K} is absent: the tests need ../shared/data beside the clone")
    return load_gsm8k(str(GSM8K), "test"), load_gsm8k(str(GSM8K), "train")


@pytest.mark.parametrize("variant", ["gsm8k", "gsm8k_cot"])
def test_default_prompts_equal_lm_eval_prompts_on_all_1319_questions(variant, gsm8k_rows):
    test, train = gsm8k_rows
    cfg = EvalConfig(gsm8k_variant=variant)  # the defaults: lm-eval's sampler, shots and exemplars
    ours = [item.prompt for item in build_prompts(test, train, variant=variant, num_fewshot=cfg.num_fewshot,
                                                  fewshot_seed=cfg.fewshot_seed, fewshot_sampler=cfg.fewshot_sampler,
                                                  cot_exemplars=cfg.gsm8k_cot_exemplars)]
    theirs = lm_eval_prompts(variant)
    assert len(theirs) == len(ours) == 1319
    same = sum(a == b for a, b in zip(ours, theirs))
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert same == 1319, f"{same}/1319 prompts equal lm-eval's; first difference at {first_difference}"


def test_limited_prompts_are_lm_evals_limited_prompts_and_ranks_do_not_change_ours(gsm8k_rows):
    test, train = gsm8k_rows
    ours = [item.prompt for item in build_prompts(test, train, limit=40)]
    assert ours == lm_eval_prompts("gsm8k", limit=40)
    # lm-eval with 2 data-parallel ranks: each rank draws from its own Random(1234), so its prompts change with
    # the world size; ours are the world-size-1 prompts on every rank (every rank builds the whole list).
    rank1 = lm_eval_prompts("gsm8k", limit=40, rank=1, world_size=2)
    assert rank1 != ours[1::2]
    assert rank1[0] != ours[1] and rank1[0].endswith(test[1]["question"] + "\nAnswer:")
    # the earlier per-question form is still there, and differs
    per_question = [item.prompt for item in build_prompts(test, train, limit=40, fewshot_sampler="per_question")]
    assert sum(a == b for a, b in zip(per_question, ours)) == 0


def bos_tokenizer():
    """A Llama-style tokenizer whose default encoding prepends BOS."""
    from helpers.models import char_tokenizer

    return char_tokenizer(bos=True)


def test_prompts_are_encoded_as_lm_evals_hflm_encodes_them(tmp_path):
    import accelerate  # noqa: F401  (lm-eval's HF model needs it; in the dev extra)
    from lm_eval.models.huggingface import HFLM
    from helpers.models import eval_llama

    from ntl_pretrain.eval.arithmetic import generate_problems
    from ntl_pretrain.eval.hooks import run_evaluation

    tokenizer = bos_tokenizer()
    model = eval_llama(len(tokenizer), seed=1)
    seen: list[list[int]] = []

    def record_first_forward(module, args, kwargs):
        if kwargs.get("attention_mask") is not None and kwargs["input_ids"].shape[1] > 1:
            seen.extend(row[mask.bool()].tolist() for row, mask in zip(kwargs["input_ids"], kwargs["attention_mask"]))

    model.register_forward_pre_hook(record_first_forward, with_kwargs=True)
    # "plain" prompts follow add_special_tokens (the default "document" format encodes arithmetic prompts as the
    # training stream encodes a document instead: EOS first, no BOS; tests/test_eval_generate.py covers it)
    cfg = EvalConfig(arithmetic_n=3, arithmetic_splits=["interpolation"], arithmetic_ops=["+"],
                     arithmetic_max_new_tokens=2, batch_size=1, arithmetic_prompt_format="plain")
    run_evaluation(model, tokenizer, cfg, step=0, output_dir=str(tmp_path))  # the defaults: add_special_tokens null
    harness = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=256, device="cpu")
    prompts = [p.prompt for p in generate_problems("interpolation", 3, cfg.arithmetic_seed, ops=("+",))]
    expected = [harness.tok_batch_encode([prompt])[0][0].tolist() for prompt in prompts]
    assert all(ids[0] == tokenizer.bos_token_id for ids in expected)  # the reference does prepend BOS
    assert sorted(seen) == sorted(expected)
