"""`create`: a model from a directory, uploaded blobs, an existing model or a random preset,
with optional quantization, a LoRA adapter, template, system prompt, parameters, license and
messages.

`create_model` is an async generator of progress dicts. It validates everything it can
before its first item, so a caller that awaits the first item turns bad input into a 400/404
rather than a broken stream. Blobs are pinned from the moment they are known until the
manifest is written (see store.py). A model's adapter is stored (adapters.py) or the create
fails: an adapter is never dropped, and one inherited from a base model is kept. A create that
fails (a full disk included: a 507 naming what was being written) leaves the store as it was:
no manifest, its partial and temporary files removed, and the blobs it wrote discarded unless
something else names or pins them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from mlxr.shared.errors import InsufficientStorage, InvalidRequest, MlxrError
from mlxr.shared.model_checks import check_model_files

from . import adapters as lora
from . import manifest as mf
from . import quantize as quantize_script
from .blobs import digest_ref, parse_digest
from .config_blob import make_config_blob, make_gguf_config_blob, random_label
from .conversions import converting
from .create_request import CreateRequest, RandomSpec  # noqa: F401  (RandomSpec: re-exported)
from .files import is_no_space, no_space_in, says_no_space
from .gguf.convert import GgufSummary, check_supported, is_gguf
from .manifest import Layer, Manifest
from .names import ModelName, parse_name
from .quantize import QuantChoice, parse_quantize
from .random_model import write_random_model
from .sources import media_type_for, select_files
from .store import ModelRecord, Store

_DTYPE_LABELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(text)) \
        or (text.endswith(".gguf") and os.path.isfile(os.path.expanduser(text)))


@dataclass(slots=True)
class _Plan:
    name: ModelName
    base: ModelRecord | None = None  # creating from an existing model
    directory: Path | None = None  # creating from a local directory
    blob_files: dict[str, Layer] = field(default_factory=dict)  # files already in the store
    random: RandomSpec | None = None
    quant: QuantChoice | None = None
    owned: bool = False  # the directory's files may be moved into blobs
    gguf_file: Path | None = None  # a local GGUF file to store as the model layer
    gguf: Layer | None = None  # the GGUF model layer, once it is a blob
    gguf_summary: GgufSummary | None = None
    adapter: lora.Adapter | None = None  # a new adapter, to store
    adapter_checked: bool = False  # checked against the base model's weights
    adapter_layers: list[Layer] = field(default_factory=list)  # stored (or inherited) ones


def _prepare(store: Store, req: CreateRequest) -> _Plan:
    plan = _Plan(parse_name(req.model), random=req.random)
    if req.quantize is not None:
        plan.quant = parse_quantize(req.quantize)
    sources = sum(x is not None and x != {} for x in (req.from_, req.files or None, req.random))
    if sources == 0:
        raise InvalidRequest("neither 'from', 'files' nor 'random' was specified")
    if sources > 1:
        raise InvalidRequest("give only one of 'from', 'files' and 'random'")
    if req.files and any(_is_gguf_name(n) for n in req.files):
        plan.gguf = _gguf_layer(store, req.files)
        plan.gguf_summary = check_supported(store.blobs.path(plan.gguf.hex))
    elif req.files:
        for file_name, ref in req.files.items():
            hex_digest = parse_digest(ref)
            if not store.blobs.exists(hex_digest):
                raise InvalidRequest(f'blob {ref} for "{file_name}" not found: upload it with '
                                     "POST /api/blobs/<digest> first")
            plan.blob_files[file_name] = Layer(media_type_for(file_name), digest_ref(hex_digest),
                                               store.blobs.path(hex_digest).stat().st_size,
                                               name=file_name)
        _check_model_files({n: store.blobs.path(x.hex) for n, x in plan.blob_files.items()})
    elif req.from_ and _looks_like_path(req.from_):
        path = Path(os.path.expanduser(req.from_)).resolve()
        if path.is_file():
            if not is_gguf(path):
                raise InvalidRequest(f'"{req.from_}" is neither a GGUF file nor a model '
                                     "directory")
            plan.gguf_file, plan.gguf_summary = path, check_supported(path)
        else:
            plan.directory = path
            select_files(plan.directory)  # validates now; copied later
    elif req.from_:
        plan.base = store.resolve(req.from_)
        m = store.manifest_of(plan.base)
        plan.gguf = m.gguf()
        layers = m.files()
        if plan.gguf is not None:
            plan.gguf_summary = check_supported(store.blobs.path(plan.gguf.hex))
        elif not layers:
            raise InvalidRequest(f'model "{req.from_}" has no model files to build on')
        plan.blob_files = {x.name: x for x in layers}
        plan.adapter_layers = m.adapters()
    check_model_files(select_files(plan.directory) if plan.directory else  # hostile files: 400
                      {n: store.blobs.path(x.hex) for n, x in plan.blob_files.items()})
    _prepare_adapter(store, req, plan)
    if plan.quant and (plan.gguf or plan.gguf_file):
        raise InvalidRequest("quantizing a GGUF model is not supported: its tensors keep the "
                             "quantization they have")
    if plan.quant and _already_quantized(store, plan):
        raise InvalidRequest("model is already quantized")
    return plan


def _prepare_adapter(store: Store, req: CreateRequest, plan: _Plan) -> None:
    """Read and check a new adapter now, against the base's weights when they are known."""
    if req.adapters:
        files = {}
        for file_name, ref in req.adapters.items():
            hex_digest = parse_digest(ref)
            if not store.blobs.exists(hex_digest):
                raise InvalidRequest(f'blob {ref} for adapter file "{file_name}" not found: '
                                     "upload it with POST /api/blobs/<digest> first")
            files[file_name] = store.blobs.path(hex_digest)
    elif req.adapter_path:
        files = lora.adapter_files(Path(os.path.expanduser(req.adapter_path)))
    else:
        return
    if plan.gguf is not None or plan.gguf_file is not None:
        raise InvalidRequest("adapters on a GGUF model are not supported: create the base "
                             "model from safetensors weights")
    if plan.adapter_layers:
        raise InvalidRequest(f'model "{req.from_}" already has an adapter: only one adapter '
                             "is supported")
    plan.adapter = lora.read_adapter(files)
    base = {n: store.blobs.path(x.hex) for n, x in plan.blob_files.items()} or \
        (select_files(plan.directory) if plan.directory else None)
    if base:
        lora.check_base(plan.adapter, base)
        plan.adapter_checked = True


async def _store_adapter(store: Store, plan: _Plan, work: Path,
                         pin) -> AsyncIterator[dict[str, Any]]:
    """Convert the new adapter to mlx-lm's format and make its two layers."""
    yield {"status": "converting adapter"}
    if not plan.adapter_checked:  # a random base: its weights exist only now
        lora.check_base(plan.adapter, {n: store.blobs.path(x.hex)
                                       for n, x in plan.blob_files.items()})
    weights = await asyncio.to_thread(lora.write_weights, plan.adapter,
                                      work / "adapter" / lora.ADAPTER_WEIGHTS)
    config = plan.adapter.config_bytes()
    pin(hashlib.sha256(config).hexdigest())
    config_hex, config_created = await asyncio.to_thread(store.blobs.add_bytes, config)
    pin(config_hex, config_created)
    hex_digest, size, created = await asyncio.to_thread(store.blobs.add_file, weights, True)
    pin(hex_digest, created)
    plan.adapter_layers = [
        Layer(mf.MEDIA_ADAPTER, digest_ref(hex_digest), size, name=lora.ADAPTER_WEIGHTS),
        Layer(mf.MEDIA_ADAPTER, digest_ref(config_hex), len(config), name=lora.ADAPTER_CONFIG)]
    verb = "creating new layer" if created else "using existing layer"
    yield {"status": f"{verb} {digest_ref(hex_digest)}"}


def _is_gguf_name(file_name: str) -> bool:
    return file_name.lower().endswith(".gguf")


def _gguf_layer(store: Store, files: dict[str, str]) -> Layer:
    """The one GGUF file of an Ollama-style `files` map, as a model layer."""
    if len(files) != 1:
        raise InvalidRequest("a GGUF model is one .gguf file: give it alone in files "
                             "(adapters and projectors are not supported)")
    (file_name, ref), = files.items()
    hex_digest = parse_digest(ref)
    if not store.blobs.exists(hex_digest):
        raise InvalidRequest(f'blob {ref} for "{file_name}" not found: upload it with '
                             "POST /api/blobs/<digest> first")
    path = store.blobs.path(hex_digest)
    if not is_gguf(path):
        raise InvalidRequest(f'"{file_name}" is not a GGUF file')
    return Layer(mf.MEDIA_MODEL, digest_ref(hex_digest), path.stat().st_size)


def _already_quantized(store: Store, plan: _Plan) -> bool:
    if plan.base is not None:
        return bool(plan.base.config.get("quantization"))
    if plan.directory is not None:
        path = plan.directory / "config.json"
    elif "config.json" in plan.blob_files:
        path = store.blobs.path(plan.blob_files["config.json"].hex)
    else:
        return False
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("quantization")
                                             or config.get("quantization_config"))


def _check_model_files(files: dict[str, Path]) -> None:
    if "config.json" not in files:
        raise InvalidRequest("files must include config.json")
    if not any(n.endswith(".safetensors") for n in files):
        raise InvalidRequest("files must include at least one .safetensors file")


async def create_model(store: Store, req: CreateRequest, *,
                       move_files: bool = False) -> AsyncIterator[dict[str, Any]]:
    """Create (or replace) a model; yields Ollama-style progress dicts, ending in success.
    `move_files`: the `from` directory is ours (a download) and its files may be moved."""
    plan = await asyncio.to_thread(_prepare, store, req)
    plan.owned = move_files
    pins: list[str] = []
    made: set[str] = set()  # blobs this create wrote: discarded if it fails
    done = False

    def pin(hex_digest: str, created: bool = False) -> None:
        store.pin(hex_digest)
        pins.append(hex_digest)
        if created:
            made.add(hex_digest)

    for layer in [*plan.blob_files.values(), *plan.adapter_layers]:
        pin(layer.hex)
    if plan.gguf is not None:
        pin(plan.gguf.hex)
    work = store.tmp_dir / f"create-{uuid.uuid4().hex[:12]}"
    try:
        yield {"status": "reading model metadata"}
        files, owned = await _source_files(plan, work)
        if files is not None:
            async for status in _ingest(store, files, owned, plan.blob_files, pin):
                yield status
        if plan.quant:
            async for status in _quantize(store, plan, work, pin):
                yield status
        if plan.adapter is not None:
            async for status in _store_adapter(store, plan, work, pin):
                yield status
        if plan.gguf_file is not None:
            hex_digest, size, created = await asyncio.to_thread(store.blobs.add_file,
                                                                plan.gguf_file, False)
            pin(hex_digest, created)
            plan.gguf = Layer(mf.MEDIA_MODEL, digest_ref(hex_digest), size)
            verb = "creating new layer" if created else "using existing layer"
            yield {"status": f"{verb} {plan.gguf.digest}"}
        if plan.gguf is not None:
            try:
                async for status in converting(store, plan.gguf.hex):
                    yield status
            except MlxrError as exc:
                raise no_space_in(exc, "converting the GGUF model to MLX") from None
        layers = [plan.blob_files[n] for n in sorted(plan.blob_files)]  # deterministic
        if plan.gguf is not None:
            layers = [plan.gguf]
        layers += plan.adapter_layers
        meta = await asyncio.to_thread(_metadata_layers, store, plan.base, req, pin)
        for layer in meta:
            pin(layer.hex)  # inherited layers
            yield {"status": f"using layer {layer.digest}"}
        paths = {name: store.blobs.path(x.hex) for name, x in plan.blob_files.items()}
        template = next((store.blobs.path(x.hex).read_text() for x in meta
                         if x.media_type == mf.MEDIA_TEMPLATE), None)
        label = random_label(plan.random.preset, plan.random.seed) if plan.random else \
            (plan.base.config.get("random") if plan.base else None)
        if plan.gguf is not None:
            config = make_gguf_config_blob(plan.gguf_summary, layers + meta, template)
        else:
            config = await asyncio.to_thread(make_config_blob, paths, layers + meta, template,
                                             label)
        pin(hashlib.sha256(config).hexdigest())
        config_hex, created = await asyncio.to_thread(store.blobs.add_bytes, config)
        pin(config_hex, created)
        m = Manifest(Layer(mf.MEDIA_CONFIG, digest_ref(config_hex), len(config)), layers + meta)
        yield {"status": "writing manifest"}
        await asyncio.to_thread(store.write_manifest, plan.name, m.to_bytes())
        done = True
        yield {"status": "success"}
    except InsufficientStorage as exc:
        raise InsufficientStorage(f"{exc.message} (creating {plan.name.display}: the store is "
                                  "unchanged)") from None
    except OSError as exc:
        if not is_no_space(exc):
            raise
        raise InsufficientStorage(f"no space left on device while creating "
                                  f"{plan.name.display} ({exc.filename or exc.strerror}): the "
                                  "store is unchanged") from None
    finally:
        for hex_digest in pins:
            store.unpin(hex_digest)
        if work.exists():
            await asyncio.to_thread(shutil.rmtree, work, True)
        if not done and made:
            await asyncio.to_thread(store.discard, made)


async def _source_files(plan: _Plan, work: Path) -> tuple[dict[str, Path] | None, bool]:
    """Files still to be copied into blobs, and whether they are ours to move."""
    if plan.random:
        out = work / "random"
        await asyncio.to_thread(write_random_model, out, plan.random.preset, plan.random.seed,
                                dtype=plan.random.dtype)
        return select_files(out), True
    if plan.directory:
        return await asyncio.to_thread(select_files, plan.directory), plan.owned
    return None, False


async def _ingest(store: Store, files: dict[str, Path], owned: bool, into: dict[str, Layer],
                  pin) -> AsyncIterator[dict[str, Any]]:
    for file_name, path in files.items():
        hex_digest, size, created = await asyncio.to_thread(store.blobs.add_file, path, owned)
        pin(hex_digest, created)
        into[file_name] = Layer(media_type_for(file_name), digest_ref(hex_digest), size,
                                name=file_name)
        verb = "creating new layer" if created else "using existing layer"
        yield {"status": f"{verb} {digest_ref(hex_digest)}"}


async def _quantize(store: Store, plan: _Plan, work: Path, pin) -> AsyncIterator[dict[str, Any]]:
    src, dst = work / "quantize-src", work / "quantize-out"
    for file_name, layer in plan.blob_files.items():
        link = src / file_name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(store.blobs.path(layer.hex), link)
    config = json.loads((src / "config.json").read_text())
    if "quantization" in config or "quantization_config" in config:
        raise InvalidRequest("model is already quantized")
    total = sum(x.size for x in plan.blob_files.values() if x.name.endswith(".safetensors"))
    dtype = _DTYPE_LABELS.get(str(config.get("torch_dtype")), "float")
    status = f"quantizing {dtype} model to {plan.quant.describe()}"
    yield {"status": status, "digest": "0", "total": total, "completed": 0}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, quantize_script.__file__, str(src), str(dst), str(plan.quant.bits),
        str(plan.quant.group_size),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except asyncio.CancelledError:
        proc.kill()
        raise
    if proc.returncode != 0:
        text = err.decode(errors="replace")
        tail = text.strip().splitlines()[-5:]
        if says_no_space(text):
            raise InsufficientStorage("no space left on device while quantizing (its partial "
                                      "output was removed): " + " | ".join(tail[-1:]))
        raise MlxrError("quantization failed: " + " | ".join(tail))
    yield {"status": status, "digest": "0", "total": total, "completed": total}
    # The new weights and config replace the old ones; tokenizer files, and sentence-transformers
    # modules in their folders (EmbeddingGemma's Dense weights), are reused as they are.
    kept = {n: x for n, x in plan.blob_files.items()
            if ("/" in n or not n.endswith(".safetensors"))
            and n not in ("config.json", "model.safetensors.index.json")}
    plan.blob_files.clear()
    plan.blob_files.update(kept)
    yield {"status": "verifying conversion"}
    async for status in _ingest(store, select_files(dst), True, plan.blob_files, pin):
        yield status


def _metadata_layers(store: Store, base: ModelRecord | None, req: CreateRequest,
                     pin) -> list[Layer]:
    """Template, system, params, license and messages layers: the request's, else the base's
    (parameters are merged, the request's winning)."""
    inherited: dict[str, list[Layer]] = {}
    if base is not None:
        for layer in store.manifest_of(base).layers:
            if layer.media_type in mf.METADATA_MEDIA:
                inherited.setdefault(layer.media_type, []).append(layer)

    def text_layer(media: str, text: str) -> Layer:
        data = text.encode()
        pin(hashlib.sha256(data).hexdigest())
        hex_digest, created = store.blobs.add_bytes(data)
        pin(hex_digest, created)
        return Layer(media, digest_ref(hex_digest), len(data))

    out: list[Layer] = []
    for media, value in ((mf.MEDIA_TEMPLATE, req.template), (mf.MEDIA_SYSTEM, req.system)):
        out.extend([text_layer(media, value)] if value is not None else inherited.get(media, []))
    params = dict(base.params) if base else {}
    params.update(req.parameters or {})
    if params:
        out.append(text_layer(mf.MEDIA_PARAMS, json.dumps(params) + "\n"))
    if req.license is not None:
        out.extend(text_layer(mf.MEDIA_LICENSE, x) for x in req.license)
    else:
        out.extend(inherited.get(mf.MEDIA_LICENSE, []))
    if req.messages is not None:
        out.append(text_layer(mf.MEDIA_MESSAGES, json.dumps(req.messages) + "\n"))
    else:
        out.extend(inherited.get(mf.MEDIA_MESSAGES, []))
    return out
