"""The one shared writer (core/fs.py `atomic_write`) never puts a file in place of what is not a file (issue 47
item 1: run as root, `tools/evaluate.py --json /dev/null` renamed a temporary file over /dev/null for every process
of the machine), writes the standard streams when they are named, and names the user's path, not a temporary
file's, when the folder cannot be written."""

from __future__ import annotations

import json
import os
import runpy
import stat
from pathlib import Path

import pytest

from ntl_pretrain.core.fs import OutputPathError, atomic_write, write_json_atomic, write_text_atomic

pytestmark = pytest.mark.fast
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_rename_over_a_non_file(monkeypatch):
    """A regression must fail the test, not replace the machine's /dev/null (these tests may run as root)."""
    rename = os.replace

    def guarded(source, target, *args, **kwargs):
        if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
            pytest.fail(f"renamed a file over {target!r}, which is not a regular file")
        return rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", guarded)


def _targets(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """(path, what the refusal says it is) for each kind of target that is not a regular file."""
    fifo, link, folder = tmp_path / "fifo", tmp_path / "link-to-null", tmp_path / "folder"
    os.mkfifo(fifo)
    link.symlink_to("/dev/null")
    folder.mkdir()
    return {"null": ("/dev/null", "a character device"), "full": ("/dev/full", "a character device"),
            "link": (str(link), "a symbolic link to '/dev/null', a character device"),
            "fifo": (str(fifo), "a fifo"), "folder": (str(folder), "a directory")}


def test_a_target_that_is_not_a_regular_file_is_refused_and_left_as_it_was(tmp_path, no_rename_over_a_non_file):
    for name, (path, kind) in _targets(tmp_path).items():
        before = os.stat(path).st_mode
        for write, argument in ((write_json_atomic, {"a": 1}), (write_text_atomic, "x"), (atomic_write, "wb")):
            with pytest.raises(OutputPathError) as info:
                result = write(path, argument)
                if write is atomic_write:
                    result.__enter__()
            assert str(info.value) == (f"{path!r} is {kind}, not a regular file, so no file is written in its "
                                       f"place; choose a file path (or - or /dev/stdout for the standard output)"), name
        assert os.stat(path).st_mode == before, name
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISCHR(os.stat("/dev/full").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "link-to-null"]  # no temporary file left


def test_the_standard_streams_are_written_not_replaced(capfd, no_rename_over_a_non_file):
    before = os.stat("/dev/stdout").st_mode
    write_json_atomic("/dev/stdout", {"to": "stdout"})
    write_text_atomic("-", "dash\n")
    with atomic_write("/dev/stderr", "wb") as handle:
        handle.write(b"to stderr\n")
    write_text_atomic("/dev/fd/2", "fd 2\n")
    out, err = capfd.readouterr()
    assert out == '{"to": "stdout"}dash\n' and err == "to stderr\nfd 2\n"
    assert os.stat("/dev/stdout").st_mode == before and os.path.islink("/dev/stdout")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_regular_file_and_a_link_to_one_are_replaced_whole(tmp_path, no_rename_over_a_non_file):
    target = tmp_path / "m.json"
    target.write_text("old")
    write_json_atomic(target, {"new": 1})
    assert json.loads(target.read_text()) == {"new": 1}
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_atomic(link, "through the link's name")  # the link is replaced by the file, its target kept
    assert link.read_text() == "through the link's name" and not link.is_symlink()


@pytest.mark.parametrize("path, step", [("/proc/x", "creating a file in '/proc'"),
                                        ("/proc/x/m.json", "creating its folder '/proc/x'")])
def test_an_unwritable_folder_names_the_users_path_not_a_temporary_file(path, step):
    with pytest.raises(OSError) as info:
        write_json_atomic(path, {})
    assert f"cannot write {path!r}: {step} failed (" in str(info.value) and ".tmp-" not in str(info.value)
    assert "choose a path in a folder you can write" in str(info.value)


def test_evaluate_refuses_a_json_device_and_an_unwritable_output_dir_before_loading(tmp_path, capsys, monkeypatch,
                                                                                     no_rename_over_a_non_file):
    """`tools/evaluate.py --json /dev/null` and `--output-dir /proc/x`: one line, before any model loads."""
    tool = runpy.run_path(str(REPO / "tools" / "evaluate.py"))
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("loaded a model before the paths were checked")))
    cases = {("--json", "/dev/null"): "'/dev/null' is a character device, not a regular file",
             ("--json", "/dev/full"): "'/dev/full' is a character device, not a regular file",
             ("--output-dir", "/proc/x"): "--output-dir='/proc/x' is not writable (its nearest existing parent '/proc')",
             ("--json", "/proc/x/m.json"): "--json's folder='/proc/x' is not writable"}
    for (option, path), message in cases.items():
        assert tool["main"](["--model", str(tmp_path / "absent"), option, path]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), (path, errors)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_number_vocab_out_in_an_unwritable_folder_is_one_line(tmp_path, capsys):
    """`tools/tokenizer.py number-vocab --out /proc/x` named a temporary file; now the path."""
    from helpers.models import char_tokenizer

    char_tokenizer().save_pretrained(tmp_path / "tok")
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    for out, message in (("/proc/x", "error: [Errno 2] cannot write '/proc/x': creating a file in '/proc' failed"),
                         ("/dev/null", "error: --out '/dev/null' exists and is not a file")):
        assert tool["main"](["number-vocab", str(tmp_path / "tok"), "--out", out]) == 2
        errors = capsys.readouterr().err.splitlines()
        assert len(errors) == 1 and errors[0].startswith(message), errors
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert tool["main"](["number-vocab", str(tmp_path / "tok"), "--out", "/dev/stdout"]) == 0  # written, not replaced
    printed = capsys.readouterr().out
    assert json.loads(printed[:printed.index("}") + 1])["tokens"] == [str(d) for d in range(10)]
    assert os.path.islink("/dev/stdout")


def test_a_folder_written_under_a_temporary_name_names_the_users_path(tmp_path, capsys):
    """`tools/tokenizer.py split-digits TOK /proc/x` named the staging folder ('/proc/.x.tmp-...')."""
    from helpers.models import char_tokenizer

    from ntl_pretrain.core.fs import atomic_directory

    with pytest.raises(OSError) as info:
        with atomic_directory("/proc/x"):
            pass
    assert str(info.value).endswith("cannot write '/proc/x': creating a folder in '/proc' failed (No such file or "
                                    "directory); choose a path in a folder you can write")
    char_tokenizer().save_pretrained(tmp_path / "tok")
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    assert tool["main"](["split-digits", str(tmp_path / "tok"), "/proc/x"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "cannot write '/proc/x'" in errors[0] and ".tmp-" not in errors[0], errors
