"""The options of ``secateur prune`` (:class:`PruneOptions`) and its recipes (``secateur-recipe.yaml``).

Everything here needs no model: the options are validated (:meth:`PruneOptions.validate`) before anything is
loaded or written, a recipe is read back into options (:func:`options_from_recipe`), and a run's recipe is the
options that determine its result plus the digests a replay is checked against (:func:`recipe_of`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from secateur.calib import resume as _resume
from secateur.data.sources import read_text_file, resolve_data_dir
from secateur.errors import SecateurError, check_fraction
from secateur.methods.knobs import MethodOptions, flag_of
from secateur.methods.registry import STREAMABLE, method_options, resolve
from secateur.methods.structured import REFUSED
from secateur.models.digest import known_model, local_digest
from secateur.models.loading import check_device, check_tokenizer
from secateur.models.spec import ModelSpec
from secateur.safe_write import check_output_dir, model_paths
from secateur.schemas.api import check_common, plain_paths
from secateur.schemas.recipe import RECIPE_SCHEMA, read_recipe


@dataclass
class RunSettings:
    """How the calibration passes run and report progress (``--mode``, ``--chunk-size``, ``--quiet``); the flat
    keywords ``mode=``, ``chunk_size=``, ``quiet=`` of :meth:`PruneOptions.from_kwargs` and ``api.prune``."""

    mode: str = "sequential"  # sequential | dense-block | dense (secateur.calib.engine)
    chunk_size: int = 8  # sequences per forward
    quiet: bool = False  # no progress bars

    def validate(self) -> None:
        if self.chunk_size < 1:
            raise SecateurError(f"--chunk-size must be >= 1 (sequences per forward), got {self.chunk_size}; "
                                "pass e.g. 8")


@dataclass
class PruneOptions:
    """The options of ``secateur prune``: what every run has (the model, the calibration, the output, the device
    and dtype, the seed), ``run``, the :class:`RunSettings`, and ``method_options``, the method's typed knobs (its
    :class:`~secateur.methods.knobs.MethodOptions` subclass, e.g.
    :class:`~secateur.methods.structured.StructuredOptions`; ``None``: every knob unset), such as an unstructured
    method's ``pattern`` or a structured one's ``units``. :meth:`from_kwargs` builds it from flat keywords
    (``compensation="coec", coec_rounds=2, chunk_size=4``), as ``api.prune`` and the CLI do, and :meth:`to_dict`
    records it flat. ``model`` is a name, folder or ``.gguf`` file, or an already loaded model (then pass its
    ``tokenizer``)."""

    model: str | torch.nn.Module = "smollm2-135m"
    method: str = "wanda"
    sparsity: float = 0.5
    calib: str = "self"
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    data_dir: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    out: str | None = None
    overwrite: bool = False
    resume: bool = False  # continue a killed run from its checkpoint beside --out (secateur.calib.resume)
    structured: bool = False  # --structured: magnitude/wanda -> magnitude-sp/wanda-sp
    tokenizer: Any = None  # the tokenizer of an in-memory ``model``
    stream: bool = False  # --stream: one decoder block in memory at a time (secateur.models.streaming)
    eval_ppl: str | None = None  # --eval-ppl: perplexity of the pruned model on this corpus, in the report and card
    eval_windows: int | None = None  # --eval-windows: only the first N windows of --eval-ppl
    towers: str | None = None  # --towers: the tower of a vision-language model to prune (secateur.models.towers)
    recipe_check: dict | None = None  # a replayed recipe's digests to check (calibration_sha256, model_sha256)
    run: RunSettings = field(default_factory=RunSettings)
    method_options: MethodOptions | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> PruneOptions:
        """Common fields and run settings by name, every other keyword a knob of the method (``None`` = unset),
        validated into the method's typed options; a knob of another method is refused."""
        if "extra" in kwargs:
            raise SecateurError("extra= is gone: pass the method's knobs as plain keywords (compensation='coec', "
                                "coec_rounds=2, ...)")
        common = plain_paths({k: kwargs.pop(k) for k in list(kwargs) if k in _COMMON})
        if isinstance(common.get("model"), os.PathLike):
            common["model"] = os.fspath(common["model"])
        run = RunSettings(**{k: common.pop(k) for k in _RUN if k in common})
        opts = cls(**common, run=run)
        check_common(opts._common_values())
        opts.structured = bool(opts.structured)
        opts.method_options = method_options(resolve(opts.method, opts.structured), kwargs)
        return opts

    @property
    def in_memory(self) -> bool:
        return ModelSpec(self.model).in_memory

    @property
    def model_name(self) -> str:
        """The model spec, or an in-memory model's ``config._name_or_path`` (:attr:`ModelSpec.name`)."""
        return ModelSpec(self.model).name

    def _common_values(self) -> dict[str, Any]:
        """The common fields and the run settings by name (as :func:`check_common` types them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("run", "method_options")} \
            | {k: getattr(self.run, k) for k in _RUN}

    def _record(self, name: str) -> Any:
        """The value of ``name`` (a key of :data:`RECORD`) as the flat record holds it."""
        if name == "model":
            return self.model_name
        if name in FLAT_KNOBS:  # a knob of some methods only: its default where this method has it unset or none
            v = getattr(self.method_options, name, None)
            return FLAT_KNOBS[name] if v is None else v
        return getattr(self.run, name) if name in _RUN else getattr(self, name)

    def to_dict(self) -> dict:
        """The options as reports and checkpoints record them, flat: the keys of :data:`RECORD` in its order (the
        model by name; ``pattern``, ``budget``, ``rounding``, ``targets`` for every method, as before they were
        knobs), then every other knob of the method (``None`` = unset)."""
        d = {k: self._record(k) for k in RECORD}
        for k in ("stream", "eval_ppl", "eval_windows", "towers"):  # reports of ordinary runs stay as they were
            if not d[k]:
                del d[k]
        knobs = self.method_options.to_dict() if self.method_options is not None else {}
        return d | {k: v for k, v in knobs.items() if k not in FLAT_KNOBS}

    def recipe(self) -> dict:
        """Every option that determines the result (``secateur-recipe.yaml`` without its checks): the common
        fields but the neutral ones (output, verbosity, resume, evaluation) and every knob of the method."""
        d = {k: v for k, v in self.to_dict().items() if k not in RECIPE_NEUTRAL}
        return {"secateur_recipe": RECIPE_SCHEMA} | d

    def command_line(self) -> str:
        """The ``secateur prune`` command with these options: the flags of the common fields that differ from
        their defaults (model, method, sparsity and calibration always) and of every knob that is set (an
        API-only knob, which has no flag, is named in a trailing comment)."""
        import shlex

        args = ["secateur", "prune"]
        for name in RECORD:  # the flat record's order; the FLAT_KNOBS among them where they were common fields
            v = self._record(name)
            if name not in _ALWAYS and (v == _DEFAULTS[name] or v is None):
                continue
            if isinstance(v, bool):
                args += [_FLAGS[name]] if v else []
            else:
                args += [_FLAGS[name], str(v)]
        api_only = []
        for f in (self.method_options.knob_fields() if self.method_options is not None else ()):
            v, flag = getattr(self.method_options, f.name), flag_of(f)
            if v is None or f.name in FLAT_KNOBS:
                continue
            if flag is None:
                api_only.append(f"{f.name}={v!r}")
            elif f.metadata["action"] == "boolean_optional":
                args.append(flag if v else "--no-" + flag[2:])
            elif f.metadata["action"] is not None:
                args += [flag] if v else []
            else:
                args += [flag, str(v)]
        line = shlex.join(args)
        return line + (f"  # API only: {', '.join(api_only)}" if api_only else "")

    def validate(self) -> None:
        """Every check that needs no model, so bad input fails before anything is loaded or written."""
        check_common(self._common_values())
        if not isinstance(self.model, (str, torch.nn.Module)):
            raise SecateurError(f"prune options: model: {type(self.model).__name__} {self.model!r} is not a model; "
                                "pass a Hugging Face id, a folder, a .gguf path, or a loaded torch model")
        self._check_towers()
        method = resolve(self.method, bool(self.structured))
        self.method = method.name
        if self.method_options is None:
            self.method_options = method.options()
        elif type(self.method_options) is not method.options:
            raise SecateurError(f"{method.name} takes {method.options.__name__}, not "
                                f"{type(self.method_options).__name__}")
        self.method_options.validate()
        if method.config is not None:  # the method's own configuration, e.g. structured units and compensation
            method.config(self)
        if getattr(self.method_options, "pattern", None) is None:  # an N:M pattern sets the sparsity itself
            check_fraction(self.sparsity)  # [0, 1): a pruned model keeps some weights
        if self.nsamples < 1 or self.seqlen < 2:
            raise SecateurError("--nsamples must be >= 1 and --seqlen >= 2; pass e.g. --nsamples 128 --seqlen 2048")
        self.run.validate()
        check_device(self.device)
        resolve_data_dir(self.data_dir)
        if self.calib.endswith(".txt"):  # unreadable, binary or empty: before the model is loaded
            read_text_file(self.calib)
        if self.in_memory:
            check_tokenizer(self.model, self.tokenizer)
        if self.resume and self.out is None:
            raise SecateurError("--resume continues a run into its --out folder; pass the same --out")
        if self.stream:
            self._check_stream(method)
        if self.out is not None:  # named, not the model or a parent of it, replaceable, writable
            protect = () if self.in_memory else model_paths(self.model)
            check_output_dir(self.out, self.overwrite, protect=protect)
            _resume.refuse_link(_resume.checkpoint_dir(self.out), self.out)  # a checkpoint through a link

    def _check_towers(self) -> None:
        """A vision-language model folder needs ``--towers``; ``--towers`` needs one (before anything is loaded)."""
        from types import SimpleNamespace

        from secateur.models.towers import check_tower

        mt = None
        if isinstance(self.model, str) and (Path(self.model) / "config.json").is_file():
            try:
                mt = json.loads((Path(self.model) / "config.json").read_text()).get("model_type")
            except (OSError, ValueError, AttributeError):
                mt = None  # the folder check names a broken config later
        if self.towers is not None or mt is not None:
            check_tower(SimpleNamespace(model_type=mt), self.towers, self.sparsity)

    def check_split(self) -> None:
        """What a run split over several processes (``--procs``, torchrun) cannot do yet, refused in one line
        (``--stream`` and ``--resume`` are split: docs/distributed.md)."""
        if self.method in SPLIT_REFUSED:
            why = SPLIT_REFUSED[self.method]
            raise SecateurError(f"--method {self.method} is not split over processes yet ({why}); run it in one "
                                "process: drop --procs")

    def _check_stream(self, method) -> None:
        """What ``--stream`` cannot do, each refused in one line before anything is loaded."""
        if self.method not in STREAMABLE:
            why = STREAM_REFUSED.get(self.method)
            raise SecateurError(f"--stream prunes with {', '.join(STREAMABLE)}; --method {self.method} is not "
                                + (f"block-streamed: {why}" if why else "block-streamed yet")
                                + ": run it without --stream")
        if self.in_memory:
            raise SecateurError("--stream reads a model folder block by block; this model is already in memory: "
                                "pass its folder, or drop stream=True")
        if self.out is None:
            raise SecateurError("--stream writes each pruned block to --out as it goes; pass --out")
        if self.resume:
            raise SecateurError("--resume does not apply to --stream runs; run again without --resume")
        if self.calib == "self" and (method.needs_calibration or self.method_options.needs_calibration):
            raise SecateurError("--stream cannot sample calibration text from the model (--calib self runs the "
                                "whole model per token); pass --calib c4, wikitext2, ptb or a .txt file")


STREAM_REFUSED = REFUSED  # method -> why it is not streamed
#: method -> why a run split over processes refuses it
SPLIT_REFUSED = {"cocurve": "its ablation sweep splits by its own blocks of sequences; not checked end to end yet",
                 "cocurve-diag": "as cocurve"}
_RUN = tuple(f.name for f in fields(RunSettings))  # the run settings' flat keywords
_COMMON = frozenset(f.name for f in fields(PruneOptions)) - {"run", "method_options"} | set(_RUN)
#: knobs of some methods only that the flat record (reports, recipes, checkpoints, command lines) holds for every
#: method where they stood when they were common fields, with the value it records when a method has them unset
#: or does not take them (a recipe's value that had no effect is dropped when it is read: options_from_recipe)
FLAT_KNOBS: dict[str, Any] = {"pattern": None, "budget": None, "rounding": "ceil", "targets": None}
#: the keys of the flat record in its order (PruneOptions.to_dict): every key of a report's ``options`` that is
#: not a knob of the method, and FLAT_KNOBS
RECORD = ("model", "method", "sparsity", "pattern", "budget", "rounding", "targets", "calib", "nsamples", "seqlen",
          "seed", "data_dir", "mode", "chunk_size", "dtype", "device", "out", "overwrite", "quiet", "resume",
          "structured", "stream", "eval_ppl", "eval_windows", "towers")
_DEFAULTS = {f.name: f.default for f in fields(PruneOptions) if f.name in RECORD} \
    | {f.name: f.default for f in fields(RunSettings)} | FLAT_KNOBS
# the CLI flag of each recorded option (``secateur prune``); _ALWAYS are written into every command line
_FLAGS = {n: "--" + n.replace("_", "-") for n in RECORD}
_ALWAYS = ("model", "method", "sparsity", "calib", "nsamples", "seqlen", "seed")
RECIPE_NEUTRAL = _resume.NEUTRAL_OPTIONS  # output, verbosity, resume and evaluation do not change the result
RECIPE_CHECKS = ("calibration_sha256", "model_sha256")
_RECIPE_META = ("secateur_recipe", "check", "made_with")


def recipe_of(opts: PruneOptions, report: dict) -> dict:
    """``secateur-recipe.yaml`` of a run: :meth:`PruneOptions.recipe`, the digests a replay is checked against
    (calibration tokens, a GGUF input's file) and the versions that made it."""
    check = {}
    if report.get("calibration"):
        check["calibration_sha256"] = report["calibration"]["sha256"]
    if (report.get("model_source") or {}).get("sha256"):
        check["model_sha256"] = report["model_source"]["sha256"]
    elif not opts.in_memory and (digest := local_digest(opts.model)):  # a local folder: its weights' digest
        check["model_sha256"] = digest
    made = {k: str(v) for k, v in (report.get("versions") or {}).items() if k in ("secateur", "torch", "transformers")}
    return json.loads(json.dumps(opts.recipe() | {"check": check, "made_with": made}))  # plain values only


def options_from_recipe(recipe: str | dict, **overrides) -> PruneOptions:
    """The options of a recipe (a ``secateur-recipe.yaml`` path or its dict), ``overrides`` (keywords of
    :func:`prune`, e.g. ``out``) replacing its values. An unknown key or a newer schema is refused in one line.
    The recipe's digests are checked by the run unless an override changes what they cover."""
    from secateur.methods.registry import all_options, knob_names
    from secateur.schemas import parse
    from secateur.schemas.recipe import recipe_schema

    data, name = read_recipe(recipe)
    common = _COMMON - {"tokenizer", "recipe_check"} - set(RECIPE_NEUTRAL)
    known = common | knob_names() | set(_RECIPE_META)
    for k in data:
        if k not in known:
            raise SecateurError(f"{name}: unknown key {k!r}; a recipe holds the options of secateur prune "
                                "(as it writes them in secateur-recipe.yaml)")
    check = data.get("check") or {}
    if not isinstance(check, dict):
        raise SecateurError(f"{name}: check is not a mapping; it holds {', '.join(RECIPE_CHECKS)} (key: digest "
                            "per line), or delete it")
    for k in check:
        if k not in RECIPE_CHECKS:
            raise SecateurError(f"{name}: unknown key {'check.' + str(k)!r}; check holds {', '.join(RECIPE_CHECKS)}")
    schema, fix = recipe_schema(common, all_options(), RECIPE_CHECKS)
    # every value of the file by its type: one line naming the key, never a TypeError (``1e-3`` read as a number)
    data = parse(schema, data, name, fix).model_dump(exclude_unset=True)
    if data.get("model") is None and overrides.get("model") is None:  # the default model is not the recipe's
        raise SecateurError(f"{name}: model: missing; a recipe names the model it replays (model: <Hub id or "
                            "folder>, as secateur writes it), or pass --model")
    check = data.get("check") or {}
    values = _without_unused_flat_knobs({k: v for k, v in data.items() if k not in _RECIPE_META})
    values |= {k: v for k, v in overrides.items()}
    opts = PruneOptions.from_kwargs(**values)
    check = dict(check)
    if set(overrides) & {"calib", "nsamples", "seqlen", "seed"}:
        check.pop("calibration_sha256", None)
    if "model" in overrides:
        check.pop("model_sha256", None)
    opts.recipe_check = check or None
    return opts


def _without_unused_flat_knobs(values: dict) -> dict:
    """A recipe's values without the :data:`FLAT_KNOBS` it records for every method: at their unset value, or
    (recipes written when they were common fields) given to a method that does not take them, which ignored
    them."""
    try:
        own = resolve(values.get("method", "wanda"), bool(values.get("structured"))).options.knob_names()
    except SecateurError:  # an unknown method: refused by from_kwargs with the recipe's values as they are
        return values
    return {k: v for k, v in values.items()
            if k not in FLAT_KNOBS or (k in own and v != FLAT_KNOBS[k])}


def check_recipe_model(opts: PruneOptions) -> None:
    """A replayed recipe reaches the weights it was made from or none: its ``model_sha256`` (a GGUF file's or a
    local folder's content digest) must match, and a recipe made from a local model never falls through to the
    Hub (a relative path replayed from another directory is not a Hub id)."""
    want = (opts.recipe_check or {}).get("model_sha256")
    if want and not opts.in_memory:
        got = local_digest(opts.model)
        found = known_model(want, Path(opts.model).name) if got is None else None  # named portably, hashed here
        if found is not None:  # before: the same content, so the same run (the report names it portably)
            opts.model, got = str(found), want
        if got is None:
            raise SecateurError(f"the recipe's model {opts.model!r} (a local model, sha256 {want[:12]}...) is not "
                                "there from this directory; pass --model with the path to the same weights")
        if got != want:
            raise SecateurError(f"model {opts.model} is not the recipe's (sha256 {str(got)[:12]}..., recipe "
                                f"{want[:12]}...); pass the recipe's model, or --model to prune another one")


def check_recipe_calibration(opts: PruneOptions, manifest) -> None:
    want = (opts.recipe_check or {}).get("calibration_sha256")
    if want and manifest is not None and manifest.sha256 != want:
        raise SecateurError(f"calibration tokens differ from the recipe's (sha256 {manifest.sha256[:12]}..., recipe "
                            f"{want[:12]}...): the {opts.calib} text or the tokenizer is not the same; point "
                            "--data-dir at the recipe's data, or remove its check: to run anyway")

