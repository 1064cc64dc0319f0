"""tools/evaluate.py: an exported HF folder in one process, and a real training run's ZeRO-3 + AutoTP checkpoint
on 2 CPU ranks under DeepSpeed's launcher, which must reproduce the training run's own final evaluation."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from helpers.distributed import free_port
from helpers.launch import REPO, launch_env, run_ok

TOOL = REPO / "tools" / "evaluate.py"
pytestmark = pytest.mark.slow  # runs a training and the tool under DeepSpeed's launcher


def _load_tool():
    spec = importlib.util.spec_from_file_location("ntl_evaluate_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tool_on_hf_folder_matches_the_hook(tmp_path: Path, capsys):
    from helpers.models import char_tokenizer, eval_llama

    from ntl_pretrain.eval.config import EvalConfig
    from ntl_pretrain.eval.hooks import predictions_path, run_evaluation

    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=4, initializer_range=0.3)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    tool = _load_tool()
    code = tool.main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out"), "--step", "5",
                      "arithmetic_n=6", "eval.batch_size=4", "arithmetic_ops=[+, '*']"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "eval/arith/extrapolation/accuracy" in printed
    # start-up notices, then what is evaluated and its progress per batch (not a terminal: plain lines)
    assert f"loading {tmp_path / 'model'} on 1 process(es)" in printed and f"loaded {tmp_path / 'model'}" in printed
    assert "eval arith: 12 problems (interpolation, extrapolation), batch size 4" in printed
    assert [line.split(",")[0] for line in printed.splitlines() if " batches, " in line] == [
        f"eval arith: {done}/3 batches" for done in (1, 2, 3)]
    result = json.loads((tmp_path / "out" / "eval_results_step_0000005.json").read_text())
    assert result["eval_config"]["arithmetic_ops"] == ["+", "*"] and result["step"] == 5

    expected = run_evaluation(model, tokenizer, EvalConfig(arithmetic_n=6, batch_size=4, arithmetic_ops=["+", "*"]),
                              step=5, output_dir=str(tmp_path / "direct"))
    for key, value in expected.items():
        if not key.startswith(("eval/time_s", "eval/generation/tokens_per_s")):
            assert result["metrics"][key] == (None if value != value else value), key
    tool_lines = (tmp_path / "out" / "eval" / "step_0000005.jsonl").read_text()
    assert tool_lines == Path(predictions_path(str(tmp_path / "direct"), 5)).read_text()


def test_tool_on_an_export_uses_the_runs_saved_settings_and_writes_beside_it(tmp_path: Path, capsys, monkeypatch):
    from helpers.models import char_tokenizer, eval_llama

    from ntl_pretrain.eval.config import EvalConfig, save_eval_settings

    tokenizer = char_tokenizer()
    model = eval_llama(len(tokenizer), seed=4, initializer_range=0.3)
    export = tmp_path / "run" / "hf_export"
    model.save_pretrained(export)
    tokenizer.save_pretrained(export)
    run_settings = EvalConfig(arithmetic_n=5, batch_size=4, arithmetic_ops=["+", "*"], arithmetic_max_new_tokens=4)
    save_eval_settings(str(export), run_settings)  # what every checkpoint's hf/ folder (and so its export) holds
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    tool = _load_tool()
    assert tool.main(["--model", str(export)]) == 0
    printed = capsys.readouterr().out
    assert f"evaluation settings: the training run's, from {export / 'ntl_eval.json'}" in printed
    result = json.loads((tmp_path / "run" / "hf_export_eval" / "eval_results_step_0000000.json").read_text())
    assert result["eval_config"] == dataclasses.asdict(run_settings)
    assert result["metrics"]["eval/arith/interpolation/n"] == 5
    assert list(elsewhere.iterdir()) == []  # nothing written into the current folder
    assert tool.main(["--model", str(export), "--default-settings", "arithmetic_n=2",
                      "--output-dir", str(tmp_path / "defaults")]) == 0
    assert "evaluation settings: the defaults (--default-settings), overridden by arithmetic_n=2" in capsys.readouterr().out
    result = json.loads((tmp_path / "defaults" / "eval_results_step_0000000.json").read_text())
    assert result["eval_config"] == dataclasses.asdict(EvalConfig(arithmetic_n=2))
    (export / "ntl_eval.json").write_text('{"arithmetic_count": 5}')
    assert tool.main(["--model", str(export)]) == 2
    assert "unknown evaluation setting 'arithmetic_count'" in capsys.readouterr().err


def test_tool_rejects_unknown_settings(tmp_path: Path):
    tool = _load_tool()
    with pytest.raises(ValueError, match="did you mean 'arithmetic_n'"):
        tool.eval_config(tool.EvalConfig(), ["arithmetic_count=5"])
    with pytest.raises(ValueError, match="key=value"):
        tool.eval_config(tool.EvalConfig(), ["arithmetic_n"])
    # read as the trainer reads an override: a key given twice in a YAML value is refused, naming it
    with pytest.raises(ValueError, match="'a'.*twice|twice.*'a'"):
        tool.eval_config(tool.EvalConfig(), ["generate_options={a: 1, a: 2}"])
    assert tool.main(["--run", str(tmp_path)]) == 2  # not a run folder: an error message, exit code 2
    # values are type-checked as the trainer checks eval.*: 1.5 problems, true, YAML 1.1's string '1e9' are refused
    for override, message in (("arithmetic_n=1.5", "eval.arithmetic_n must be an integer, got float 1.5"),
                              ("arithmetic_n=true", "eval.arithmetic_n must be an integer, got bool True"),
                              ("arithmetic_n=1e9", "eval.arithmetic_n must be an integer, got str '1e9'"),
                              ("gsm8k_path=5", "eval.gsm8k_path must be a string"),
                              ("arithmetic_splits=[]", "eval.arithmetic_splits is empty but eval.arithmetic_n=200")):
        with pytest.raises(ValueError) as info:
            tool.eval_config(tool.EvalConfig(), [override])
        assert message in str(info.value), (override, str(info.value))
    assert tool.eval_config(tool.EvalConfig(), ["arithmetic_n=0", "arithmetic_splits=[]"]).arithmetic_n == 0
    (tmp_path / "ntl_eval.json").write_text(json.dumps({"batch_size": "16"}))  # a run's saved settings, edited
    with pytest.raises(ValueError, match=f"{tmp_path / 'ntl_eval.json'}: eval.batch_size must be an integer, got str"):
        tool.eval_config(tool.model_eval_settings(tool.parse_args(["--model", str(tmp_path)]))[0], [])
    # overrides before and after the options, as with the trainer's command line
    args = tool.parse_args(["--model", "m", "arithmetic_n=2", "--output-dir", "out", "batch_size=4", "--dtype", "fp32"])
    assert args.overrides == ["arithmetic_n=2", "batch_size=4"] and args.output_dir == "out"


def test_tool_refuses_an_incomplete_model_folder_in_one_line(tmp_path: Path, capsys, monkeypatch):
    """An export without tokenizer files or without weights was a raw transformers traceback, and a tokenizer
    without EOS with the default document prompts one from inside the evaluation, after the weights loaded (as was
    a --tp that does not divide the processes)."""
    import shutil

    import transformers
    from helpers.models import char_tokenizer, eval_llama
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tool = _load_tool()
    complete = tmp_path / "model"
    eval_llama(len(char_tokenizer())).save_pretrained(complete)
    char_tokenizer().save_pretrained(complete)
    folders = {name: tmp_path / name for name in ("no_tokenizer", "no_weights", "no_eos")}
    for folder in folders.values():
        shutil.copytree(complete, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folders["no_tokenizer"] / name).unlink()
        (folders["no_eos"] / name).unlink()
    (folders["no_weights"] / "model.safetensors").unlink()
    backend = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate("0123456789+=")}}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folders["no_eos"])
    load = transformers.AutoModelForCausalLM.from_pretrained
    expected = {"no_tokenizer": f"error: folder '{folders['no_tokenizer']}' holds no tokenizer",
                "no_weights": f"error: cannot load the model weights of '{folders['no_weights']}': Error no file named "
                              f"model.safetensors",
                "no_eos": "error: eval.arithmetic_prompt_format=document puts the EOS token before each prompt, but "
                          "the tokenizer has no EOS token; set eval.arithmetic_prompt_format=plain"}
    for name, message in expected.items():
        if name == "no_eos":  # refused before the weights load
            monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                                classmethod(lambda cls, *a, **k: pytest.fail("loaded the weights first")))
        assert tool.main(["--model", str(folders[name]), "arithmetic_n=2", "--output-dir", str(tmp_path / "out")]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "Traceback"))]
        assert len(errors) == 1 and errors[0].startswith(message), (name, errors)
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("loaded the weights before --tp was checked")))
    for tp in ("0", "2"):  # one process: refused before the weights load (they loaded first)
        assert tool.main(["--model", str(complete), "--tp", tp, "arithmetic_n=2"]) == 2
        assert f"error: --tp {tp} does not divide the 1 processes launched" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


TINY_RUN = """
model:
  architecture: {model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
                 num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64,
                 tie_word_embeddings: false}
  dtype: fp32
tokenizer: {name_or_path: ASSETS/tokenizer, train_vocab_size: 300}
data:
  sources: [{path: ASSETS/arithmetic.jsonl, text_field: text, generate_arithmetic: 600}]
  seq_len: 32
  micro_batch_size: 4
  validation_documents: 0
loss: {enabled: true, ntl_weight: 0.3}
parallel: {tp_size: 2, zero_stage: 3}
optim: {lr: 3.0e-3, warmup_steps: 1}
train: {output_dir: RUN, max_steps: 3, val_every_n_steps: -1, log_every_n_steps: 1}
checkpoint: {every_n_steps: 0}
eval: {every_n_steps: 0, at_end: true, arithmetic_n: 6, arithmetic_max_new_tokens: 6, batch_size: 4}
"""


def _run(command: list[str], cwd: Path, timeout: int) -> str:
    return run_ok(command, cwd=cwd, env=launch_env(NTL_CPU_PROCS="2", NTL_DEEPSPEED_ARGS=f"--master_port {free_port()}"),
                  timeout=timeout).stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(800)
def test_tool_on_training_checkpoint_reproduces_the_runs_final_evaluation(tmp_path: Path):
    run_dir, assets = tmp_path / "run", tmp_path / "assets"
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_RUN.replace("ASSETS", str(assets)).replace("RUN", str(run_dir)), encoding="utf-8")
    _run(["bash", str(REPO / "launch" / "pretrain.sh"), "--config", str(config)], cwd=tmp_path, timeout=200)
    in_training = (run_dir / "eval" / "step_0000003.jsonl").read_text()
    assert len(in_training.splitlines()) == 12  # 6 interpolation + 6 extrapolation problems

    printed = _run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(TOOL), "--run", str(run_dir),
                    "--output-dir", str(tmp_path / "tool")], cwd=tmp_path, timeout=200)
    # start-up notices and rank 0's progress, printed once (tp=2: one data-parallel rank, 12 problems, batches of 4)
    assert printed.count(f"loading the checkpoint of {run_dir}") == 1 and printed.count("evaluation settings:") == 1
    assert printed.count("eval arith: 12 problems") == 1
    assert "2 processes, the prompts split over 1 data-parallel rank(s), rank 0's progress shown" in printed
    assert printed.count("eval arith: 3/3 batches") == 1
    result = json.loads((tmp_path / "tool" / "eval_results_step_0000003.json").read_text())
    assert result["step"] == 3 and result["eval_config"]["arithmetic_n"] == 6  # the run's own eval settings
    # The checkpoint's weights, not freshly initialised ones: the same predictions as the run made at its end.
    assert (tmp_path / "tool" / "eval" / "step_0000003.jsonl").read_text() == in_training

    # The export of that checkpoint carries the run's eval settings: with no overrides, the tool evaluates it
    # as the run did (before, it used the defaults: other problems and sizes).
    assert json.loads((run_dir / "global_step3" / "hf" / "ntl_eval.json").read_text())["arithmetic_n"] == 6
    _run([sys.executable, str(REPO / "tools" / "export_hf.py"), str(run_dir), str(run_dir / "hf_export")],
         cwd=tmp_path, timeout=200)
    _run([sys.executable, str(TOOL), "--model", str(run_dir / "hf_export"), "--step", "3"], cwd=tmp_path, timeout=200)
    result = json.loads((run_dir / "hf_export_eval" / "eval_results_step_0000003.json").read_text())
    assert result["eval_settings"].startswith("the training run's") and result["eval_config"]["arithmetic_n"] == 6
    assert (run_dir / "hf_export_eval" / "eval" / "step_0000003.jsonl").read_text() == in_training



def test_sigterm_to_the_deepspeed_runner_ends_every_evaluation_process(tmp_path: Path):
    """Issue 47 item 5: SIGTERM to the documented `deepspeed --num_gpus 2 tools/evaluate.py` ended DeepSpeed's runner
    (it has no handler) and left launch.py and both ranks evaluating, re-parented to init; now the ranks see their
    launcher end and stop, launch.py follows them, and nothing of the job is left within a few seconds."""
    import signal
    import subprocess
    import threading

    import psutil
    from helpers.models import char_tokenizer, eval_llama

    tokenizer = char_tokenizer()
    eval_llama(len(tokenizer), seed=4).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(TOOL), "--model",
               str(tmp_path / "model"), "--output-dir", str(tmp_path / "out"), "arithmetic_n=5000", "batch_size=2"]
    job = subprocess.Popen(command, cwd=tmp_path, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # its own session: no signal of ours reaches pytest
    lines: list[str] = []
    evaluating = threading.Event()

    def read() -> None:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("eval arith: "):  # rank 0 announces the benchmark: both ranks evaluate
                evaluating.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert evaluating.wait(300), "".join(lines)[-3000:]
        tree = psutil.Process(job.pid).children(recursive=True)  # launch.py and the two ranks
        assert len([p for p in tree if str(TOOL) in " ".join(p.cmdline())]) == 3, [p.cmdline() for p in tree]
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == -signal.SIGTERM  # DeepSpeed's runner: no handler
        _, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, ([p.pid for p in alive], "".join(lines)[-3000:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # whatever a failure left (the job is its own process group)
    reader.join(timeout=10)
    assert "the DeepSpeed launcher above this rank" in "".join(lines), "".join(lines)[-3000:]
    assert not (tmp_path / "out" / "eval_results_step_0000000.json").exists()


def test_a_tokenizer_beyond_the_models_vocabulary_is_one_line_before_the_weights_load(tmp_path: Path, capsys,
                                                                                        monkeypatch):
    """Issue 47: a tokenizer whose ids exceed the model's embedding rows was a raw IndexError at the first batch."""
    import transformers
    from helpers.models import char_tokenizer, eval_llama

    small = char_tokenizer("0123456789+= ")
    eval_llama(len(small)).save_pretrained(tmp_path / "model")
    small.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "larger")  # the default characters: more tokens than the model has
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("loaded the weights first")))
    tool = _load_tool()
    capsys.readouterr()  # save_pretrained's progress bar
    assert tool.main(["--model", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "larger"), "arithmetic_n=2",
                      "--output-dir", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    larger = len(char_tokenizer())
    assert errors == [f"error: the tokenizer of {str(tmp_path / 'larger')!r} has token ids up to {larger - 1}, but the "
                      f"model {str(tmp_path / 'model')!r} has {len(small)} embedding rows (vocab_size={len(small)}); "
                      f"pass the tokenizer the model was trained with (--tokenizer DIR), or resize the model to it "
                      f"first (tools/tokenizer.py resize-model {tmp_path / 'model'} {tmp_path / 'larger'} OUT)"]


def test_a_tensor_parallel_run_evaluated_in_one_process_names_the_launch(tmp_path: Path, capsys, monkeypatch):
    """Issue 47: `tools/evaluate.py --run` of a T=2 run in one process suggested the trainer's fixes (its
    parallel.tp_size, launch/pretrain.sh) instead of launching the tool on 2 processes."""
    from ntl_pretrain.config import load_config, to_yaml

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # restored (removed) after the test: the tool describes a world of one in them,
        monkeypatch.delenv(name)  # which the launches of later tests would inherit

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = load_config(None, ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok",
                               "data.sources.0.path=corpus.jsonl", "parallel.tp_size=2"])
    (run_dir / "config.yaml").write_text(to_yaml(saved))
    (run_dir / "global_step3").mkdir()
    assert _load_tool().main(["--run", str(run_dir), "--tag", "global_step3"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "Traceback"))]
    assert errors == [f"error: {str(run_dir)!r} trained with parallel.tp_size=2, which does not divide the 1 process(es) "
                      f"launched; evaluate it on 2 processes: DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed "
                      f"--num_gpus 2 tools/evaluate.py --run {run_dir}"]


@pytest.mark.parametrize("argv, message", [
    (["--model", ""], "--model is empty ('')"),
    (["--run", " "], "--run is empty (' ')"),
    (["--model", "m", "--json", ""], "--json is empty ('')"),
    (["--model", "m", "--output-dir", ""], "--output-dir is empty ('')"),
    (["--model", "m", "--step", "-5"], "--step -5 is negative"),
])
def test_empty_and_negative_arguments_are_refused_by_the_parser(argv, message, capsys):
    """`--model ""` was a raw TypeError (taken for --run None), `--json ""` silently wrote the default file and
    `--step -5` wrote eval/step_-000005.jsonl."""
    with pytest.raises(SystemExit) as info:
        _load_tool().parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("tag, message", [
    ("../../x", "--tag '../../x' is not a checkpoint tag (global_stepN, a folder of the run)"),
    ("auto", "--tag 'auto' is not a checkpoint tag"),
    ("global_step5", "--tag global_step5: {run!r} has no such checkpoint (it has: global_step3)"),
])
def test_a_tag_the_run_does_not_hold_is_named_as_the_option(tmp_path: Path, capsys, tag, message):
    """--tag '../../x' was reported as train.resume='../../x', a setting the user never wrote."""
    run_dir = tmp_path / "run"
    (run_dir / "global_step3").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train: {}\n")
    assert _load_tool().main(["--run", str(run_dir), "--tag", tag]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "Traceback"))]
    assert len(errors) == 1 and errors[0].startswith("error: " + message.format(run=str(run_dir))), errors
    assert "train.resume" not in errors[0]


def test_an_moe_model_whose_expert_width_grouped_mm_cannot_take_is_evaluated_with_eager_experts(tmp_path: Path,
                                                                                                capsys):
    """Issue 47 item 6 in the evaluation tool: a Mixtral export with intermediate_size=97 failed at the first batch in
    torch._grouped_mm ('strides should be multiple of 16 bytes'); it runs with the plain loop over experts."""
    import torch
    from helpers.models import char_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = char_tokenizer()
    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=97, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                                  eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()
    assert _load_tool().main(["--model", str(tmp_path / "model"), "arithmetic_n=2", "arithmetic_max_new_tokens=3",
                              "--output-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert ("note: the model's intermediate_size=97 is not a multiple of 4 (fp32), which torch's grouped_mm needs: "
            "its MoE experts run with experts_implementation=eager (slower)") in printed
    assert json.loads((tmp_path / "out" / "eval_results_step_0000000.json").read_text())["metrics"][
        "eval/arith/interpolation/n"] == 2


def test_operands_of_hundreds_of_digits_are_evaluated_and_an_unrepresentable_mae_is_null(tmp_path: Path, capsys):
    """`arithmetic_extrapolation_digits=[400, 400]` was a raw OverflowError after the generation; the JSON holds
    null for an MAE beyond float's range (as for NaN)."""
    from helpers.models import char_tokenizer, eval_llama

    tokenizer = char_tokenizer()
    eval_llama(len(tokenizer), max_positions=1024).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert _load_tool().main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out"),
                              "arithmetic_n=1", "arithmetic_splits=[extrapolation]", "arithmetic_ops=['+']",
                              "arithmetic_extrapolation_digits=[400, 400]", "arithmetic_max_new_tokens=2"]) == 0
    metrics = json.loads((tmp_path / "out" / "eval_results_step_0000000.json").read_text())["metrics"]
    assert metrics["eval/arith/extrapolation/n"] == 1
    assert metrics["eval/arith/extrapolation/mae"] is None or metrics["eval/arith/extrapolation/mae"] >= 0


def test_result_files_that_are_no_files_are_refused_before_the_evaluation(tmp_path: Path, capsys, monkeypatch):
    """The predictions file (OUTPUT_DIR/eval/step_N.jsonl) or the default metrics file made a folder or a fifo was
    refused by the shared writer only after the generation (hours for GSM8K), as a raw ValueError."""
    import os

    from helpers.models import char_tokenizer, eval_llama

    tokenizer = char_tokenizer()
    eval_llama(len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    tool = _load_tool()
    monkeypatch.setattr("ntl_pretrain.eval.hooks.run_evaluation",
                        lambda *args, **kwargs: pytest.fail("evaluated before the result files were checked"))
    (tmp_path / "out" / "eval" / "step_0000004.jsonl").mkdir(parents=True)
    os.mkfifo(tmp_path / "out" / "eval_results_step_0000007.json")
    capsys.readouterr()
    for step, path, kind in ((4, tmp_path / "out" / "eval" / "step_0000004.jsonl", "a directory"),
                             (7, tmp_path / "out" / "eval_results_step_0000007.json", "a fifo")):
        assert tool.main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out"), "--step",
                          str(step), "arithmetic_n=2"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "Traceback"))]
        assert errors == [f"error: {str(path)!r} is {kind}, not a regular file, so no file is written in its place; "
                          f"choose a file path (or - or /dev/stdout for the standard output)"]
