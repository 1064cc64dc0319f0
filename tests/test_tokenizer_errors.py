"""Bad input to the tokenizer tools: every error names the problem, and nothing half-written is left."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import huggingface_hub.constants
import pytest

from ntl_pretrain.tokenizer import (ConversionCheckError, SpmTrainConfig, TokenizerLoadError, load_tokenizer,
                                    split_digits, train_spm, verify_conversion)
from ntl_pretrain.tokenizer.corpus import read_corpus

from test_tokenizer_families import build_gpt2_style

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory) -> Path:
    return build_gpt2_style(tmp_path_factory.mktemp("errors") / "gpt2_style")


@pytest.fixture(scope="module")
def tool():
    return runpy.run_path(str(REPO / "tools" / "tokenizer.py"))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_path_that_is_not_a_tokenizer(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(TokenizerLoadError, match="holds no tokenizer: none of tokenizer.json"):
        load_tokenizer(tmp_path / "weights")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(TokenizerLoadError, match="is not a tokenizer: expected a tokenizer folder"):
        load_tokenizer(tmp_path / "notes.txt")
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "missing" / "dir")
    (tmp_path / "bad.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(TokenizerLoadError, match="is not a valid SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")


def test_corrupt_tokenizer_json(gpt2_style, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    text = (gpt2_style / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[: len(text) // 2])  # truncated download
    (broken / "tokenizer_config.json").write_text((gpt2_style / "tokenizer_config.json").read_text())
    with pytest.raises(TokenizerLoadError, match="tokenizer.json' is corrupt: not valid JSON"):
        load_tokenizer(broken)
    with pytest.raises(TokenizerLoadError, match="is not a valid tokenizer.json"):
        load_tokenizer(broken / "tokenizer.json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(TokenizerLoadError, match="is not a valid tokenizer.json"):
        load_tokenizer(wrong)


def test_slow_tokenizer_without_fast_equivalent(tmp_path):
    folder = tmp_path / "byt5"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    with pytest.raises(TokenizerLoadError, match=r"slow \(Python\) tokenizer \(ByT5Tokenizer\) without a fast "
                                                 r"equivalent.*train-spm"):
        load_tokenizer(folder)


def test_existing_output_folder_needs_force(gpt2_style, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous run")
    with pytest.raises(FileExistsError, match="already exists; pass --force"):
        split_digits(gpt2_style, out)
    assert (out / "old.txt").read_text() == "previous run"  # untouched
    # --force replaces only a folder the tool wrote: not one holding a file it did not write
    with pytest.raises(FileExistsError, match=r"holds old.txt\): --force replaces only a folder that tools/"):
        split_digits(gpt2_style, out, force=True)
    assert (out / "old.txt").read_text() == "previous run"
    (out / "old.txt").unlink()
    split_digits(gpt2_style, out, force=True)  # an empty folder is taken
    report = split_digits(gpt2_style, out, force=True)  # and the tool's own output replaced
    assert report.verification.passed
    assert (out / "tokenizer.json").is_file()
    assert _leftovers(tmp_path) == []  # no staging or retired folders left behind
    with pytest.raises(FileExistsError, match="is the input's folder"):
        split_digits(out, out, force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a folder"):
        split_digits(gpt2_style, tmp_path / "file", force=True)


def test_force_never_deletes_the_input_or_files_the_tool_did_not_write(gpt2_style, tmp_path, tool, capsys):
    """Issue 40 item 1: `split-digits DIR/gpt2 DIR --force` replaced DIR, deleting the input tokenizer and a user's
    file beside it."""
    import shutil

    user_dir = tmp_path / "DIR"
    shutil.copytree(gpt2_style, user_dir / "gpt2")
    (user_dir / "notes.txt").write_text("my notes")
    before = sorted(str(p.relative_to(user_dir)) for p in user_dir.rglob("*"))
    assert tool["main"](["split-digits", str(user_dir / "gpt2"), str(user_dir), "--force"]) == 2
    assert "holds the input" in capsys.readouterr().err
    assert sorted(str(p.relative_to(user_dir)) for p in user_dir.rglob("*")) == before
    # the input elsewhere: DIR still holds a file the tool did not write
    assert tool["main"](["split-digits", str(gpt2_style), str(user_dir), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was not written by tools/tokenizer.py" in err, err
    assert (user_dir / "notes.txt").read_text() == "my notes" and (user_dir / "gpt2" / "tokenizer.json").is_file()
    # a folder the tool wrote, to which the user added a file: refused too
    out = tmp_path / "out"
    split_digits(gpt2_style, out)
    (out / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"holds files tools/tokenizer.py did not write \(mine.txt\)"):
        split_digits(gpt2_style, out, force=True)
    (out / "mine.txt").unlink()
    assert split_digits(gpt2_style, out, force=True).verification.passed
    # train-spm: a corpus inside OUT
    corpus = out / "corpus.txt"
    (out / "corpus.txt").write_text("the 12 cats\n" * 50)
    with pytest.raises(FileExistsError, match="is the input's folder"):
        train_spm([corpus], out, SpmTrainConfig(vocab_size=300), force=True)


@pytest.mark.parametrize("target", ["missing", "folder"])
def test_output_path_that_is_a_symbolic_link(gpt2_style, tmp_path, tool, capsys, target):
    """Issue 40 item 8: OUT a dangling link gave a raw `[Errno 20] Not a directory` naming a temporary path."""
    real = tmp_path / "real"
    if target == "folder":
        real.mkdir()
        (real / "keep.txt").write_text("keep")
    (tmp_path / "link").symlink_to(real)
    assert tool["main"](["split-digits", str(gpt2_style), str(tmp_path / "link"), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is a symbolic link (to {str(real)!r})" in err, err
    assert (tmp_path / "link").is_symlink() and (target == "missing" or (real / "keep.txt").read_text() == "keep")
    assert _leftovers(tmp_path) == []


def test_empty_corpus(gpt2_style, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    with pytest.raises(ValueError, match="empty.txt' is empty"):
        read_corpus(empty)
    with pytest.raises(ValueError, match="is empty"):
        split_digits(gpt2_style, tmp_path / "out", corpus=empty)
    with pytest.raises(ValueError, match="is empty"):
        train_spm(empty, tmp_path / "spm", SpmTrainConfig(vocab_size=300, num_threads=1))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        split_digits(gpt2_style, tmp_path / "out", corpus=tmp_path / "nope.txt")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "1 2 3"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl' line 2 is not valid JSON"):
        read_corpus(bad_jsonl)
    with pytest.raises(ValueError, match="is not a regular file; give a .txt or .jsonl file"):  # was "does not exist"
        split_digits(gpt2_style, tmp_path / "out", corpus=tmp_path)
    no_text = tmp_path / "numbers.jsonl"  # rows whose fields are no strings: named as such, not just "empty"
    no_text.write_text('{"text": 5}\n[1, 2]\nnull\n')
    with pytest.raises(ValueError, match="is empty.*JSON lines give their string fields text, content"):
        read_corpus(no_text)
    assert not (tmp_path / "out").exists() and not (tmp_path / "spm").exists()


def test_bad_train_spm_options(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        SpmTrainConfig(vocab_size=100)
    with pytest.raises(ValueError, match="model_type='word' is not supported"):
        SpmTrainConfig(model_type="word")
    with pytest.raises(ValueError, match="normalization='nfd' is not a SentencePiece rule"):
        SpmTrainConfig(normalization="nfd")


def test_failed_verification_writes_nothing(gpt2_style, tmp_path):
    original = load_tokenizer(gpt2_style)
    report = verify_conversion(original, original, ["In 2024 we sold 12345 apples."])
    assert not report.passed and report.digits.failed == 1 and report.round_trip.passed
    assert "is not a single bare digit" in report.digits.examples[0]
    error = ConversionCheckError(report)
    assert "FAIL (a) every digit is exactly one single-digit token" in str(error)


def test_command_line_errors_exit_2_with_a_message(tool, gpt2_style, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying the Hub
    assert tool["main"](["inspect", str(tmp_path / "missing" / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert tool["main"](["split-digits", str(gpt2_style), str(tmp_path / "o"), "--corpus",
                         str(tmp_path / "empty.txt")]) == 2
    assert "is empty" in capsys.readouterr().err
    assert tool["main"](["number-vocab", "no-such-org/no-such-model-xyz"]) == 2
    assert "neither a local path nor a loadable Hugging Face Hub tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool["main"](["train-spm", str(tmp_path / "empty.txt"), str(tmp_path / "o")])  # --vocab-size required
    assert "--vocab-size" in capsys.readouterr().err


def test_number_vocab_refuses_a_tokenizer_inspect_calls_not_digit_level(tool, shared_data, tmp_path, capsys):
    """Issue 36 item 5: `number-vocab` on GPT-2 (inspect: NOT digit-level) wrote a digit-level vocabulary silently."""
    gpt2, out = shared_data / "tokenizers" / "gpt2", tmp_path / "nv.json"
    assert tool["main"](["inspect", str(gpt2)]) == 0 and "verdict: NOT digit-level" in capsys.readouterr().out
    assert tool["main"](["number-vocab", str(gpt2), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "is NOT digit-level" in error and "split-digits" in error and "--allow-non-digit-level" in error
    assert error.count("\n") == 1 and not out.exists()
    assert tool["main"](["number-vocab", str(gpt2), "--out", str(out), "--allow-non-digit-level"]) == 0
    assert json.loads(out.read_text())["digit_level"] is True


def test_number_vocab_command(tool, gpt2_style, tmp_path, capsys):
    out = tmp_path / "vocab.json"
    # the toy GPT-2-style tokenizer keeps some digits together: its ten digits are written only when asked
    assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(out), "--json"]) == 2
    assert "is NOT digit-level" in capsys.readouterr().err
    assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(out), "--json", "--allow-non-digit-level"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    tokenizer = load_tokenizer(gpt2_style)
    assert saved["tokens"] == printed["tokens"] and sorted(saved["tokens"]) == list("0123456789")
    assert saved["token_ids"] == sorted(tokenizer.get_vocab()[d] for d in "0123456789")
    assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(tmp_path / "small.json"),
                         "--vocab-size", "10", "--allow-non-digit-level"]) == 2
    assert "is smaller than the tokenizer's vocabulary" in capsys.readouterr().err
    assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(tmp_path / "multi.json"),
                         "--multi-digit"]) == 0
    multi = json.loads((tmp_path / "multi.json").read_text())
    assert multi["digit_level"] is False and len(multi["token_ids"]) > 10


def _write(folder: Path, files: dict[str, str | bytes | None]) -> Path:
    folder.mkdir()
    for name, content in files.items():
        if content is None:
            (folder / name).mkdir()
        elif isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content)
    return folder


@pytest.mark.parametrize("files, message", [
    # a fast class without its vocabulary file builds an empty tokenizer (LlamaTokenizer: 3 tokens) or fails raw
    ({"tokenizer_config.json": '{"tokenizer_class": "LlamaTokenizer"}'}, "holds tokenizer_config.json but no vocabulary"),
    ({"tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast"}', "config.json": '{"model_type": "llama"}'},
     "holds tokenizer_config.json but no vocabulary"),
    ({"tokenizer.json": None}, "tokenizer.json' is not a regular file"),
    ({"tokenizer.json": "[1, 2]"}, "tokenizer.json' holds a JSON list, not an object"),
    ({"tokenizer.json": "{}"}, "tokenizer.json' is not a tokenizers pipeline"),
    ({"tokenizer.json": '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}', "tokenizer_config.json": b'{"a": "\xe9"}'},
     "tokenizer_config.json' is corrupt: not valid JSON"),
    # issue 40, go-beyond round: transformers' message asked to install sentencepiece or tiktoken
    ({"vocab.json": '{"a": 0}'}, r"folder .* holds vocab.json but no merges.txt: a byte-level BPE tokenizer"),
    # loaded, then `inspect` died in a raw `Exception: Encountered an unknown token but unk_id is missing`
    ({"tokenizer.json": '{"model": {"type": "Unigram", "unk_id": null, "vocab": []}}'},
     "tokenizer.json': its Unigram model vocabulary is empty, so no text can be encoded"),
    ({"tokenizer.json": '{"model": {"type": "BPE", "vocab": {}, "merges": []}}'}, "its BPE model vocabulary is empty"),
])
def test_tokenizer_folder_errors_are_one_line_naming_the_folder_or_file(tmp_path, files, message):
    folder = _write(tmp_path / "tok", files)
    with pytest.raises(TokenizerLoadError, match=message) as raised:
        load_tokenizer(folder)
    assert "\n" not in str(raised.value) and str(folder) in str(raised.value)


def test_a_tokenizer_path_that_is_a_pipe_is_named_as_such(tmp_path):
    import os

    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerLoadError, match="is neither a regular file nor a folder"):
        load_tokenizer(tmp_path / "tokenizer.json")


def _gpt2_with_special_digits(shared_data: Path, out: Path) -> Path:
    """The real GPT-2 tokenizer with "0".."9" taken out of its vocabulary (and merges) and added back as special
    added tokens (issue 40 item 2's input)."""
    pipeline = json.loads((shared_data / "tokenizers" / "gpt2" / "tokenizer.json").read_text())
    for digit in "0123456789":
        del pipeline["model"]["vocab"][digit]
    pipeline["model"]["merges"] = [merge for merge in pipeline["model"]["merges"]
                                   if not set(merge.split(" ") if isinstance(merge, str) else merge) & set("0123456789")]
    pipeline["added_tokens"] += [{"id": 50257 + i, "content": digit, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True}
                                 for i, digit in enumerate("0123456789")]
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text(json.dumps(pipeline))
    return out / "tokenizer.json"


def test_digits_that_are_special_tokens_are_refused_at_inspect_and_at_start_up(shared_data, tmp_path, tool, capsys):
    """Issue 40 item 2: such digits decode to nothing with skip_special_tokens=True ('12+3=15' -> '+=', as
    evaluation decodes), yet inspect said "NTL can use this tokenizer as it is" and number-vocab wrote them."""
    from ntl_pretrain.config import load_config
    from ntl_pretrain.trainer.preflight import number_vocab_for
    from ntl_pretrain.trainer.training_objective import Objective

    path = _gpt2_with_special_digits(shared_data, tmp_path / "special_digits")
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode("12+3=15", add_special_tokens=False)
    assert tokenizer.decode(ids) == "12+3=15" and tokenizer.decode(ids, skip_special_tokens=True) == "+="
    assert tool["main"](["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: NOT digit-level" in out and "are special added tokens" in out and '"special": false' in out
    assert "NTL can use this tokenizer as it is" not in out
    assert tool["main"](["number-vocab", str(path), "--out", str(tmp_path / "nv.json")]) == 2
    assert "are special added tokens" in capsys.readouterr().err and not (tmp_path / "nv.json").exists()
    for overrides in (["loss.ntl_weight=0.3"], ["loss.enabled=false"]):  # the trainer's and evaluation's start-up
        cfg = load_config(None, ["model.architecture.model_type=llama", f"tokenizer.name_or_path={path}",
                                 "data.sources.0.path=c.jsonl", *overrides])
        with pytest.raises(ValueError, match=r"are special added tokens.*\"special\": false"):
            number_vocab_for(cfg, Objective.from_config(cfg.loss), tokenizer)


def test_two_digits_sharing_one_id_are_named(shared_data, tmp_path, tool, capsys):
    """Issue 40 item 6: vocab["1"] = 15 (the id of "0") said "missing ['1']" although "1" is there."""
    pipeline = json.loads((shared_data / "tokenizers" / "gpt2" / "tokenizer.json").read_text())
    pipeline["model"]["vocab"]["1"] = 15
    (tmp_path / "shared_id").mkdir()
    path = tmp_path / "shared_id" / "tokenizer.json"
    path.write_text(json.dumps(pipeline))
    for command in (["number-vocab", str(path), "--out", str(tmp_path / "nv.json")], ["inspect", str(path)],
                    ["inspect", str(path.parent)]):
        assert tool["main"](command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the tokens ['0', '1'] share the id 15" in err and "missing" not in err, err


def test_number_vocabulary_refuses_digits_sharing_an_id():
    """The same refusal for a tokenizer object that bypasses the loader (NumberVocab.from_tokenizer itself)."""
    from ntl_pretrain.numbers import NumberVocab

    class Shared:
        name_or_path = "shared"

        def get_vocab(self):
            return {**{d: 10 + i for i, d in enumerate("0123456789")}, "1": 10, "a": 0, "b": 1}

        def __len__(self):
            return 20

    with pytest.raises(ValueError, match=r"the number tokens \['0', '1'\] of tokenizer 'shared' share the id 10"):
        NumberVocab.from_tokenizer(Shared())


def test_split_digits_of_a_tokenizer_whose_bare_digits_were_removed(shared_data, tmp_path, tool, capsys):
    """Issue 40 item 7: the original (GPT-2 without "0".."9", no <unk>) decodes "2024" to "", the converted keeps
    it; that was reported as "the converted tokenizer failed verification". It is text restored, as for <unk>."""
    pipeline = json.loads((shared_data / "tokenizers" / "gpt2" / "tokenizer.json").read_text())
    for digit in "0123456789":
        del pipeline["model"]["vocab"][digit]
    pipeline["model"]["merges"] = [merge for merge in pipeline["model"]["merges"]
                                   if not set(merge.split(" ") if isinstance(merge, str) else merge) & set("0123456789")]
    (tmp_path / "no_digits").mkdir()
    (tmp_path / "no_digits" / "tokenizer.json").write_text(json.dumps(pipeline))
    original = load_tokenizer(tmp_path / "no_digits")
    assert original.decode(original.encode("In 2024, 12 cats", add_special_tokens=False)) == "In ,  cats"
    assert tool["main"](["split-digits", str(tmp_path / "no_digits"), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "PASS (b)" in out and "restores text that the original lost" in out, out
    converted = load_tokenizer(tmp_path / "out")
    assert converted.decode(converted.encode("In 2024, 12 cats", add_special_tokens=False)) == "In 2024, 12 cats"


def test_a_binary_corpus_is_refused_not_verified_on(gpt2_style, tmp_path):
    """A gzip file given as --corpus was read with its undecodable bytes replaced, and the conversion "verified"
    on that noise."""
    import gzip

    packed = tmp_path / "corpus.txt.gz"
    packed.write_bytes(gzip.compress(("In 2024 the town counted 12345 residents.\n" * 200).encode()))
    with pytest.raises(ValueError, match=r"corpus.txt.gz' is not text: \d+ of its characters are not UTF-8"):
        split_digits(gpt2_style, tmp_path / "out", corpus=packed)
    assert not (tmp_path / "out").exists()
    text = tmp_path / "accents.txt"
    text.write_text("Café 12, naïve 3.5 — “quoted” 2024\n" * 20, encoding="utf-8")
    assert read_corpus(text)  # real UTF-8 text beyond ASCII is text


def test_inspect_flags_added_tokens_that_hide_digits_as_the_trainer_does(gpt2_style, tmp_path, tool, capsys):
    """A digit-level tokenizer with an added token "07": inspect said "NTL can use this tokenizer as it is", the
    trainer refused it at start-up (numbers.digit_hiding_added_tokens)."""
    split_digits(gpt2_style, tmp_path / "split")
    pipeline = json.loads((tmp_path / "split" / "tokenizer.json").read_text())
    pipeline["added_tokens"].append({"id": max(t["id"] for t in pipeline["added_tokens"]) + 1000, "content": "07",
                                     "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": False})
    (tmp_path / "split" / "tokenizer.json").write_text(json.dumps(pipeline))
    tokenizer = load_tokenizer(tmp_path / "split")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2007", add_special_tokens=False)) == ["2", "0", "07"]
    assert tool["main"](["inspect", str(tmp_path / "split")]) == 0
    out = capsys.readouterr().out
    assert "verdict: NOT digit-level" in out and "added token(s) begin or end with a digit ('07')" in out, out
    assert "NTL can use this tokenizer as it is" not in out


def test_a_staging_folder_left_by_a_killed_run_is_removed_by_the_next(gpt2_style, tmp_path, tool):
    """Issue 40 defect 1: `kill -9` of `tools/tokenizer.py split-digits IN OUT` while it wrote left `.OUT.tmp-*`
    beside OUT forever. The next run removes the staging folders of its own (they hold the marker naming a
    process that no longer runs) and nothing else: not a folder of the same pattern without the marker, nor one
    whose writer still runs."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "OUT"
    killed = subprocess.run(  # a run killed while it writes into its staging folder (atomic_directory)
        [sys.executable, "-c", "import os, signal, sys\nfrom ntl_pretrain.core.fs import atomic_directory\n"
         "with atomic_directory(sys.argv[1]) as staging:\n"
         "    open(os.path.join(staging, 'tokenizer.json'), 'w').write('{\"half')\n"
         "    os.kill(os.getpid(), signal.SIGKILL)\n", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    [stale] = _leftovers(tmp_path)
    assert stale.startswith(".OUT.tmp-")
    mine = tmp_path / ".OUT.tmp-mine"  # a user's folder of the same pattern, without the marker
    (mine / "notes").mkdir(parents=True)
    running = tmp_path / ".OUT.tmp-running"  # a writer that still runs (pid 1)
    running.mkdir()
    (running / ".ntl-staging.json").write_text(json.dumps({"pid": 1, "host": os.uname().nodename}))
    assert tool["main"](["split-digits", str(gpt2_style), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and not (out / ".ntl-staging.json").exists()
    assert _leftovers(tmp_path) == [".OUT.tmp-mine", ".OUT.tmp-running"] and (mine / "notes").is_dir()


def test_a_replacement_killed_after_moving_the_old_folder_aside_is_cleaned_by_the_next(gpt2_style, tmp_path, tool):
    """`split-digits --force IN OUT` killed between moving the old OUT aside (`.OUT.old-*`) and renaming its new
    folder onto OUT left both folders forever. Each holds the marker from before the move, so the next run for OUT
    removes both and writes OUT; a user's `.OUT.old-*` without the marker stays."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "OUT"
    assert tool["main"](["split-digits", str(gpt2_style), str(out)]) == 0
    killed = subprocess.run(  # killed right after the old OUT moved aside (commit_directory with replace)
        [sys.executable, "-c", "import os, signal, sys\nfrom ntl_pretrain.core.fs import atomic_directory\n"
         "rename = os.rename\n"
         "def rename_then_die(source, target):\n"
         "    rename(source, target)\n"
         "    if '.OUT.old-' in target:\n"
         "        os.kill(os.getpid(), signal.SIGKILL)\n"
         "os.rename = rename_then_die\n"
         "with atomic_directory(sys.argv[1], replace=True) as staging:\n"
         "    open(os.path.join(staging, 'tokenizer.json'), 'w').write('{}')\n", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists() and [name[:9] for name in _leftovers(tmp_path)] == [".OUT.old-", ".OUT.tmp-"]
    (tmp_path / ".OUT.old-users").mkdir()  # not ours: no marker
    assert tool["main"](["split-digits", str(gpt2_style), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and _leftovers(tmp_path) == [".OUT.old-users"]


def test_number_vocab_writes_over_an_earlier_vocabulary_only(gpt2_style, tmp_path, tool, capsys):
    """Issue 40, go-beyond round: `number-vocab TOK --out model/config.json` replaced the model's config.json
    without a word, and an --out that was a symbolic link was replaced by a file."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not a number vocabulary, so it is not replaced" in err, err
    assert config.read_text() == '{"model_type": "llama"}'
    assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(tmp_path / "link.json")]) == 2
    assert "exists and is a symbolic link" in capsys.readouterr().err and (tmp_path / "link.json").is_symlink()
    for _ in range(2):  # a new file, then the same vocabulary written again
        assert tool["main"](["number-vocab", str(gpt2_style), "--out", str(tmp_path / "nv.json"), "--allow-non-digit-level"]) == 0
    assert json.loads((tmp_path / "nv.json").read_text())["tokens"] == [str(d) for d in range(10)]


def test_a_write_that_fails_for_size_is_one_line_and_leaves_nothing(gpt2_style, tmp_path, tool, capsys):
    """Issue 40, go-beyond round: a full disk or a file-size limit (`ulimit -f`) while split-digits saved came out
    as tokenizers' bare `Exception: File too large (os error 27)` with a traceback; it is now one line."""
    import resource

    limit = (gpt2_style / "tokenizer.json").stat().st_size // 2
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        code = tool["main"](["split-digits", str(gpt2_style), str(tmp_path / "OUT")])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    # split-digits says each phase it starts as a "[  0.0 s] ..." line; the error is one line after them
    assert code == 2 and [line for line in err.splitlines() if not line.startswith("[")] == [err.splitlines()[-1]], err
    assert f"cannot write {str(tmp_path / 'OUT')!r}: File too large (nothing was written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_normalizer_that_rewrites_digits_is_refused_by_every_tool_and_at_start_up(shared_data, tmp_path, tool,
                                                                                      capsys):
    """GPT-2 with a normalizer rule "7" -> "seven": its digit tokens exist, but no '7' of the text ever reaches one,
    so NTL would silently act on fewer digits (none at all for a rule on every digit). inspect says so, number-vocab
    and split-digits refuse in one line and write nothing (a digit split cannot undo a normalizer), NTL refuses at
    start-up, a CE-only run trains (its number-token figures are only monitored)."""
    from ntl_pretrain.config import load_config
    from ntl_pretrain.trainer.preflight import number_vocab_for
    from ntl_pretrain.trainer.training_objective import Objective

    pipeline = json.loads((shared_data / "tokenizers" / "gpt2" / "tokenizer.json").read_text())
    pipeline["normalizer"] = {"type": "Replace", "pattern": {"String": "7"}, "content": "seven"}
    (tmp_path / "sevens").mkdir()
    path = tmp_path / "sevens" / "tokenizer.json"
    path.write_text(json.dumps(pipeline))
    expected = "does not keep digits: '7'"
    assert tool["main"](["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: NOT digit-level" in out and expected in out and "split-digits" not in out.split("verdict")[1]
    for command in (["number-vocab", str(path), "--out", str(tmp_path / "nv.json")],
                    ["split-digits", str(path), str(tmp_path / "split")]):
        assert tool["main"](command) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0] and "normalizer" in errors[0], errors
    assert not (tmp_path / "nv.json").exists() and not (tmp_path / "split").exists()
    tokenizer = load_tokenizer(path)
    cfg = load_config(None, ["model.architecture.model_type=llama", f"tokenizer.name_or_path={path}",
                             "data.sources.0.path=c.jsonl", "tokenizer.digit_level=false"])
    with pytest.raises(ValueError, match=r"NTL is on .* does not keep digits.*Or train with CE only"):
        number_vocab_for(cfg, Objective.from_config(cfg.loss), tokenizer)
    cfg = load_config(None, ["model.architecture.model_type=llama", f"tokenizer.name_or_path={path}",
                             "data.sources.0.path=c.jsonl", "loss.enabled=false"])
    assert number_vocab_for(cfg, Objective.from_config(cfg.loss), tokenizer).digit_level


def test_a_folder_with_only_gpt2s_vocab_and_merges_loads_as_gpt2(gpt2_style, tmp_path):
    """Issue 47: a folder of GPT-2's own files (vocab.json + merges.txt, nothing naming a class) was refused with
    transformers' "install sentencepiece or tiktoken" (both were installed); it loads as GPT-2's byte-level BPE and
    encodes as the full pipeline (tokenizer.json) of the same vocabulary does."""
    from tokenizers import Tokenizer

    full = Tokenizer.from_file(str(gpt2_style / "tokenizer.json"))
    folder = tmp_path / "gpt2_files"
    folder.mkdir()
    full.model.save(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["merges.txt", "vocab.json"]
    tokenizer = load_tokenizer(folder)
    for text in ("The price rose 12.5% to 3,400 dollars.", " leading space and 007", "x=-42\n"):
        assert tokenizer(text, add_special_tokens=False).input_ids == full.encode(text).ids, text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.convert_tokens_to_ids("<|endoftext|>") == \
        full.token_to_id("<|endoftext|>")
