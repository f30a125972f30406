"""Drafters in the formats servers load, each written by its method's module (DFlash as z-lab's ``dflash``
package reads it, EAGLE-3 as vllm speculators' ``Eagle3DraftModel`` reads it): what a checkpoint carries
for export, which format holds which method (the registry's :attr:`Method.export_format`), the output
folder's checks and the atomic write.

A padfree checkpoint (``examples/train_drafter.py``) holds the drafter's weights (``state["model"]``) and,
under ``state["drafter_export"]``, what a served drafter needs besides them (:func:`export_meta`): the
method, the recipe, the drafter's sizes, the target layers it fuses, the mask token of its blocks and the
target (its config and folder). :func:`export_drafter` writes ``config.json`` + ``model.safetensors`` from
the ``(config, tensors)`` the method's module gives (``export_files(state, meta)``, refusing what its format
cannot hold in ``check_export(meta, verifier_option=...)``):
:func:`padfree.drafter.methods.dflash.model.export_files`,
:func:`padfree.drafter.methods.eagle3.model.export_files`.

>>> formats()  # doctest: +NORMALIZE_WHITESPACE
('dflash', 'speculators', 'speculators-mtp', 'speculators-peagle', 'speculators-dspark',
'speculators-dflash2')
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from padfree.drafter import methods
from padfree.errors import ConfigError, InputError, OutputError, one_line

META_KEY = "drafter_export"
"""Where a checkpoint keeps :func:`export_meta`."""

META_VERSION = 1
"""The version of :func:`export_meta` this padfree writes and reads."""


def export_meta(models: Any, *, mask_token_id: int, target_path: str | Path | None = None) -> dict:
    """What a checkpoint of ``models`` (:class:`padfree.drafter.train.DrafterModels`) carries for export:
    plain values only (a checkpoint is loaded with ``weights_only``)."""
    target = models.target
    cfg = target.config
    vocab = models.drafter.vocab
    return {
        "version": META_VERSION,
        "method": models.method.name,
        "recipe": dataclasses.asdict(models.recipe),
        "drafter": dataclasses.asdict(models.drafter.cfg),
        "target_layers": [int(i) for i in models.layers],
        "mask_token_id": int(mask_token_id),
        "d2t": None if vocab is None else [int(i) for i in vocab.d2t.tolist()],
        "target": {
            "path": None if target_path is None else str(Path(target_path).resolve()),
            "architecture": type(target).__name__,
            "config": json.loads(cfg.to_json_string(use_diff=False)),
        },
    }


def checkpoint_extra(
    models: Any, *, mask_token_id: int, target_path: str | Path | None, options: dict[str, Any]
) -> dict[str, Any]:
    """What every checkpoint of a drafter run carries beside its model, optimizer and sampler: ``"drafter"``,
    the options the run is bound to (``options`` and the recipe's fields: a resume under others is refused,
    naming them), and under :data:`META_KEY` what export needs (:func:`export_meta`)."""
    identity = {**options, **dataclasses.asdict(models.recipe)}
    identity.pop("source")
    meta = export_meta(models, mask_token_id=mask_token_id, target_path=target_path)
    return {"drafter": identity, META_KEY: meta}


def formats() -> tuple[str, ...]:
    """The export formats of the registered methods (``--format`` / ``--export-format`` choices)."""
    return tuple(m.export_format for m in methods.METHODS.values())


def method_of_format(fmt: str) -> methods.Method:
    """The registered method whose drafters ``fmt`` holds; else a one-line :class:`ConfigError`."""
    for m in methods.METHODS.values():
        if m.export_format == fmt:
            return m
    raise ConfigError(f"unknown export format {fmt!r}: choose {' or '.join(formats())}")


def default_format(method: str) -> str:
    """The export format of a drafter method (``dflash`` -> ``dflash``, ``eagle3`` -> ``speculators``)."""
    return methods.get(method).export_format


VERIFIER_FIELDS = (
    ("model_type", "architecture"),
    ("hidden_size", "hidden size"),
    ("num_hidden_layers", "layers"),
    ("vocab_size", "vocabulary"),
)
"""The target config fields a verifier must share with the target a drafter was trained on: the drafter
fuses that architecture's hidden states of that width from those layers, and drafts in that vocabulary."""


def _shape(config: dict) -> dict[str, object]:
    """The :data:`VERIFIER_FIELDS` of a transformers config (a multimodal one's text config holds the
    sizes)."""
    text = config.get("text_config")
    inner: dict = text if isinstance(text, dict) else {}
    return {k: config.get(k, inner.get(k)) for k, _ in VERIFIER_FIELDS}


def _describe(shape: dict[str, object]) -> str:
    return (
        f"a {shape['model_type']} target of hidden size {shape['hidden_size']}, {shape['num_hidden_layers']} "
        f"layers, vocabulary {shape['vocab_size']}"
    )


def with_verifier(meta: dict, verifier: str | Path | None, *, option: str = "--verifier") -> dict:
    """``meta`` with the target folder a server runs set to ``verifier`` (unchanged when ``None``); checked
    to be a target folder of the architecture and sizes the drafter was trained on (:data:`VERIFIER_FIELDS`),
    else one :class:`ConfigError` line naming ``option``, the folder and what differs."""
    if verifier is None:
        return meta
    from padfree.drafter.target import check_target_folder
    from padfree.models import read_config_json

    folder = check_target_folder(verifier)
    trained, given = _shape(meta["target"]["config"]), _shape(read_config_json(folder))
    differ = [label for k, label in VERIFIER_FIELDS if trained[k] != given[k]]
    if differ:
        raise ConfigError(
            f"{option} {one_line(str(verifier))}: {_describe(given)}; this drafter was trained on "
            f"{_describe(trained)} ({' and '.join(differ)} differ{'s' if len(differ) == 1 else ''}): a "
            "server would feed it hidden states it never saw; pass the target it was trained on or one of "
            "the same architecture and sizes"
        )
    path = str(folder.resolve())
    return {**meta, "target": {**meta["target"], "path": path}}


def speculators_head(architecture: str, model_type: str, version: str, layer: Any) -> dict:
    """The fields a speculators config opens with: its class, model type and release, and the transformers
    config ``layer`` of its draft layers (its diff dict, without the transformers version)."""
    fields = layer.to_diff_dict()
    fields.pop("transformers_version", None)
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": version,
        "transformer_layer_config": fields,
    }


def speculators_config(algorithm: str, tokens: int, meta: dict) -> dict:
    """A speculators config's ``speculators_config``: greedy proposals of ``tokens`` speculative tokens by
    ``algorithm``, verified by the target ``meta`` names (its folder and architectures)."""
    target = meta["target"]
    architectures = target["config"].get("architectures") or [target["architecture"]]
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {"name_or_path": target.get("path"), "architectures": list(architectures)},
    }


def needs_verifier(meta: dict, fmt: str, loads: str, verifier_option: str | None) -> None:
    """Refuse in one line a drafter with no verifier folder for the format ``fmt`` (in words), which names
    the verifier and ``loads`` its weights (e.g. ``"embedding and LM head"``) from it; ``verifier_option``
    names the option that gives one (None: the caller has none)."""
    if not meta["target"].get("path"):
        raise ConfigError(
            f"{fmt} names the verifier, the target folder a server runs, and loads its {loads} from it: this "
            "drafter was trained on padfree's tiny random target; "
            + (f"pass {verifier_option} DIR, or " if verifier_option else "")
            + "train with --target DIR"
        )


def check_exportable(
    meta: dict, fmt: str, *, format_option: str = "--format", verifier_option: str | None = "--verifier"
) -> None:
    """Raise the one line :func:`export_drafter` would for ``meta`` in ``fmt`` before any weight exists
    (what ``train_drafter.py --export-dir`` checks before it trains). The line names the caller's options:
    ``format_option`` chooses the format, ``verifier_option`` (None: the caller has none) names the verifier
    (``export-drafter``'s by default; ``train_drafter.py`` passes ``--export-format`` and None)."""
    held = method_of_format(fmt)
    method = meta.get("method")
    if held.name != method:
        other = [m.export_format for m in methods.METHODS.values() if m.name == method]
        raise ConfigError(
            f"the {fmt} format holds {held.name} drafters; this drafter is {method}"
            + (f" (export it with {format_option} {other[0]})" if other else "")
        )
    held.load().check_export(meta, verifier_option=verifier_option)


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(drafter state dict, export meta)`` of a checkpoint file or of the newest intact checkpoint of a
    checkpoint folder (:func:`read_checkpoint_file`, damaged newer ones passed over silently)."""
    _, state, meta = read_checkpoint_file(path)
    return state, meta


def read_checkpoint_file(
    path: str | Path, *, say: Callable[[str], None] | None = None
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """``(checkpoint file, drafter state dict, export meta)`` of a checkpoint file or of the newest intact
    checkpoint of a checkpoint folder (each damaged newer one is passed to ``say``, one line naming it and
    why); one line when there is none, or it carries no export meta (written before padfree saved it: retrain,
    or resume and let it save) or a newer version of it."""
    from padfree.torch.run.checkpoint import CheckpointDir, quiet

    p = Path(path)
    if p.is_dir():
        found, state = CheckpointDir(p, say=say or quiet).newest_intact()
        if found is None or state is None:
            raise InputError("no intact checkpoint (step-NNNNNNNNN.pt) in this folder", path=str(p))
        p = found
    elif not p.is_file():
        raise InputError("checkpoint not found", path=str(p))
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises many types for a garbled file
            raise InputError(
                f"not a checkpoint ({type(exc).__name__}: {one_line(str(exc))[:120]})", path=str(p)
            ) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise InputError("not a padfree drafter checkpoint (no model state)", path=str(p))
    meta = state.get(META_KEY)
    version = meta.get("version") if isinstance(meta, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > META_VERSION:
        raise InputError(
            f"the checkpoint's export information is version {version}, written by a newer padfree; this one "
            f"reads version {META_VERSION}: export it with the padfree that trained it, or upgrade",
            path=str(p),
        )
    if not isinstance(meta, dict) or version != META_VERSION:
        raise InputError(
            "the checkpoint carries no export information (written before export was supported): train or "
            "resume with examples/train_drafter.py to write one that does",
            path=str(p),
        )
    return p, state["model"], meta


EXPORT_FILES = ("config.json", "model.safetensors")
"""What an export folder holds (an earlier export in ``out`` is replaced as a whole)."""


def check_export_dir(out: str | Path, *, protect: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """``out`` as a folder an export may be written to, checked before anything is (``train_drafter.py
    --export-dir`` checks it before it trains): absent, empty or an earlier export (:data:`EXPORT_FILES`
    only), not a symbolic link, not one of the ``protect`` folders (``(what, folder)``: the target, the
    checkpoint folder) nor inside one, and beside a folder that takes a new entry. Else one
    :class:`OutputError` line naming it."""
    p = Path(out)
    try:
        return _check_export_dir(p, protect)
    except OSError as exc:  # a name too long, a path through a file...
        reason = _reason(exc)
        raise OutputError(f"cannot write the exported drafter ({reason})", path=one_line(str(p))) from None


def _check_export_dir(p: Path, protect: Iterable[tuple[str, str | Path | None]]) -> Path:
    if p.is_symlink():
        raise OutputError(
            "is a symbolic link: an export is written as a folder of its own; give the real path", path=str(p)
        )
    if p.exists() and not p.is_dir():
        raise OutputError("exists and is not a folder: an export is written as a folder", path=str(p))
    real = p.resolve()
    for what, folder in protect:
        if folder is None:
            continue
        f = Path(folder).resolve()
        if real == f or f in real.parents:
            where = "is" if real == f else "is inside"
            raise OutputError(
                f"{where} {what} ({f}): an export is written into a folder of its own", path=str(p)
            )
    if p.is_dir():
        try:
            # a link named as an export's file goes with the folder it is in, never followed
            entries = list(p.iterdir())
            others = sorted(
                e.name for e in entries if e.name not in EXPORT_FILES or (e.is_dir() and not e.is_symlink())
            )
        except OSError as exc:
            raise OutputError(f"cannot read the folder ({exc.strerror or exc})", path=str(p)) from None
        if others:
            raise OutputError(
                f"holds {others[0]}, which is not an export's file: an export replaces the whole folder; "
                "give a new or empty folder, or an earlier export's",
                path=str(p),
            )
    probe = real.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:  # what the export does first, as it does it: a temporary folder beside the output, a file in it
        tmp = _temp_beside(probe, real.name)
        try:
            with open(tmp / "config.json", "w") as fh:
                fh.write("{}\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        raise OutputError(f"cannot write the exported drafter ({_reason(exc)})", path=str(p)) from None
    return p


def _temp_beside(parent: Path, name: str) -> Path:
    """A new temporary folder in ``parent`` for an export to ``parent / name`` (:func:`_remove_stale` knows
    its name: this process's id in it)."""
    return Path(tempfile.mkdtemp(prefix=f".{name}.{os.getpid()}.", suffix=".tmp", dir=parent))


def export_drafter(
    state: dict[str, torch.Tensor],
    meta: dict,
    fmt: str,
    out: str | Path,
    *,
    dtype: str = "float32",
    protect: Iterable[tuple[str, str | Path | None]] = (),
    source: str | Path | None = None,
) -> Path:
    """Write the drafter of ``state`` + ``meta`` in ``fmt`` (:func:`formats`) as the folder ``out`` and return
    it (``source``: the checkpoint file they were read from, named by an error about its tensors). Atomic:
    the files are written into a temporary folder beside ``out``, then renamed into place (an earlier export
    there is replaced as a whole), so a reader or a killed export sees one export or the other, never one's
    weights under another's config. ``out`` is checked by :func:`check_export_dir`, never the target folder
    (``meta``'s) or another ``protect`` folder; a write that fails is one line naming it."""
    check_exportable(meta, fmt)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise ConfigError(f"export dtype must be float32 or bfloat16 (got {dtype!r})")
    target = check_export_dir(out, protect=(("the target folder", meta["target"].get("path")), *protect))
    try:
        config, tensors = method_of_format(fmt).load().export_files(state, meta)
    except InputError as exc:  # the checkpoint's tensors: the file they came from is named
        if exc.path is not None or source is None:
            raise
        raise InputError(exc.rule, path=one_line(str(source))) from None
    tensors = {k: (v.to(dt) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    config["dtype"] = dtype
    try:
        _write_atomically(target, config, tensors)
    except (OSError, SafetensorError) as exc:
        raise OutputError(f"cannot write the exported drafter ({_reason(exc)})", path=str(target)) from None
    return target


def _write_atomically(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` written into a fresh temporary folder beside ``out`` and
    fsynced, then put in ``out``'s place: renamed, or (an earlier export there) exchanged with it in one
    step where the system can (Linux ``renameat2``), else the earlier export moved aside first. Temporary
    folders a killed export left beside ``out`` are removed first."""
    from safetensors.torch import save_file

    from padfree.torch.run.checkpoint import fsync_dir

    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent, out.name)
    tmp = _temp_beside(parent, out.name)
    try:
        os.chmod(tmp, 0o755)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        fd = os.open(tmp / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / "model.safetensors", "rb") as f:
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if not (out.is_dir() and not out.is_symlink()):
            os.rename(tmp, out)
        elif not _exchange(tmp, out):  # no atomic exchange here: the earlier export moves aside first
            aside = _temp_beside(parent, out.name)
            os.replace(out, aside)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.replace(aside, out)
                raise
            tmp = aside
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the new files on failure, the earlier export on success


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or its file system cannot, True once done."""
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_stale(parent: Path, name: str) -> None:
    """Remove the temporary folders of exports to ``parent / name`` whose process is gone (killed)."""
    for entry in parent.glob(f".{glob.escape(name)}.*.tmp"):
        pid = entry.name[len(name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _reason(exc: BaseException) -> str:
    """Why a write failed, in a few words: the OS's reason (safetensors puts it inside its own message)."""
    if isinstance(exc, OSError):
        return exc.strerror or one_line(str(exc))[:160]
    found = re.search(r"I/O error: (.*?)(?: \(os error \d+\))?(?: at path|$)", str(exc))
    return found.group(1) if found else one_line(str(exc))[:160]


def export_models(
    models: Any,
    fmt: str,
    out: str | Path,
    *,
    mask_token_id: int,
    target_path: str | Path | None = None,
    dtype: str = "float32",
    protect: Iterable[tuple[str, str | Path | None]] = (),
) -> Path:
    """Export the drafter of in-memory ``models`` (what a checkpoint of them would export)."""
    state = {k: v.detach().cpu() for k, v in models.drafter.state_dict().items()}
    meta = export_meta(models, mask_token_id=mask_token_id, target_path=target_path)
    return export_drafter(state, meta, fmt, out, dtype=dtype, protect=protect)


def layer_config(d: dict, t: dict) -> dict:
    """The transformers config fields of the drafter's layers both formats write: its sizes (``d``, from the
    export meta), plain rotary embeddings with the target's base, the target's (``t``) context length; no
    biases, no tied embeddings."""
    return {
        "hidden_size": int(d["hidden_size"]),
        "intermediate_size": int(d["intermediate_size"]),
        "num_attention_heads": int(d["num_heads"]),
        "num_key_value_heads": int(d["num_kv_heads"]),
        "head_dim": int(d["head_size"] or d["hidden_size"] // d["num_heads"]),
        "rms_norm_eps": float(d["eps"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(d["rope_theta"])},
        "max_position_embeddings": max_positions(t),
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def take(state: dict, name: str) -> torch.Tensor:
    """The checkpoint's drafter tensor ``name``; one line when it has none."""
    if name not in state:
        raise InputError(
            f"the checkpoint's drafter has no tensor {name} (of {len(state)}): damaged, or written by "
            "another drafter version"
        )
    return state[name]


def max_positions(t: dict) -> int:
    """The context length an export's config declares: the target's (``t``, its config)."""
    return int(t.get("max_position_embeddings") or 32768)


__all__ = [
    "META_KEY",
    "EXPORT_FILES",
    "check_export_dir",
    "check_exportable",
    "default_format",
    "export_drafter",
    "export_meta",
    "export_models",
    "formats",
    "layer_config",
    "max_positions",
    "method_of_format",
    "read_checkpoint",
    "read_checkpoint_file",
    "take",
    "with_verifier",
]
