"""Typed run configuration: nested dataclasses, ``configs/NAME.py`` files and ``--set key=value``.

A config file defines ``get_config() -> Config``. ``--set`` takes dotted keys
(``diloco.sync_every=50``); an unknown key or a value that does not parse as
the field's type fails before anything compiles, and the message lists the
valid keys. ``None`` is accepted where the field allows it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import types
import typing

from loco_jax import diloco as diloco_lib
from loco_jax import exchange as exchange_lib
from loco_jax import loco as loco_lib
from loco_jax.checks import require_int
from loco_jax.training import shapes


# The config file's defaults for the model (the tiny demo model); every other field defaults to ModelConfig's.
MODEL_DEFAULTS = dict(vocab_size=256, d_model=128, num_layers=4, num_heads=4, d_ff=384, max_seq_len=128)


def _model_fields():
    """The config's model section: :class:`loco_jax.training.shapes.ModelConfig`'s own fields (names, types,
    defaults but :data:`MODEL_DEFAULTS`), so the model is described once, with ``attention`` (the user's choice,
    "auto" | "xla" | "cudnn") in place of ``attention_impl`` (what the trainer resolves it to for the device:
    :func:`loco_jax.training.run.steps.attention_impl`)."""
    hints = typing.get_type_hints(shapes.ModelConfig)
    fields = [(f.name, hints[f.name], dataclasses.field(default=MODEL_DEFAULTS.get(f.name, f.default)))
              for f in dataclasses.fields(shapes.ModelConfig) if f.name != "attention_impl"]
    # jax.nn.dot_product_attention's implementation: "auto" is cuDNN's fused (flash) attention where the
    # step compiles for GPUs in bf16/fp16, XLA's elsewhere; "xla" or "cudnn" to choose
    fields.append(("attention", str, dataclasses.field(default="auto")))
    cls = dataclasses.make_dataclass("ModelFields", fields)
    cls.__module__ = __name__
    cls.__doc__ = "The transformer: the fields of ``loco_jax.training.shapes.ModelConfig`` and ``attention``."
    return cls


ModelFields = _model_fields()


def model_fields(cfg) -> dict:
    """``cfg.model`` as :class:`loco_jax.training.shapes.ModelConfig`'s arguments, but ``attention_impl``
    (which depends on the device: :func:`loco_jax.training.run.steps.model_config`)."""
    fields = dataclasses.asdict(cfg.model)
    del fields["attention"]
    return fields


ATTENTION = ("auto", "xla", "cudnn")
OPTIMIZERS = ("adamw", "muon")


@dataclasses.dataclass
class MeshFields:
    """``replicas`` x ``data`` devices. ``fsdp``: shard parameters, AdamW moments and DiLoCo's global
    parameters and outer state over the ``data`` devices of each replica (ZeRO-3, :mod:`loco_jax.fsdp`);
    False keeps a full copy on every device (the default, best for small models)."""

    replicas: int = 1
    data: int | None = None  # None: every device the other axes leave
    fsdp: bool = False
    # > 1: data parallel over hosts x `local` devices per host; LoCo is exact over a host's devices
    # and low-bit across hosts (loco.compress(fast_axis="local")). Data parallel only.
    local: int = 1


@dataclasses.dataclass
class DataFields:
    """Where the tokens come from (``loco_jax.training.data.tokens``, ``loco_jax.training.data.shard_reader``).

    ``path``: None (the Shakespeare demo corpus), a text file or directory of ``.txt`` files, a token file
    (``.npy``, ``.u16.bin``, ``.u32.bin``), or a shard directory written by ``prepare_data.py``, whose
    manifest's tokenizer must match ``tokenizer``, ``sp_vocab_size`` and (when set) ``sp_model``.
    ``sp_model``: an existing SentencePiece model file; text is encoded with it instead of a model trained
    at start, and shards must have been made with it (same SHA-256). ``require_path``: refuse to load
    data without ``path`` (recipes sized for a real corpus; checked when the data is loaded, so tools
    that only compile such a config keep working). None is False (older runs' config.json lack it).
    """

    path: str | None = None  # None: the Shakespeare corpus
    tokenizer: str = "byte"  # "byte" or "sentencepiece"
    sp_vocab_size: int = 1024
    cache_dir: str | None = None
    seed: int = 0
    sp_model: str | None = None  # an existing SentencePiece model file (e.g. <shards>/tokenizer.model)
    require_path: bool | None = None  # True: refuse to start without data.path


@dataclasses.dataclass
class OptimFields:
    """The inner optimizer, with linear warm-up and cosine decay: ``name="adamw"``, or ``"muon"`` (optax's
    Muon on the transformer blocks' matrices, AdamW with the same settings on the embedding, the norms and
    the head; Muon's updates are scaled to AdamW's RMS (``consistent_rms=0.2``) so that ``lr`` carries
    over, and its momentum is ``muon_beta``). Muon needs each matrix whole: not with ``mesh.fsdp``."""

    name: str = "adamw"
    muon_beta: float = 0.95
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0


def library_default(owners, name):
    """The default of argument ``name`` of the first of the library's functions ``owners`` that takes it: a
    field that sets a library argument defaults to the library's own value, so the two cannot drift apart."""
    for fn in owners:
        parameters = inspect.signature(fn).parameters
        if name in parameters:
            return parameters[name].default
    raise KeyError(f"no library function of {[fn.__qualname__ for fn in owners]} takes {name!r}")


# the owners of the loco section's fields: what is sent (loco.codec), then how (loco.compress); of the diloco
# section's: the schedule, the merge and the collective (diloco.diloco), a dense exchange (diloco.codec), a
# sparse one (exchange.Sparse.of)
_loco = functools.partial(library_default, (loco_lib.codec, loco_lib.compress))
_diloco = functools.partial(library_default, (diloco_lib.diloco, diloco_lib.codec, exchange_lib.Sparse.of))


@dataclasses.dataclass
class LocoFields:
    """``loco.compress`` on the ``data`` axis; ``bits=None`` is the exact fp32 mean.

    ``format``, ``rotate``, ``beta``, ``compensate`` and ``compensate_second_stage`` left at None take
    the library's measured default for these bits (``loco.MEASURED``; ``preset="reference"``: LoCo's
    reference settings). ``config.json`` records what they resolved to.
    """

    bits: int | None = None  # the application's default: the exact mean (the library's compress(): 4)
    beta: float | None = _loco("beta")
    compensate: bool | None = _loco("compensate")
    error_bits: int | None = _loco("error_bits")
    block_size: int = _loco("block_size")
    reset_every: int | None = _loco("reset_every")
    compensate_second_stage: bool | None = _loco("compensate_second_stage")
    format: str | None = _loco("format")
    rotate: bool | None = _loco("rotate")
    preset: str = _loco("preset")
    bucket_size: int | None = _loco("bucket_size")  # values per all-reduce bucket (whole leaves); None: one bucket
    # True: each block's gradient is exchanged in the scanned stack's backward pass as soon as it exists (one
    # bucket per block; the embedding and the head after the backward pass; loco_jax.backward), under the
    # next block's backward compute. Needs model.scan_layers=true.
    in_backward: bool = False


@dataclasses.dataclass
class DilocoFields:
    """``diloco.diloco`` on the ``replica`` axis; ``enabled=False`` is plain data parallel."""

    enabled: bool = False
    sync_every: int = 50  # the application's default (the library's diloco() has none)
    num_fragments: int = _diloco("num_fragments")
    overlap: int = _diloco("overlap")
    alpha: float = _diloco("alpha")
    bits: int | None = _diloco("bits")
    format: str | None = _diloco("format")  # None (and rotate, compensate): diloco.MEASURED's default for these bits
    compensate: bool | None = _diloco("compensate")
    rotate: bool | None = _diloco("rotate")
    preset: str = _diloco("preset")
    outer_lr: float = diloco_lib.OUTER_LR
    outer_momentum: float = diloco_lib.OUTER_MOMENTUM
    # True: the outer learning rate decays on a cosine over each fragment's rounds (no warm-up), from outer_lr
    # at its first round toward outer_lr * optim.min_lr_ratio after its last (R = steps // sync_every rounds:
    # round r steps with outer_lr * (m + (1 - m)(1 + cos(pi r / R)) / 2)); False: constant.
    outer_lr_decay: bool = False
    mode: str = _diloco("mode")
    block_size: int = _diloco("block_size")  # values per scale in the outer-gradient payload
    # Sparse exchange (None: dense; exchange.Sparse.of(density, ...)): each chunk's top density x chunk
    # entries, their values at `bits`, with an fp32 error-feedback accumulator e <- error_decay e + Delta
    # (None: Sparse.of's decay, 1). The outer rules: Nesterov (outer_momentum > 0, the default) on the decoded
    # mean; SparseLoCo's (outer_momentum=0, outer_lr=1, error_decay=0.95): the decayed accumulator stands in
    # for the momentum.
    density: float | None = None
    chunk: int = _diloco("chunk")
    error_decay: float | None = None
    # True: each replica keeps its own unsent progress (restarts from the global parameters less its decayed
    # accumulator instead of the global parameters); needs alpha=0 and overlap <= 1 (Sparse.of(keep_unsent)).
    keep_unsent: bool = _diloco("keep_unsent")
    # the sparse mean of each entry: over the "senders" (the replicas whose payload holds it, as SparseLoCo's
    # code averages) or over the M "replicas" (unsent entries count as zeros); Sparse.of(average_over).
    average_over: str = _diloco("average_over")
    # a sparse exchange's chunks: "flat" (every `chunk` values of the flattened fragment) or "leaves" (tiles of
    # sqrt(chunk) per side of each matrix, pieces of each vector, k scaled to each; Sparse.of(chunks))
    chunks: str = _diloco("chunks")


@dataclasses.dataclass
class Config:
    steps: int = 200
    seed: int = 0
    batch_size: int = 32  # global: sequences per step over all devices
    accum_steps: int = 1  # micro-batches per step on each device; one LoCo exchange and optimizer step per step
    # sequences per device in one micro-batch; set, it derives accum_steps from the device count (the
    # per-device batch / micro_batch, 1 when a device gets no more), so a recipe fits from few devices up
    micro_batch: int | None = None
    seq_len: int = 128
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    nonfinite: str = "skip"  # "skip" a step with NaN/Inf anywhere, or "stop" the run
    # On a resume with another mesh (elastic restart): each replica's inner optimizer state is "copy"-ed
    # from replica 0, or "reset" (moments zero; step counts, hence the schedules, kept).
    elastic_inner_state: str = "copy"
    sample_tokens: int = 64  # text generated from the global parameters at the end of a run, per prompt; 0: none
    model: ModelFields = dataclasses.field(default_factory=ModelFields)
    mesh: MeshFields = dataclasses.field(default_factory=MeshFields)
    data: DataFields = dataclasses.field(default_factory=DataFields)
    optim: OptimFields = dataclasses.field(default_factory=OptimFields)
    loco: LocoFields = dataclasses.field(default_factory=LocoFields)
    diloco: DilocoFields = dataclasses.field(default_factory=DilocoFields)


# Fields whose change on resume would silently change the run: refused. The mesh may change: that is
# an elastic restart (see loco_jax.training.run.checkpoints.restore_elastic).
FROZEN_ON_RESUME = ("model", "optim", "loco", "diloco", "seed", "batch_size", "seq_len", "data")
# how the step computes, not what it trains: free to change on resume (an attention kernel)
CHANGEABLE_ON_RESUME = ("model.attention",)


# Fields that None resolves per bit width from the library (see ``resolve``): the library's own names.
RESOLVED_FIELDS = {"loco": loco_lib.SETTING_NAMES, "diloco": diloco_lib.SETTING_NAMES}


def _library(section):
    return {"loco": loco_lib, "diloco": diloco_lib}[section]


def resolve(cfg: Config, saved: dict | None = None) -> Config:
    """A copy of ``cfg`` with every None in :data:`RESOLVED_FIELDS` replaced by a concrete setting.

    Fresh run (``saved`` None): the library's default for the section's bits and preset. Resume
    (``saved`` = the run's ``config.json``): the value the run was started with, and for a field that an
    older version did not record, the reference setting it then ran with (never a newer default).
    """
    cfg = from_dict(to_dict(cfg))
    saved = None if saved is None else with_reference_fields(saved)
    for section, names in RESOLVED_FIELDS.items():
        node = getattr(cfg, section)
        fields = dataclasses.asdict(node)
        if saved is not None:  # None: the value the run was started with
            fields.update({n: saved[section][n] for n in names if fields[n] is None})
        for name, value in _library(section).settings_of(fields).items():
            setattr(node, name, value)
    return cfg


def with_reference_fields(saved: dict) -> dict:
    """A saved config dict with the fields an older version did not record set to what it ran with."""
    saved = json.loads(json.dumps(saved))
    saved.setdefault("model", {}).setdefault("attention", "xla")  # before model.attention: XLA's, everywhere
    saved.setdefault("loco", {}).setdefault("in_backward", False)  # before loco.in_backward: after the backward
    for section, names in RESOLVED_FIELDS.items():
        node = saved.setdefault(section, {})
        node.setdefault("preset", "measured")
        for name in names:
            node.setdefault(name, _library(section).REFERENCE[name])
    # fields added since (the model's own, the sparse exchange, the inner optimizer's name) ran at their defaults
    for section, cls in (("model", ModelFields), ("diloco", DilocoFields), ("optim", OptimFields)):
        node = saved.setdefault(section, {})
        for f in dataclasses.fields(cls):
            node.setdefault(f.name, f.default)
    return saved


def keys(cfg, prefix="") -> list[str]:
    """Every dotted key of a config."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += keys(value, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _field_type(cfg, name):
    hints = typing.get_type_hints(type(cfg))
    return hints[name]


def _parse(text: str, tp, key: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() == "none" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _parse(text, inner[0], key)
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(f"--set {key}={text!r}: expected a bool (true/false).")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--set {key}={text!r}: expected an int.") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"--set {key}={text!r}: expected a float.") from None
    if tp is str:
        return text
    raise ValueError(f"--set {key}: fields of type {tp} cannot be set from the command line.")


def override(cfg: Config, assignments) -> Config:
    """A copy of ``cfg`` with ``key=value`` assignments applied (dotted keys)."""
    cfg = from_dict(to_dict(cfg))
    valid = keys(cfg)
    for item in assignments:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value.")
        key, value = item.split("=", 1)
        key = key.strip()
        if key not in valid:
            raise ValueError(f"--set: unknown key {key!r}. Valid keys: {', '.join(valid)}.")
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, _parse(value, _field_type(node, name), key))
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict, cls=Config):
    """Builds a config from a (possibly partial) dict, checking keys."""
    kwargs = {}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in d.items():
        if k not in names:
            raise ValueError(f"unknown config key {k!r} in {cls.__name__}; valid: {', '.join(sorted(names))}.")
        tp = hints[k]
        kwargs[k] = from_dict(v, tp) if dataclasses.is_dataclass(tp) and isinstance(v, dict) else v
    return cls(**kwargs)


def load(path: str, assignments=()) -> Config:
    """``get_config()`` of a config file, with ``--set`` assignments applied."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (see configs/ for the shipped ones).")
    spec = importlib.util.spec_from_file_location("loco_jax_user_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} must define get_config() returning a loco_jax.training.run.config.Config.")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise ValueError(f"get_config() in {path!r} returned {type(cfg).__name__}, not a loco_jax.training.run.config.Config.")
    cfg = override(cfg, assignments)
    validate(cfg)
    return cfg


def validate(cfg: Config):
    """Cross-field checks that need no devices; messages name the value and what is allowed."""
    for name in ("steps", "batch_size", "accum_steps", "seq_len", "eval_every", "log_every", "checkpoint_every",
                 "keep_checkpoints"):
        require_int(name, getattr(cfg, name))
    if cfg.micro_batch is not None:
        require_int("micro_batch", cfg.micro_batch, "a positive integer or None")
        if cfg.accum_steps != 1:
            raise ValueError(
                f"micro_batch={cfg.micro_batch} derives accum_steps from the device count, and accum_steps="
                f"{cfg.accum_steps} sets it too; set one of them (accum_steps=1 or micro_batch=None).")
    if cfg.seq_len > cfg.model.max_seq_len:
        raise ValueError(
            f"seq_len={cfg.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; use seq_len <= "
            f"{cfg.model.max_seq_len} or raise model.max_seq_len."
        )
    require_int("sample_tokens", cfg.sample_tokens, "an integer >= 0 (0: no samples at the end)", minimum=0)
    if cfg.nonfinite not in ("skip", "stop"):
        raise ValueError(f"nonfinite={cfg.nonfinite!r} must be 'skip' or 'stop'.")
    if cfg.elastic_inner_state not in ("copy", "reset"):
        raise ValueError(f"elastic_inner_state={cfg.elastic_inner_state!r} must be 'copy' or 'reset'.")
    if cfg.optim.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={cfg.optim.name!r} is unknown; choose one of {OPTIMIZERS}.")
    if cfg.optim.name == "muon" and cfg.mesh.fsdp:
        raise ValueError("optim.name='muon' orthogonalizes each weight matrix whole, and mesh.fsdp=true shards "
                         "them over the data devices; use mesh.fsdp=false with Muon, or optim.name='adamw'.")
    shapes.ModelConfig(**model_fields(cfg))  # the model's own checks (dimensions, dtypes), before any device starts
    if cfg.model.attention not in ATTENTION:
        raise ValueError(f"model.attention={cfg.model.attention!r} must be one of {ATTENTION}.")
    if cfg.model.attention == "cudnn" and cfg.model.compute_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"model.attention='cudnn' takes 16-bit inputs, but model.compute_dtype="
                         f"{cfg.model.compute_dtype!r}; use bfloat16 or float16, or model.attention='auto' or 'xla'.")
    if cfg.data.tokenizer not in ("byte", "sentencepiece"):
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r} must be 'byte' or 'sentencepiece'.")
    if cfg.data.sp_model is not None and cfg.data.tokenizer != "sentencepiece":
        raise ValueError(
            f"data.sp_model={cfg.data.sp_model!r} is a SentencePiece model, but data.tokenizer={cfg.data.tokenizer!r}; "
            "set data.tokenizer=sentencepiece (or unset data.sp_model)."
        )
    require_int("data.sp_vocab_size", cfg.data.sp_vocab_size)
    _validate_layout(cfg)
    for section in RESOLVED_FIELDS:
        node, lib = getattr(cfg, section), _library(section)
        if node.preset not in lib.PRESETS:
            raise ValueError(f"{section}.preset={node.preset!r} must be one of {lib.PRESETS}.")
        fmt = node.format
        if fmt is not None:
            from loco_jax import quant, sparse

            known = quant.FORMATS + (tuple(sparse.SPARSE_FORMAT_BITS) if section == "diloco" else ())
            if fmt not in known:
                raise ValueError(f"{section}.format={fmt!r} is unknown; choose one of {known} or None.")
            if fmt in sparse.SPARSE_FORMAT_BITS and cfg.diloco.density is None:
                raise ValueError(f"diloco.format={fmt!r} quantizes a sparse exchange's kept values; set "
                                 f"diloco.density, or choose one of {quant.FORMATS}.")
    _validate_exchange_kind(cfg.diloco)


# The diloco section's sparse-only settings: a dense exchange leaves them at their defaults (one section
# describes either kind of exchange).
SPARSE_ONLY = ("chunk", "error_decay", "keep_unsent", "average_over", "chunks")


def _validate_exchange_kind(d):
    """The diloco section's settings that belong to the other kind of exchange than its ``density`` picks."""
    if d.density is None:
        dense_defaults = DilocoFields()
        for name in SPARSE_ONLY:
            if getattr(d, name) != getattr(dense_defaults, name):
                raise ValueError(f"diloco.{name}={getattr(d, name)!r} is a sparse exchange's setting; set "
                                 f"diloco.density, or leave diloco.{name} at {getattr(dense_defaults, name)!r}.")
        return
    if d.rotate:
        raise ValueError(f"diloco.density={d.density} with diloco.rotate=true: the sparse exchange picks entries in "
                         "the parameters' own domain; leave rotate at None or false.")
    if d.compensate is False:
        raise ValueError(f"diloco.density={d.density} with diloco.compensate=false: without its error feedback the "
                         "sparse exchange would drop what it does not send; leave compensate at None or true.")
    if d.bits is None:
        raise ValueError(f"diloco.density={d.density} sends a sparse, quantized outer gradient: set diloco.bits "
                         "(1, 2, 4 or 8).")


def _validate_layout(cfg: Config):
    """The mesh and exchange choices that do not combine, from the config alone."""
    if cfg.mesh.local > 1 and (cfg.diloco.enabled or cfg.mesh.fsdp):
        raise ValueError(
            f"mesh.local={cfg.mesh.local} (hierarchical LoCo over hosts x local devices) is for data parallel "
            f"with replicated state; this config has diloco.enabled={cfg.diloco.enabled}, "
            f"mesh.fsdp={cfg.mesh.fsdp}. Set mesh.local=1, or turn those off."
        )
    if cfg.loco.in_backward and cfg.mesh.local > 1:
        raise ValueError(f"loco.in_backward=True does not combine with mesh.local={cfg.mesh.local} (the "
                         "hierarchical all-reduce); set one of them off.")
    if cfg.loco.in_backward and not cfg.model.scan_layers:
        raise ValueError("loco.in_backward=True exchanges each layer in a scanned stack's backward loop; it needs "
                         "model.scan_layers=true (set it, or set loco.in_backward=false).")


def dumps(cfg) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def changed_fields(old: dict, new: dict, prefix="") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_fields(a, b, prefix + k + ".")
        elif a != b:
            out.append(prefix + k)
    return out

