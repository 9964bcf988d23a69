"""The store's parsers against hostile input: Modelfiles, /api/create bodies' parameters, model
names and manifests. Each returns or raises its documented error (InvalidRequest, a 400; a
manifest's ManifestError), and what it accepts survives the way back: a Modelfile /api/show
renders parses to the same settings, a name to the same name and a safe manifest path, a
manifest written again reads the same."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from hypothesis import example, given
from hypothesis import strategies as st

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.manifest import Manifest, ManifestError
from mlxr.supervisor.store.modelfile import (normalize_parameters, parse_modelfile,
                                             render_modelfile)
from mlxr.supervisor.store.names import name_from_manifest_path, parse_name
from tests.fuzz import strategies as s

SETTINGS = s.SETTINGS

# -- Modelfiles --------------------------------------------------------------------------------

VALUE = st.one_of(s.TEXT, st.sampled_from(['"quoted"', '"""multi\nline"""', '"""', '"',
                                           '"unterminated', "1e999", "nan", "-0", "9" * 30,
                                           "true", " spaced ", "a\tb"]))
PARAM = st.sampled_from(["temperature", "num_ctx", "top_k", "stop", "use_mmap", "seed",
                         "num_predict", "bogus", "top_p", ""])
LINE = st.one_of(
    VALUE.map(lambda v: f"FROM {v}"),
    st.tuples(PARAM, VALUE).map(lambda t: f"PARAMETER {t[0]} {t[1]}"),
    VALUE.map(lambda v: f"TEMPLATE {v}"), VALUE.map(lambda v: f"SYSTEM {v}"),
    VALUE.map(lambda v: f"LICENSE {v}"), VALUE.map(lambda v: f"ADAPTER {v}"),
    st.tuples(st.sampled_from(["user", "assistant", "system", "robot", ""]), VALUE).map(
        lambda t: f"MESSAGE {t[0]} {t[1]}"),
    st.sampled_from(["# comment", "", "   ", "\t", "from\ttiny", "UNKNOWN x", "\ufeffFROM a"]),
    s.TEXT)
MODELFILES = st.one_of(st.lists(LINE, max_size=8).map("\n".join),
                       st.lists(LINE, max_size=8).map("\r\n".join), st.text(max_size=80))


@SETTINGS
@given(text=MODELFILES)
@example("FROM tiny\nPARAMETER temperature nan")  # was a NaN temperature
@example("FROM tiny\nPARAMETER num_ctx " + "9" * 30)  # was an int orjson cannot write
@example('FROM """multi\nline"""')  # /api/show's text did not parse back
def test_modelfiles_parse_and_render_back(text):
    try:
        mf = parse_modelfile(text)
    except InvalidRequest as err:
        assert err.status == 400 and err.message
        return
    for value in mf.parameters.values():
        assert isinstance(value, (int, float, bool, list))
        if isinstance(value, int) and not isinstance(value, bool):
            assert -(1 << 63) <= value < 1 << 63
        if isinstance(value, float):
            assert value == value and abs(value) != float("inf")
    texts = [mf.from_, mf.template or "", mf.system or "", *mf.license,
             *(m["content"] for m in mf.messages), *mf.parameters.get("stop", [])]
    if any('"' in t for t in texts):
        return  # a Modelfile has no escapes: a quote may end a value early, as in Ollama's
    shown = render_modelfile(mf.from_, template=mf.template, system=mf.system,
                             params=mf.parameters, license=mf.license, messages=mf.messages)
    again = parse_modelfile(shown)
    assert (again.from_, again.template or None, again.system or None, again.parameters,
            again.license, again.messages) == (mf.from_, mf.template or None, mf.system or None,
                                               mf.parameters, mf.license, mf.messages), shown


@SETTINGS
@given(params=s.ANY | s.OPTIONS)
def test_create_parameters(params):
    try:
        typed = normalize_parameters(params)
    except InvalidRequest:
        return
    json.dumps(typed, allow_nan=False)  # stored as the params blob: plain JSON


# -- names -------------------------------------------------------------------------------------

NAME_PART = st.one_of(st.sampled_from(["tiny", "a", "A_b-c.d", "..", ".", "x..y", "-", "_",
                                       "h.co:5000", "hf.co", "a" * 129, "", "é", "a b"]),
                      st.text(alphabet="abc.:-_/\\@+ \x00", max_size=6))
NAMES = st.one_of(st.lists(NAME_PART, max_size=5).map("/".join),
                  st.tuples(st.lists(NAME_PART, max_size=4).map("/".join), NAME_PART).map(
                      lambda t: f"{t[0]}:{t[1]}"),
                  st.sampled_from(["http://h/a/b:c", "https://x", "a/b/c/d", "../../etc/passwd",
                                   "a:", ":b", "a@sha256:00", "a+b"]),
                  s.TEXT)


@SETTINGS
@given(text=NAMES)
def test_names_round_trip_to_safe_paths(text):
    try:
        name = parse_name(text)
    except InvalidRequest as err:
        assert err.status == 400
        return
    assert parse_name(name.full) == name and parse_name(name.display).key == name.key
    path = name.manifest_path
    assert not path.is_absolute() and len(path.parts) == 4
    assert all(part not in ("", ".", "..") and "/" not in part for part in path.parts)
    assert name_from_manifest_path(path).key == name.key


@SETTINGS
@given(parts=st.lists(NAME_PART, max_size=5))
def test_manifest_paths_read_back_or_are_skipped(parts):
    try:
        path = PurePosixPath(*parts) if parts else PurePosixPath()
    except TypeError:
        return
    name = name_from_manifest_path(path)
    assert name is None or name.manifest_path == PurePosixPath(*(p.lower() for p in path.parts))


# -- manifests ---------------------------------------------------------------------------------

DIGEST = st.one_of(st.just("sha256:" + "a" * 64), st.just("sha256:" + "A" * 64),
                   st.just("sha256:x"), st.just("md5:" + "a" * 32), s.ANY)
LAYER = s.either(s.obj(required={"mediaType": s.either(st.sampled_from(
    ["application/vnd.ollama.image.tensor", "application/vnd.ollama.image.template"])),
    "digest": DIGEST, "size": s.NUMBER}, optional={"name": s.either(s.TEXT), "from": s.ANY}))
MANIFEST = s.obj(required={"schemaVersion": s.either(st.just(2), st.just(1)), "config": LAYER,
                           "layers": s.either(st.lists(LAYER, max_size=3))},
                 optional={"mediaType": s.ANY})


@SETTINGS
@given(data=st.one_of(MANIFEST.map(lambda m: json.dumps(m).encode()), st.binary(max_size=64),
                      st.sampled_from([b"[" * 100_000, b"{}", b"\xff", b"null"])))
def test_manifests_read_or_are_refused(data):
    try:
        manifest = Manifest.from_bytes(data)
    except ManifestError:
        return
    again = Manifest.from_bytes(manifest.to_bytes())
    assert again.to_bytes() == manifest.to_bytes()
    assert all(len(x.hex) == 64 for x in again.all_layers())
