"""Loading tokenizers from any source users point the tools at, and writing output folders safely.

Every tool works on a Hugging Face *fast* tokenizer (a `tokenizers` pipeline): that is what the
trainer loads and what `split-digits` rewrites. transformers 5 converts slow-format files
(`vocab.json` + `merges.txt`, SentencePiece `tokenizer.model`) to fast tokenizers at load time, and
tiktoken BPE files (Meta's Llama-3 `tokenizer.model`) are converted with its `TikTokenConverter`;
tokenizers that exist only as Python code are refused with a message saying what to do instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer
from transformers import AutoTokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ..core.fs import STAGING_MARKER, atomic_directory
from .tiktoken_bpe import TIKTOKEN_SUFFIXES, is_tiktoken_bpe, load_tiktoken_file

# Files whose presence makes a folder a tokenizer folder (transformers' own file names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "vocab.json", "vocab.txt", "tekken.json")
# Files that hold a vocabulary: a folder with none of them (only tokenizer_config.json, say) holds no tokenizer.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tekken.json")
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
BPE_VOCAB, BPE_MERGES = "vocab.json", "merges.txt"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # a GPT-2 style byte-level BPE without tokenizer.json
# tokenizer_config.json classes that mean "tokenizer.json as it is" (transformers 4 name, transformers 5 name)
GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Per-call encoding options a tokenizer.json may carry; files this project writes never keep them.
ENCODING_SETTINGS = ("truncation", "padding")
# Vocabulary files of slow tokenizers; beside a rewritten tokenizer.json they would describe another tokenization.
# In every folder the tools write: what they wrote there. `--force` replaces only a folder holding it (and nothing else).
OUTPUT_MARKER = ".ntl_tokenizer_output.json"
STALE_VOCAB_FILES = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "added_tokens.json")


class TokenizerLoadError(ValueError):
    """The source names no usable fast tokenizer; the message says why and what to do."""


def load_tokenizer(source: str | os.PathLike, trust_remote_code: bool = False) -> TokenizersBackend:
    """Load a fast tokenizer from a folder, a `tokenizer.json`, a SentencePiece `.model`, a tiktoken BPE file
    (`.model`, `.tiktoken`) or a hub id.

    Raises `TokenizerLoadError` for paths that hold no tokenizer, corrupt files, and slow tokenizers
    that have no fast equivalent.
    """
    path = Path(source)
    if path.is_file():
        if path.suffix == ".json":
            tokenizer = _load_tokenizer_json(path)
        elif path.suffix in TIKTOKEN_SUFFIXES and is_tiktoken_bpe(path):
            tokenizer = _load_tiktoken(path)
        elif path.suffix == ".model":
            tokenizer = _load_sentencepiece_model(path)
        else:
            raise TokenizerLoadError(
                f"{str(path)!r} is not a tokenizer: expected a tokenizer folder, a tokenizer.json file, a "
                f"SentencePiece .model file or a tiktoken BPE file (.model, .tiktoken)")
    elif path.is_dir():
        tokenizer = _load_folder(path, trust_remote_code)
    elif path.exists():
        raise TokenizerLoadError(f"tokenizer path {str(path)!r} is neither a regular file nor a folder (a pipe or a "
                                 f"device?): point at the tokenizer's folder or its tokenizer.json")
    elif os.path.isabs(source) or str(source).startswith((".", "~")) or str(source).count("/") > 1:
        raise TokenizerLoadError(f"tokenizer path {str(source)!r} does not exist")
    else:
        tokenizer = _load_hub_id(str(source), trust_remote_code)
    return ensure_fast(tokenizer, str(source))


def ensure_fast(tokenizer, source: str = "") -> TokenizersBackend:
    """Return the tokenizer if it is fast; refuse a slow (Python) one with a message naming the fix."""
    if getattr(tokenizer, "is_fast", False) and isinstance(tokenizer, TokenizersBackend):
        return tokenizer
    name = type(tokenizer).__name__
    raise TokenizerLoadError(
        f"tokenizer {source or name!r} is a slow (Python) tokenizer ({name}) without a fast equivalent: transformers "
        f"has no `tokenizers` pipeline for it, so its number handling cannot be rewritten. Use a model whose "
        f"tokenizer ships a tokenizer.json (or a SentencePiece tokenizer.model), or train a digit-level tokenizer "
        f"with: python tools/tokenizer.py train-spm CORPUS OUT_DIR --vocab-size N")


def _check_vocabulary_ids(pipeline: dict, path: Path) -> None:
    """Refuse a model vocabulary in which two tokens share an id: tokenizers loads it, but an id then stands for
    two tokens (NTL's "1" would read as "0"), and copying the tokenizer fails at random (its id -> token table
    keeps one of them)."""
    vocab = (pipeline.get("model") or {}).get("vocab") if isinstance(pipeline.get("model"), dict) else None
    if isinstance(vocab, (dict, list)) and not vocab:  # loads, then every text fails to encode (a raw Exception)
        raise TokenizerLoadError(f"{str(path)!r}: its {pipeline['model'].get('type', '')} model vocabulary is empty, "
                                 f"so no text can be encoded: restore the file from the model's source")
    if not isinstance(vocab, dict):
        return  # Unigram keeps a list (ids are positions); anything else is the loader's to refuse
    by_id: dict[object, list[str]] = {}
    for token, token_id in vocab.items():
        by_id.setdefault(token_id, []).append(token)
    shared = sorted(((tokens, token_id) for token_id, tokens in by_id.items() if len(tokens) > 1), key=str)
    if shared:
        tokens, token_id = shared[0]
        raise TokenizerLoadError(f"{str(path)!r}: the tokens {tokens[:5]} share the id {token_id!r} in its model "
                                 f"vocabulary ({len(shared)} id(s) shared); every token needs its own id: restore "
                                 f"the file from the model's source")


def _load_tokenizer_json(path: Path) -> TokenizersBackend:
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed JSON
        raise TokenizerLoadError(
            f"{str(path)!r} is not a valid tokenizer.json ({error}). Re-export it with "
            f"tokenizer.save_pretrained(folder) or point at the tokenizer's folder") from None
    _check_vocabulary_ids(json.loads(path.read_text(encoding="utf-8")), path)  # valid JSON: tokenizers read it
    try:
        tokenizer = TokenizersBackend(tokenizer_object=backend)
    except Exception as error:  # transformers copies the pipeline; tokenizers raises a bare Exception
        raise TokenizerLoadError(f"{str(path)!r} could not be loaded: {_one_line(error)}. Restore it from the "
                                 f"model's source") from None
    tokenizer.name_or_path = str(path)
    return tokenizer


def _load_sentencepiece_model(path: Path) -> TokenizersBackend:
    """Convert a SentencePiece model with transformers' generic converter (it follows the model's own
    normalizer spec, so it encodes like `SentencePieceProcessor.encode`)."""
    _check_sentencepiece_model(path)
    with tempfile.TemporaryDirectory(prefix="ntl-spm-") as folder:
        shutil.copyfile(path, os.path.join(folder, SENTENCEPIECE_MODEL))
        try:
            tokenizer = TokenizersBackend.from_pretrained(folder)
        except Exception as error:
            raise TokenizerLoadError(f"could not convert SentencePiece model {str(path)!r}: {error}") from None
    tokenizer.name_or_path = str(path)
    return tokenizer


def _load_tiktoken(path: Path) -> TokenizersBackend:
    """A tiktoken BPE file (Meta's Llama-3 tokenizer.model) through transformers' TikTokenConverter."""
    try:
        return load_tiktoken_file(path)
    except ValueError as error:
        raise TokenizerLoadError(str(error)) from None


def _check_sentencepiece_model(path: Path) -> None:
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as error:
        raise TokenizerLoadError(f"{str(path)!r} is not a valid SentencePiece model ({error})") from None


def _read_json_object(path: Path, fix: str) -> dict:
    """A JSON file that must hold an object; anything else is one line naming the file and `fix`."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TokenizerLoadError(f"{str(path)!r} is corrupt: not valid JSON ({error}). {fix}") from None
    if not isinstance(value, dict):
        raise TokenizerLoadError(f"{str(path)!r} holds a JSON {type(value).__name__}, not an object. {fix}")
    return value


def _load_folder(path: Path, trust_remote_code: bool) -> TokenizersBackend:
    for name in TOKENIZER_FILES:
        if (path / name).exists() and not (path / name).is_file():
            raise TokenizerLoadError(f"{str(path / name)!r} is not a regular file (a folder?): put the tokenizer's "
                                     f"{name} there, or point at the folder that holds it")
    present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not present:
        raise TokenizerLoadError(
            f"folder {str(path)!r} holds no tokenizer: none of {', '.join(TOKENIZER_FILES)} is in it")
    restore = "Restore it from the model's source, or save the tokenizer again with tokenizer.save_pretrained(folder)"
    if (path / TOKENIZER_JSON).is_file():
        pipeline = _read_json_object(path / TOKENIZER_JSON, restore)
        if "model" not in pipeline:
            raise TokenizerLoadError(f"{str(path / TOKENIZER_JSON)!r} is not a tokenizers pipeline (it has no 'model' "
                                     f"entry). {restore}")
        _check_vocabulary_ids(pipeline, path / TOKENIZER_JSON)
    if (path / TOKENIZER_CONFIG).is_file():
        _read_json_object(path / TOKENIZER_CONFIG, restore)
    no_vocabulary = None if any(name in VOCABULARY_FILES for name in present) else TokenizerLoadError(
        f"folder {str(path)!r} holds {', '.join(present)} but no vocabulary (none of {', '.join(VOCABULARY_FILES)}): "
        f"copy the tokenizer's tokenizer.json (or tokenizer.model) from the model's source into it, or save the "
        f"tokenizer there with tokenizer.save_pretrained(folder)")
    if not (path / TOKENIZER_CONFIG).is_file() and not (path / TOKENIZER_JSON).is_file():
        model = path / SENTENCEPIECE_MODEL if (path / SENTENCEPIECE_MODEL).is_file() else path / "spiece.model"
        if model.is_file():
            tokenizer = _load_tiktoken(model) if is_tiktoken_bpe(model) else _load_sentencepiece_model(model)
            tokenizer.name_or_path = str(path)
            return tokenizer
        if BPE_VOCAB in present and (path / BPE_MERGES).is_file() and not (path / "config.json").is_file():
            # GPT-2's own files: no file names the class, and AutoTokenizer asked to install sentencepiece or
            # tiktoken (both were installed); read as GPT-2's byte-level BPE
            from transformers import GPT2TokenizerFast

            try:
                return GPT2TokenizerFast.from_pretrained(str(path))
            except Exception as error:
                raise TokenizerLoadError(f"could not load {BPE_VOCAB} and {BPE_MERGES} of folder {str(path)!r} as a "
                                         f"GPT-2 byte-level BPE tokenizer: {_one_line(error)}. {restore}") from None
    if _declares_generic_class(path):
        # Saved by this project (or declared generic): load tokenizer.json as it is. AutoTokenizer would
        # let a config.json beside it (model_type qwen2, phi3, ...) pick the family's class, which
        # rebuilds its own pipeline from the vocabulary and drops a digit split.
        try:
            return TokenizersBackend.from_pretrained(str(path))
        except Exception as error:
            raise TokenizerLoadError(f"could not load the tokenizer.json of folder {str(path)!r}: "
                                     f"{_one_line(error)}") from None
    try:  # AutoTokenizer also reads config.json, which names the model's tokenizer class and special tokens
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as error:
        if BPE_VOCAB in present and not (path / BPE_MERGES).exists() and not (
                set(present) & (set(VOCABULARY_FILES) - {BPE_VOCAB})):
            # transformers' message asks to install sentencepiece or tiktoken, which would not help
            raise TokenizerLoadError(f"folder {str(path)!r} holds {BPE_VOCAB} but no {BPE_MERGES}: a byte-level BPE "
                                     f"tokenizer (GPT-2 style) needs both; copy {BPE_MERGES} from the model's source "
                                     f"(or its tokenizer.json)") from None
        raise no_vocabulary or TokenizerLoadError(
            f"could not load a tokenizer from folder {str(path)!r} (it holds {', '.join(present)}): "
            f"{_one_line(error)}") from None
    # without a vocabulary file a fast class builds an EMPTY tokenizer (LlamaTokenizer: 3 tokens); a slow one
    # (ByT5, byte-level by design) is refused by ensure_fast with its own message
    if no_vocabulary is not None and getattr(tokenizer, "is_fast", False):
        raise no_vocabulary
    return tokenizer


def _one_line(error: Exception) -> str:
    """An exception from transformers or tokenizers as one line with its type (their messages span several)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _declares_generic_class(path: Path) -> bool:
    """The folder has a tokenizer.json and its tokenizer_config.json names the generic fast class."""
    if not (path / TOKENIZER_JSON).is_file() or not (path / TOKENIZER_CONFIG).is_file():
        return False
    try:
        config = json.loads((path / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TokenizerLoadError(f"{str(path / TOKENIZER_CONFIG)!r} is not valid JSON ({error})") from None
    return (isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_CLASSES
            and "auto_map" not in config)


def _load_hub_id(name: str, trust_remote_code: bool) -> TokenizersBackend:
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise TokenizerLoadError(
            f"{name!r} is neither a local path nor a loadable Hugging Face Hub tokenizer ({_one_line(error)}; "
            f"working directory {os.getcwd()})") from None


def without_encoding_settings(backend_json: dict) -> dict[str, dict]:
    """Drop the `truncation` and `padding` of a tokenizer.json (in place); returns what was there.

    They are per-call encoding options: transformers sets them on every call from its own arguments,
    and kept in the file they would make direct `tokenizers` users cut (e.g. at 128 tokens) or pad text.
    """
    removed = {key: backend_json[key] for key in ENCODING_SETTINGS if backend_json.get(key) is not None}
    for key in removed:
        backend_json[key] = None
    return removed


def save_verbatim(tokenizer: TokenizersBackend, folder: str | os.PathLike, backend_json: dict | None = None) -> None:
    """Save the tokenizer into `folder` so that it loads back as exactly this pipeline.

    `tokenizer.json` is `backend_json` (default: the tokenizer's own pipeline) without truncation and
    padding; `tokenizer_config.json` (special tokens, chat template) names the generic fast class
    (`load_verbatim`); vocabulary files of slow tokenizers are removed.
    """
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder))
    pipeline = dict(backend_json if backend_json is not None else json.loads(tokenizer.backend_tokenizer.to_str()))
    without_encoding_settings(pipeline)
    Tokenizer.from_str(json.dumps(pipeline)).save(str(folder / TOKENIZER_JSON))
    load_verbatim(folder)
    for name in STALE_VOCAB_FILES:
        (folder / name).unlink(missing_ok=True)


def load_verbatim(folder: str | os.PathLike) -> None:
    """Make `AutoTokenizer.from_pretrained(folder)` load the folder's `tokenizer.json` as it is.

    Model-specific classes (e.g. `GPT2Tokenizer` in transformers 5) rebuild their own pipeline from
    the vocabulary and would drop changes made to `tokenizer.json`; the generic fast class does not.
    "PreTrainedTokenizerFast" is that class's name in transformers 4 and an alias in transformers 5.
    For some model types (`qwen2`, `phi3`, ...) transformers 5's AutoTokenizer uses the family's class
    whatever this file says when a config.json of that type is in the folder; `load_tokenizer` (the
    trainer's and the tools' loader) loads such a folder verbatim all the same.
    """
    path = Path(folder) / TOKENIZER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("auto_map", None)  # remote code would replace the class again
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_output_dir(out_dir: str | os.PathLike, force: bool, sources: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Refuse an output path that is a link, that is or holds one of the inputs, or that exists: with `force` an
    existing folder is replaced only if this project's tools wrote it (`OUTPUT_MARKER`) and it holds nothing else."""
    out = Path(out_dir)
    if out.is_symlink():  # a dangling link too: exists() is False for it, the final rename would fail on it
        raise FileExistsError(f"output path {str(out)!r} is a symbolic link (to {os.readlink(out)!r}), which is never "
                              f"followed or replaced; pass the real folder or a new one as OUT")
    for source in sources:
        source_path = Path(source)
        if not (source_path.exists() and out.exists()):
            continue
        source_real = source_path.resolve()
        if out.resolve() == (source_real if source_real.is_dir() else source_real.parent):
            raise FileExistsError(f"output folder {str(out)!r} is the input's folder; write to a new folder")
        if out.resolve() in source_real.parents:
            raise FileExistsError(f"output folder {str(out)!r} holds the input {str(source)!r}; replacing it would "
                                  f"delete the input: write to a new folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output path {str(out)!r} exists and is not a folder; choose another OUT")
    if out.exists() and not force:
        raise FileExistsError(f"output folder {str(out)!r} already exists; pass --force to replace it")
    if out.exists():
        _check_replaceable(out)
    return out


def _check_replaceable(out: Path) -> None:
    """`--force` deletes the old folder: only one our tools wrote (their marker, listing the files they wrote)
    and that holds nothing else; an empty folder too."""
    present = sorted(os.listdir(out))
    if not present:
        return
    marker = out / OUTPUT_MARKER
    refuse = (f"--force replaces only a folder that tools/tokenizer.py wrote; choose a new OUT, or move away what "
              f"you want to keep and remove {str(out)!r} yourself")
    written: object = None
    if marker.is_file() and not marker.is_symlink():
        try:
            written = json.loads(marker.read_text(encoding="utf-8")).get("files")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            written = None
    if not isinstance(written, list):
        listed = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise FileExistsError(f"output folder {str(out)!r} was not written by tools/tokenizer.py (no valid "
                              f"{OUTPUT_MARKER}; it holds {listed}): {refuse}")
    foreign = [name for name in present if name not in written and name != OUTPUT_MARKER]
    if foreign:
        raise FileExistsError(f"output folder {str(out)!r} holds files tools/tokenizer.py did not write "
                              f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}): {refuse}")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out_dir` that becomes `out_dir` only if the block succeeds.

    A failure (or an interrupt) leaves any previous `out_dir` untouched and no half-written folder. The
    folder gets `OUTPUT_MARKER`, the list of what was written, so that `--force` may replace it later.
    """
    out = check_output_dir(out_dir, force)
    with atomic_directory(out, replace=force) as staging:
        try:
            yield Path(staging)
        except Exception as error:  # tokenizers reports a failed write as a bare Exception("... (os error 28)")
            code = _OS_ERROR.search(str(error)) if type(error) is Exception else None
            if code is None:
                raise
            number = int(code.group(1))
            raise OSError(number, f"cannot write {str(out)!r}: {os.strerror(number)} (nothing was written; "
                                  f"free space or choose another folder)") from None
        files = sorted(set(os.listdir(staging)) - {STAGING_MARKER}) + [OUTPUT_MARKER]
        (Path(staging) / OUTPUT_MARKER).write_text(
            json.dumps({"written_by": "ntl_pretrain tools/tokenizer.py", "files": files}, indent=1) + "\n",
            encoding="utf-8")
