"""The tokenizer of an exported GGUF file: copied from the GGUF the run was pruned from when there is one (the
llama.cpp vocabulary as it was), else built from the run's tokenizer.json (BPE merges, the pre-tokenizer named
by its split regex, special tokens); the vocabulary must match the embedding rows."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from secateur.errors import SecateurError
from secateur.export.gguf_run import (
    RUN_FIX,
    first_line,
    gguf_module,
    read_checked,
)
from secateur.safe_write import REPORT_NAME

# tokenizer.json pre-tokenizer regexes -> llama.cpp's tokenizer.ggml.pre
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")


_SPLIT_PRE = {_LLAMA3_RE: "llama-bpe", _QWEN2_RE: "qwen2"}


def source_gguf(run_path: Path) -> Path | None:
    """The GGUF a run was pruned from, when its report names one that is still there with the same content."""
    rep = run_path / REPORT_NAME
    if not rep.is_file():
        return None
    with contextlib.suppress(ValueError, OSError):
        src = (json.loads(rep.read_text()).get("model_source") or {})
        p = Path(src.get("gguf") or "")
        from secateur.models.gguf_cache import file_sha256, known_file

        if src.get("gguf") and p.is_file() and file_sha256(p) == src.get("sha256"):
            return p
        if isinstance(src.get("sha256"), str):  # a report names the file portably: found by its digest here
            return known_file(src["sha256"])
    return None


def copy_gguf_tokenizer(w, path: Path, vocab: int) -> str:
    """Copy every ``tokenizer.*`` key of the source GGUF (as its converter wrote them)."""
    g = gguf_module()
    reader = g.GGUFReader(str(path))
    n_tokens = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == g.GGUFValueType.ARRAY and len(field.types) > 1 else None
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            n_tokens = len(value)
        w.add_key_value(key, value, vtype, sub_type=sub)
    if n_tokens != vocab:
        raise SecateurError(f"the tokenizer of {path} has {n_tokens} tokens but the model {vocab} embedding rows; "
                            "pass --tokenizer-pre NAME to build the vocabulary from the run's tokenizer.json instead")
    return f"copied from {path.name}"


def _pre_of(tok: dict) -> str | None:
    """llama.cpp's pre-tokenizer name for a byte-level BPE ``tokenizer.json``, when it is one secateur knows."""
    pre = tok.get("pre_tokenizer") or {}
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (its converter writes it; "gpt2" is refused as unknown)
    if kind != "Sequence":
        return None
    parts = pre.get("pretokenizers", [])
    kinds = [p.get("type") for p in parts]
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        return _SPLIT_PRE.get((parts[0].get("pattern") or {}).get("Regex"))
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    return None


def _byte_level(tok: dict) -> bool:
    def has(node) -> bool:
        node = node or {}
        return node.get("type") == "ByteLevel" or any(has(p) for p in node.get("pretokenizers", []))
    return has(tok.get("pre_tokenizer")) or (tok.get("decoder") or {}).get("type") == "ByteLevel"


def hf_tokenizer(w, run_path: Path, vocab: int, pre: str | None) -> str:
    """``tokenizer.ggml.*`` from the folder's byte-level BPE ``tokenizer.json`` (the converter's gpt2 vocab)."""
    g = gguf_module()
    f = run_path / "tokenizer.json"
    if not f.is_file():
        raise SecateurError(f"run {run_path} has no tokenizer.json; llama.cpp needs the tokenizer in the GGUF")
    from secateur.schemas.run_folder import TokenizerFile

    tok = read_checked(f, TokenizerFile)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or not _byte_level(tok):
        raise SecateurError(f"the tokenizer of {run_path} is not a byte-level BPE ({model.get('type')}"
                            f"{', byte fallback' if model.get('byte_fallback') else ''}); secateur exports "
                            "byte-level BPE tokenizers (GPT-2, Llama-3, Qwen2, SmolLM) to GGUF")
    pre = pre or _pre_of(tok)
    if pre is None:
        raise SecateurError(f"secateur does not recognise the pre-tokenizer of {f}; pass --tokenizer-pre NAME "
                            "(llama.cpp's tokenizer.ggml.pre, e.g. gpt-2, llama-bpe, qwen2, smollm)")
    ids = dict(model.get("vocab", {}))
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        ids[a["content"]] = i
    by_id = {i: t for t, i in ids.items()}
    if max(by_id, default=-1) >= vocab:
        raise SecateurError(f"the tokenizer of {run_path} has token ids up to {max(by_id)} but the model only "
                            f"{vocab} embedding rows; {RUN_FIX}")
    tokens, types = [], []
    for i in range(vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(g.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            a = added.get(i)
            types.append(g.TokenType.NORMAL if a is None else
                         g.TokenType.CONTROL if a.get("special") else g.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    _special_tokens(w, run_path, ids)
    return f"built from tokenizer.json (gpt2 BPE, pre {pre})"


def _special_tokens(w, run_path: Path, ids: dict[str, int]) -> None:
    """BOS/EOS/UNK/PAD ids, whether BOS/EOS are added, the chat template (as transformers' tokenizer has them)."""
    from transformers import AutoTokenizer

    try:
        t = AutoTokenizer.from_pretrained(str(run_path))
        with_special = t("a")["input_ids"]
        plain = t("a", add_special_tokens=False)["input_ids"]
    except Exception as e:  # noqa: BLE001 - transformers' errors for damaged tokenizer files vary by file
        raise SecateurError(f"run {run_path}: transformers cannot load its tokenizer (tokenizer files, config.json) "
                            f"({e.__class__.__name__}: {first_line(e)}); {RUN_FIX}") from None
    for kind, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                      ("pad", w.add_pad_token_id)):
        token = getattr(t, f"{kind}_token", None)
        if isinstance(token, str) and token in ids:
            add(ids[token])
    bos, eos = getattr(t, "bos_token_id", None), getattr(t, "eos_token_id", None)
    w.add_add_bos_token(bool(bos is not None and len(with_special) > len(plain) and with_special[0] == bos))
    w.add_add_eos_token(bool(eos is not None and len(with_special) > len(plain) and with_special[-1] == eos))
    template = getattr(t, "chat_template", None)
    if isinstance(template, str) and template:
        w.add_chat_template(template)
